"""The keypoint policies' options (``policy=keypoints``, ``policy=keypoints_flow``; the models: ``model`` beside it).
Imports no torch: validating a config reads it, never the model.

Their own options are their classes' constructor arguments, in ``policy.kwargs`` (``Class(policy_cfg, stats,
**policy.kwargs)``), as they were when these policies were plug-ins: ``policy.kwargs.spatial_norm=true`` and the
like keep their meaning, and an argument the class lacks is an error naming its signature. The defaults below are
the ones set on every run so far; the other arguments (``keypoints``, ``hidden``, ``blocks``, ``prediction``) are
added with ``+policy.kwargs.NAME=VALUE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurmvla.config.policy import PolicyConfig
from slurmvla.registry import PolicyEntry


def keypoint_kwargs() -> dict[str, Any]:
    return {
        # true: the spatial softmax reads each feature map standardized, with a learned temperature (the raw maps of
        # a small convolution barely vary and leave every keypoint at the image's centre). false keeps the encoder
        # earlier runs trained.
        "spatial_norm": False,
        # The backbone before the spatial softmax: conv (three convolutions, 96 px -> 24 x 24 maps) or resnet18
        # (Diffusion Policy's image trunk with GroupNorm, 96 px -> 3 x 3 maps; ~25x the multiply-adds at width 64,
        # its own), whose first stage has width channels.
        "encoder": "conv",
        "width": 64,
    }


@dataclass
class KeypointsConfig(PolicyConfig):
    """policy=keypoints: per camera three convolutions and a spatial softmax (where things are in the image), an
    MLP to the action chunk, MSE regression (slurmvla/policy/keypoints/model.py: KeypointPolicy)."""

    name: str = "keypoints"
    size: str = "keypoints"
    kwargs: dict[str, Any] = field(default_factory=keypoint_kwargs)


@dataclass
class KeypointsFlowConfig(KeypointsConfig):
    """policy=keypoints_flow: the keypoint encoder feeding a flow-matching action head, sampled in
    num_inference_steps Euler steps from noise (slurmvla/policy/keypoints/model.py: KeypointFlowPolicy)."""

    name: str = "keypoints_flow"
    size: str = "keypoints_flow"


def prompt_kwargs() -> dict[str, Any]:
    """policy=keypoints_flow_prompt's: the instruction read, standardized maps, 32 keypoints and a 512-wide head (one
    policy for fifty tasks' objects: twice a single task's keypoints)."""
    return {**keypoint_kwargs(), "prompt": True, "spatial_norm": True, "keypoints": 32, "hidden": 512}


@dataclass
class KeypointsFlowPromptConfig(KeypointsFlowConfig):
    """policy=keypoints_flow_prompt: policy=keypoints_flow told its task in words (``policy.kwargs.prompt``: the
    instruction's byte tokens, up to max_text_len, read by a small convolution into the features the action head
    reads), sized for many tasks (:func:`prompt_kwargs`); experiment=mt50's policy."""

    name: str = "keypoints_flow_prompt"
    size: str = "keypoints_flow_prompt"
    # The longest MT50 instruction is 58 bytes.
    max_text_len: int = 64
    kwargs: dict[str, Any] = field(default_factory=prompt_kwargs)


# What policy.name selects (slurmvla.registry.POLICIES finds this folder's ENTRIES).
ENTRIES = (PolicyEntry("keypoints", "slurmvla.policy.keypoints.model:KeypointPolicy",
                       schema="slurmvla.policy.keypoints.config:KeypointsConfig"),
           PolicyEntry("keypoints_flow", "slurmvla.policy.keypoints.model:KeypointFlowPolicy",
                       schema="slurmvla.policy.keypoints.config:KeypointsFlowConfig"),
           PolicyEntry("keypoints_flow_prompt", "slurmvla.policy.keypoints.model:KeypointFlowPolicy",
                       schema="slurmvla.policy.keypoints.config:KeypointsFlowPromptConfig"))
