"""Meta-World's fingertip-crop flow policy whose image keypoints are trained onto the objects' pixels
(``policy=keypoints_flow_labelled``; docs/benchmarks.md#meta-world, its tables).

Three of the whole image's keypoints are trained to sit where the task's first object, second object and goal
project into the calibrated corner2 camera (:func:`slurmvla_metaworld_study.hand_crop.model.project`), a squared error in the
spatial softmax's own coordinates added to the flow loss: the label is Meta-World's own observation of the scene,
recorded beside every frame (``observation.environment_state``) and read as a training label
(``data.label_keys``, which ``experiment=metaworld`` sets), never as the state. The policy acts on the images and
the robot's 9 numbers alone, so serving asks a client for nothing else:

    python -m slurmvla.train experiment=metaworld policy=keypoints_flow_labelled policy.image_size=128 \\
        rollout.task=peg-insert-side-v3

Two things make the keypoints useful to the action head, each measured (docs/benchmarks.md, "Keypoints trained onto
the objects' pixels" and "The keypoints at the data's spread"): every keypoint also enters as its offset from the
fingertips' pixel (``relative``: where the object is relative to the hand, what the scripted expert acts on), and
the keypoints with their offsets reach the head standardized by running statistics of the training data
(``standardize``): an object moves a few hundredths of the map's width between scenes, where the normalized
state moves by units. A point the frame does not show (stick-push's goal, above the top edge) trains nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from slurmvla_metaworld_study.hand_crop.model import HandCropFlowPolicy, project

# Meta-World's observation (the 39 numbers): hand 0:3, gripper 3, first object 4:7 (+ quaternion 7:11), second
# object 11:14 (+ 14:18), the previous frame's 18 numbers 18:36, goal 36:39. The labelled points, in order: the
# whole image's keypoints 0, 1 and 2 are trained onto them.
POINTS = ((4, 7), (11, 14), (36, 39))
ENVIRONMENT_DIM = 39


def softmax_coordinates(uv: torch.Tensor, size: int) -> torch.Tensor:
    """Continuous pixel coordinates ``[..., 2]`` (u, v) on a ``size`` x ``size`` feature map -> where the spatial
    softmax (:class:`slurmvla.policy.keypoints.model.SpatialSoftmax`) puts a keypoint peaked there, ``[..., 2]`` (y, x): -1
    at the first cell's centre, 1 at the last's."""
    return ((uv - 0.5) / (size - 1) * 2 - 1).flip(-1)


class RunningStandardize(nn.Module):
    """Features ``[B, F]`` -> ``(x - mean) / std`` by running statistics of the training batches (each training
    call first moves them ``momentum`` of the way towards the batch's, then applies them; at evaluation they are
    fixed): a keypoint whose place varies by a few pixels over the data reaches the head at unit spread, as the
    robot's normalized state does. Not differentiated through the statistics."""

    def __init__(self, features: int, momentum: float = 0.01, eps: float = 1e-4):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("var", torch.ones(features))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                rate = max(self.momentum, 1.0 / float(self.seen + 1))  # the first batches: their plain average
                self.mean.lerp_(x.detach().float().mean(0), rate)
                self.var.lerp_(x.detach().float().var(0, unbiased=False), rate)
                self.seen += 1
        return (x - self.mean) / (self.var + self.eps).sqrt()


class LabelledKeypointFlowPolicy(HandCropFlowPolicy):
    """The fingertip-crop flow policy (:class:`~slurmvla_metaworld_study.hand_crop.model.HandCropFlowPolicy`) whose whole-image
    keypoints 0, 1 and 2 are trained onto the three points' pixels with weight ``aux_weight`` (module docstring).

    ``relative``: every whole-image keypoint also enters the features as its offset from the fingertips' pixel.
    ``standardize``: the whole-image keypoints and their offsets reach the head through :class:`RunningStandardize`.
    ``scaled_extra`` / ``extra``: feature dims a subclass appends through :meth:`extra_features` (standardized with
    the keypoints, and after them), the benchmarks' diagnostics. The features: the whole image's keypoints, the
    crop's, the robot's state, then the offsets and the extras."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, aux_weight: float = 10.0,  # noqa: ANN001
                 relative: bool = True, standardize: bool = True, scaled_extra: int = 0, extra: int = 0, **kwargs):
        super().__init__(cfg, stats, **kwargs)
        if kwargs.get("encoder", "conv") != "conv":
            raise ValueError(f"policy.kwargs.encoder={kwargs['encoder']!r}: the labelled keypoints are tied to pixels "
                             "on the conv encoder's maps only (encoder: conv)")
        self.aux_weight, self.history, self.relative = aux_weight, cfg.num_obs_history, relative
        # The conv encoder's maps: two stride-2 convolutions (96 px -> 24, 128 -> 32).
        self.map_size = (self.global_size + 3) // 4
        whole = len(self.encoders) * 2 * kwargs.get("keypoints", 16)
        self.feature_dim += (whole if relative else 0) + scaled_extra + extra
        self.standardize = RunningStandardize(whole * (2 if relative else 1) + scaled_extra) if standardize else None
        if relative or scaled_extra or extra:
            first = self.head.condition[0]
            self.head.condition[0] = nn.Linear(self.feature_dim + self.head.time_dim, first.out_features)
        self._whole: list[torch.Tensor] = []
        self._centres = torch.zeros(0)

    def keypoints(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        out = super().keypoints(batch)
        self._whole, self._centres = out[0], out[2]
        return out

    def environment(self, batch: dict) -> torch.Tensor:
        """Meta-World's 39 numbers per frame ``[B, history, 39]``, from the batch's training labels."""
        if "labels" not in batch:
            raise ValueError("the labelled keypoints train on Meta-World's 39 numbers, which this batch lacks: set "
                             "data.label_keys=[observation.environment_state] (experiment=metaworld sets it)")
        labels = batch["labels"].float().reshape(batch["labels"].shape[0], self.history, -1)
        if labels.shape[-1] != ENVIRONMENT_DIM:
            raise ValueError(f"the batch's labels have {labels.shape[-1]} numbers a frame; the labelled keypoints "
                             f"read Meta-World's {ENVIRONMENT_DIM} (data.label_keys=[observation.environment_state])")
        return labels

    def points(self, env: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The three points of the 39 numbers ``[..., 39]`` -> their places in the spatial softmax's coordinates
        ``[..., 3, 2]`` (y, x: -1 at the first map cell's centre, 1 at the last's) and whether the image shows each
        ``[..., 3]``: the task has it (an absent second object is all zeros) and it projects inside the frame
        (stick-push's goal lies above the frame's top edge in every scene: a keypoint cannot be trained onto it)."""
        world = torch.stack([env[..., lo:hi] for lo, hi in POINTS], dim=-2)
        uv = project(world, self.map_size)
        inside = ((uv >= 0) & (uv <= self.map_size)).all(-1)
        return softmax_coordinates(uv, self.map_size), (world.abs().sum(-1) > 0) & inside

    def extra_features(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A subclass's appended features: ``(standardized with the keypoints, after them)``; none here."""
        return [], []

    def features(self, batch: dict) -> torch.Tensor:
        whole, crop, state = self.feature_parts(batch)
        mask = batch["image_mask"]
        offsets = []
        if self.relative:  # the fingertips' pixel on the map, in the keypoints' coordinates (y, x)
            hand = softmax_coordinates(self._centres * self.map_size / batch["images"].shape[2], self.map_size)
            for f, keypoints in enumerate(whole):
                k = keypoints.shape[1] // 2
                offset = torch.cat([keypoints[:, :k] - hand[:, f, :1], keypoints[:, k:] - hand[:, f, 1:]], dim=1)
                offsets.append(offset * mask[:, f, None])
        scaled_extra, extra = self.extra_features(batch)
        scaled = [*whole, *offsets, *scaled_extra]
        if self.standardize is not None:  # a masked frame's keypoints and offsets stay zeros
            masks = [mask[:, f, None] for f in range(len(whole))] * (2 if self.relative else 1)
            masks += [torch.ones_like(masks[0])] * len(scaled_extra)
            parts = self.standardize(torch.cat(scaled, dim=1)).split([t.shape[1] for t in scaled], dim=1)
            scaled = [t * m for t, m in zip(parts, masks, strict=True)]
        return torch.cat([*scaled[:len(whole)], *crop, *state, *scaled[len(whole):], *extra], dim=1)

    def aux_error(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample the squared distance summed over the points each frame shows (:meth:`points`), and how many
        points it sums."""
        b = batch["state"].shape[0]
        cells, valid = self.points(self.environment(batch))
        per_frame = len(self._whole) // self.history
        err, count = torch.zeros(b, device=cells.device), torch.zeros(b, device=cells.device)
        for f, keypoints in enumerate(self._whole):
            k = keypoints.shape[1] // 2
            step = f // per_frame
            found = torch.stack([keypoints[:, :len(POINTS)], keypoints[:, k:k + len(POINTS)]], dim=-1)  # (y, x)
            ok = valid[:, step] & batch["image_mask"][:, f, None]
            err = err + ((found - cells[:, step]).square().sum(-1) * ok).sum(-1)
            count = count + ok.sum(-1)
        return err, count

    def forward(self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None) -> dict:
        out = super().forward(batch, noise, t)
        err, count = self.aux_error(batch)
        out["loss"] = out["loss"] + self.aux_weight * err.sum() / count.sum().clamp_min(1)
        out["components"]["aux"] = (err.detach(), count.detach())
        return out
