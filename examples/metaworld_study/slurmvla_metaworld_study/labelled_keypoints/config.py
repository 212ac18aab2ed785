"""The labelled-keypoint policy's options (``policy=keypoints_flow_labelled``; the model: ``model`` beside it).
Imports no torch. Its own options are its class's constructor arguments, in ``policy.kwargs``.

The label is Meta-World's own observation of the scene, read as a training label (``data.label_keys``, which
``experiment=metaworld`` sets), never as the state: the policy acts on the camera's frame and the robot's 9 numbers.
It reads the camera's full frame (the crop is cut from it at full resolution, and the whole image read at it):

    python -m slurmvla.train experiment=metaworld policy=keypoints_flow_labelled policy.image_size=128 \\
        rollout.task=peg-insert-side-v3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurmvla.policy.keypoints.config import KeypointsConfig
from slurmvla.registry import PolicyEntry
from slurmvla_metaworld_study.hand_crop.config import crop_kwargs


def labelled_kwargs() -> dict[str, Any]:
    return {**crop_kwargs(),
            "global_size": 128,
            # The keypoints' loss beside the flow loss (squared error in the spatial softmax's coordinates, -1 to 1).
            "aux_weight": 10.0,
            # Each whole-image keypoint also as its offset from the fingertips' pixel.
            "relative": True,
            # The keypoints and their offsets standardized by running statistics of the training batches.
            "standardize": True}


@dataclass
class KeypointsFlowLabelledConfig(KeypointsConfig):
    """policy=keypoints_flow_labelled: the fingertip-crop flow policy whose whole-image keypoints are trained onto
    the objects' and goal's pixels (LabelledKeypointFlowPolicy)."""

    name: str = "keypoints_flow_labelled"
    size: str = "keypoints_flow_labelled"
    kwargs: dict[str, Any] = field(default_factory=labelled_kwargs)


ENTRIES = (PolicyEntry("keypoints_flow_labelled",
                       "slurmvla_metaworld_study.labelled_keypoints.model:LabelledKeypointFlowPolicy",
                       schema="slurmvla_metaworld_study.labelled_keypoints.config:KeypointsFlowLabelledConfig"),)
