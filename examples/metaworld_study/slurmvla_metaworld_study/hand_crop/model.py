"""Meta-World's keypoint policies with a second view of each frame: a crop of the camera's image centred where the
fingertips are (``policy=keypoints_flow_crop``; docs/benchmarks.md#meta-world, what it changes, measured).

The corner2 camera is fixed and calibrated (its pose and field of view are the embodiment's facts,
:mod:`slurmvla.sim.metaworld`), and the robot knows its fingertips' positions (the state's 9 numbers), so the
pixel between the fingertips is known in every frame: :func:`project` maps a point of the world into the image
by the camera's pinhole model. The crop around that pixel, resampled and encoded by its own convolutions and
spatial softmax, gives keypoints in the hand's own frame: where the object is relative to the fingers, the
quantity the scripted expert acts on, and the same function of the crop wherever on the table the scene is (the
whole image's keypoints must instead learn the scene's absolute place from ten demonstrations). The policy reads
images and the robot's 9 numbers, nothing of the environment's own state:

    python -m slurmvla.train experiment=metaworld policy=keypoints_flow_crop policy.image_size=128 \\
        rollout.task=hammer-v3
    # the regression head: policy=keypoints_crop ...

``policy.image_size=128``: the camera's own frame, so the crop is cut at full resolution (``experiment=metaworld``
reads 96 otherwise, and the policy says so); the whole-image branch reads it resized to ``global_size`` (96, the
keypoint policies' size there).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from slurmvla.policy.keypoints.model import (
    KeypointFlowPolicy,
    KeypointPolicy,
    SpatialSoftmax,
    keypoint_backbone,
)
from slurmvla.sim.metaworld.env import (
    CAMERA_FOVY,
    CAMERA_POSITION,
    CAMERA_ROTATION,
    FINGERTIPS,
    IMAGE_SIZE,
    STATE_DIM,
)


def project(points: torch.Tensor, size: int) -> torch.Tensor:
    """World points ``[..., 3]`` -> their continuous pixel coordinates ``[..., 2]`` (u right, v down, (0, 0) the
    top-left corner of the top-left pixel) in the corner2 camera's ``size`` x ``size`` image, as MuJoCo renders
    it: the pinhole model with the vertical field of view ``CAMERA_FOVY``."""
    rot = torch.tensor(CAMERA_ROTATION, dtype=points.dtype, device=points.device)
    pos = torch.tensor(CAMERA_POSITION, dtype=points.dtype, device=points.device)
    cam = (points - pos) @ rot  # the point in the camera's axes
    focal = (size / 2) / np.tan(np.deg2rad(CAMERA_FOVY) / 2)
    depth = (-cam[..., 2]).clamp_min(1e-3)
    return torch.stack([focal * cam[..., 0] / depth + size / 2, -focal * cam[..., 1] / depth + size / 2], dim=-1)


def crop_around(images: torch.Tensor, centre: torch.Tensor, crop: int, out: int) -> torch.Tensor:
    """``images`` ``[N, C, S, S]`` -> ``[N, C, out, out]``: the ``crop`` x ``crop`` pixel square centred on
    ``centre`` ``[N, 2]`` (pixel coordinates, :func:`project`), bilinearly resampled; outside the image, zeros."""
    n, _, s, _ = images.shape
    lin = (torch.arange(out, device=images.device, dtype=images.dtype) + 0.5) / out - 0.5  # -0.5 .. 0.5
    offsets = lin * crop
    # grid_sample's coordinates (align_corners=False): -1 is the left edge of the first pixel, 1 the right of the last.
    xs = (centre[:, 0, None] + offsets[None]) / s * 2 - 1
    ys = (centre[:, 1, None] + offsets[None]) / s * 2 - 1
    grid = torch.stack([xs[:, None, :].expand(n, out, out), ys[:, :, None].expand(n, out, out)], dim=-1)
    return F.grid_sample(images, grid.to(images.dtype), mode="bilinear", padding_mode="zeros", align_corners=False)


class HandCrop:
    """What the hand-crop policies add to a keypoint policy (:class:`~slurmvla.policy.keypoints.model.KeypointEncoding`):
    its whole-image branch reads the frame resized to ``global_size``, and per frame a ``crop`` px square of the
    camera's frame, centred on the fingertips' midpoint and resampled to ``crop_size``, is read by its own backbone
    and spatial softmax (``keypoints`` more keypoints a frame). The head's first layer is rebuilt for the longer
    features. ``robot_state=False``: the head reads the keypoints alone (the state still places the crop), so what
    the arm does must be read off the images."""

    def add_crop(self, cfg, crop: int, crop_size: int, global_size: int, keypoints: int,  # noqa: ANN001
                 spatial_norm: bool, encoder: str, width: int, robot_state: bool = True) -> None:
        if cfg.state_dim < STATE_DIM:
            raise ValueError(f"policy.state_dim={cfg.state_dim}: a hand-crop policy reads the fingertips from the "
                             f"state (Meta-World's {STATE_DIM} numbers: hand, right and left fingertip)")
        if cfg.image_size != IMAGE_SIZE:
            raise ValueError(f"policy.image_size={cfg.image_size}: a hand-crop policy cuts its crop from the "
                             f"camera's own {IMAGE_SIZE} x {IMAGE_SIZE} frame; set policy.image_size={IMAGE_SIZE}")
        if not 0 < crop <= IMAGE_SIZE:
            raise ValueError(f"policy.kwargs.crop={crop}: the crop's side in the frame's pixels, 1 to {IMAGE_SIZE}")
        self.crop, self.crop_size, self.global_size = crop, crop_size, global_size
        frames = cfg.num_obs_history * cfg.num_cameras
        self.crop_encoders = nn.ModuleList(nn.Sequential(
            *keypoint_backbone(encoder, keypoints, width), SpatialSoftmax(keypoints if spatial_norm else None))
            for _ in range(frames))
        self.feature_dim += frames * 2 * keypoints
        self.robot_state = robot_state
        if not robot_state:
            self.feature_dim -= cfg.num_obs_history * cfg.state_dim

    def keypoints(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Per frame the whole image's keypoints and the crop's (each ``[B, 2 * keypoints]``, a masked frame's
        zeros), and the pixel each frame's crop is centred on ``[B, frames, 2]`` (u, v in the camera's frame)."""
        images = batch["images"]  # [B, frames, S, S, 3] uint8, frames = history x cameras (history first)
        b, frames, s = images.shape[:3]
        x = images.permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
        state = batch["state"].float().reshape(b, -1, batch["state"].shape[-1])  # [B, history, D]
        right, left = FINGERTIPS
        fingers = (state[..., right] + state[..., left]) / 2
        history = state.shape[1]
        whole = x.flatten(0, 1)
        if s != self.global_size:
            whole = F.interpolate(whole, size=(self.global_size,) * 2, mode="bilinear", antialias=True,
                                  align_corners=False)
        whole = whole.view(b, frames, 3, self.global_size, self.global_size)
        centres = project(fingers, s).repeat_interleave(frames // history, dim=1)  # each frame its own step's hand
        crops = crop_around(x.flatten(0, 1), centres.flatten(0, 1), self.crop * s // IMAGE_SIZE, self.crop_size)
        crops = crops.view(b, frames, 3, self.crop_size, self.crop_size)
        mask = batch["image_mask"]
        whole_points = [enc(whole[:, f]) * mask[:, f, None] for f, enc in enumerate(self.encoders)]
        crop_points = [enc(crops[:, f]) * mask[:, f, None] for f, enc in enumerate(self.crop_encoders)]
        return whole_points, crop_points, centres

    def feature_parts(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """What :meth:`features` concatenates, in its order: the whole image's keypoints and the crop's (per frame),
        and the normalized state ``[B, history * D]`` (none with ``robot_state=False``)."""
        whole_points, crop_points, _ = self.keypoints(batch)
        if not self.robot_state:
            return whole_points, crop_points, []
        return whole_points, crop_points, [self.normalized_state(batch)]

    def features(self, batch: dict) -> torch.Tensor:
        whole_points, crop_points, state = self.feature_parts(batch)
        return torch.cat([*whole_points, *crop_points, *state], dim=1)

    def wrap_units(self) -> list[nn.Module]:
        return [*self.encoders, *self.crop_encoders, self.head]


class HandCropFlowPolicy(HandCrop, KeypointFlowPolicy):
    """:class:`~slurmvla.policy.keypoints.model.KeypointFlowPolicy` with the fingertips' crop (:class:`HandCrop`)."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, crop: int = 24,  # noqa: ANN001
                 crop_size: int = 64, global_size: int = 96, keypoints: int = 16, hidden: int = 256,
                 blocks: int = 3, spatial_norm: bool = True, encoder: str = "conv", width: int = 64,
                 robot_state: bool = True, **kwargs):
        super().__init__(cfg, stats, keypoints=keypoints, hidden=hidden, blocks=blocks, spatial_norm=spatial_norm,
                         encoder=encoder, width=width, **kwargs)
        self.add_crop(cfg, crop, crop_size, global_size, keypoints, spatial_norm, encoder, width, robot_state)
        first = self.head.condition[0]
        self.head.condition[0] = nn.Linear(self.feature_dim + self.head.time_dim, first.out_features)


class HandCropPolicy(HandCrop, KeypointPolicy):
    """:class:`~slurmvla.policy.keypoints.model.KeypointPolicy` (the chunk regressed) with the fingertips' crop
    (:class:`HandCrop`)."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, crop: int = 24,  # noqa: ANN001
                 crop_size: int = 64, global_size: int = 96, keypoints: int = 16, hidden: int = 256,
                 spatial_norm: bool = True, encoder: str = "conv", width: int = 64, robot_state: bool = True):
        super().__init__(cfg, stats, keypoints=keypoints, hidden=hidden, spatial_norm=spatial_norm, encoder=encoder,
                         width=width)
        self.add_crop(cfg, crop, crop_size, global_size, keypoints, spatial_norm, encoder, width, robot_state)
        self.head[0] = nn.Linear(self.feature_dim, self.head[0].out_features)
