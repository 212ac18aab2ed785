"""The fingertip-crop policies' options (``policy=keypoints_flow_crop``, ``policy=keypoints_crop``; the models:
``model`` beside it). Imports no torch. Their own options are their classes' constructor arguments, in
``policy.kwargs``, as for the keypoint policies they extend (slurmvla/policy/keypoints/config.py).

    python -m slurmvla.train experiment=metaworld policy=keypoints_flow_crop policy.image_size=128 rollout.task=hammer-v3

It reads the camera's full frame (``policy.image_size=128``; the policy says so otherwise)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slurmvla.policy.keypoints.config import KeypointsConfig, keypoint_kwargs
from slurmvla.registry import PolicyEntry


def crop_kwargs() -> dict[str, Any]:
    return {**keypoint_kwargs(),
            "spatial_norm": True,
            # The crop's side in the 128 px frame's pixels (24: 15-30 cm of the table around the fingertips),
            # resampled to crop_size; the whole-image branch reads the frame at global_size.
            "crop": 24, "crop_size": 64, "global_size": 96}


@dataclass
class KeypointsFlowCropConfig(KeypointsConfig):
    """policy=keypoints_flow_crop: the keypoint flow policy with a second view of each frame, a 24 px square of
    corner2's 128 px frame centred on the fingertips (projected through the calibrated camera), read by its own
    convolutions and spatial softmax beside the whole image. Images and the robot's 9 numbers only."""

    name: str = "keypoints_flow_crop"
    size: str = "keypoints_flow_crop"
    kwargs: dict[str, Any] = field(default_factory=crop_kwargs)


@dataclass
class KeypointsCropConfig(KeypointsConfig):
    """policy=keypoints_crop: the same crop on the keypoint policy's regression head (HandCropPolicy). Its
    options are the keypoint policy's, spatial_norm off, as ``policy=keypoints
    policy.target=slurmvla.sim.hand_crop.HandCropPolicy`` ran it; add the crop's with +policy.kwargs.crop=..."""

    name: str = "keypoints_crop"
    size: str = "keypoints_crop"


ENTRIES = (PolicyEntry("keypoints_flow_crop", "slurmvla_metaworld_study.hand_crop.model:HandCropFlowPolicy",
                       schema="slurmvla_metaworld_study.hand_crop.config:KeypointsFlowCropConfig"),
           PolicyEntry("keypoints_crop", "slurmvla_metaworld_study.hand_crop.model:HandCropPolicy",
                       schema="slurmvla_metaworld_study.hand_crop.config:KeypointsCropConfig"))
