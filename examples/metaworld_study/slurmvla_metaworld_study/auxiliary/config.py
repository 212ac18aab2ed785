"""The auxiliary-target policies' options (``policy=keypoints_flow_aux``, ``policy=keypoints_flow_pixel_aux``; the
models and the command that measures them: ``model`` beside it). Imports no torch. Their own options are their
classes' constructor arguments, in ``policy.kwargs``: the keypoint flow policy's and the fingertip crop's defaults,
each of the study's options off unless named (``+policy.kwargs.relative=true``, ``+policy.kwargs.oracle=true``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurmvla.policy.keypoints.config import KeypointsConfig
from slurmvla.registry import PolicyEntry
from slurmvla_metaworld_study.hand_crop.config import crop_kwargs


@dataclass
class KeypointsFlowAuxConfig(KeypointsConfig):
    """policy=keypoints_flow_aux: the keypoint flow policy with an auxiliary head regressing the objects' and goal's
    positions, read from Meta-World's 39 numbers after the robot's 9 in the state (AuxKeypointFlowPolicy)."""

    name: str = "keypoints_flow_aux"
    size: str = "keypoints_flow_aux"


@dataclass
class KeypointsFlowPixelAuxConfig(KeypointsConfig):
    """policy=keypoints_flow_pixel_aux: the labelled keypoints as the study measured them, each option off unless
    named, with the oracle diagnostics (PixelAuxCropFlowPolicy); the fingertip crop's defaults."""

    name: str = "keypoints_flow_pixel_aux"
    size: str = "keypoints_flow_pixel_aux"
    kwargs: dict[str, Any] = field(default_factory=crop_kwargs)


ENTRIES = (PolicyEntry("keypoints_flow_aux", "slurmvla_metaworld_study.auxiliary.model:AuxKeypointFlowPolicy",
                       schema="slurmvla_metaworld_study.auxiliary.config:KeypointsFlowAuxConfig"),
           PolicyEntry("keypoints_flow_pixel_aux", "slurmvla_metaworld_study.auxiliary.model:PixelAuxCropFlowPolicy",
                       schema="slurmvla_metaworld_study.auxiliary.config:KeypointsFlowPixelAuxConfig"))
