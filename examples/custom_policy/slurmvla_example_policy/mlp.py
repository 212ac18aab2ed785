"""Behaviour cloning with an MLP: camera frames and state in, the whole action chunk out.

    each camera frame --conv encoder--> 32 features --+
    proprio state (normalized) -----------------------+--> Linear --> residual MLP blocks --> action chunk

Built by slurmvla as ``MLPPolicy(policy_cfg, stats, **policy.kwargs)``; ``policy_cfg`` gives the
shapes the data is built to (cameras, history, image size, state / action dims, horizon).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES = 32


class FrameEncoder(nn.Module):
    """Two strided convolutions and a global average: one feature vector per frame."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, kernel_size=8, stride=8)
        self.conv2 = nn.Conv2d(16, FEATURES, kernel_size=3, stride=2, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: uint8 ``[N, H, W, 3]`` -> ``[N, FEATURES]``."""
        x = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return x.mean(dim=(2, 3))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPPolicy(nn.Module):
    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, hidden: int = 128, depth: int = 2):  # noqa: ANN001
        super().__init__()
        self.horizon, self.action_dim = cfg.action_horizon, cfg.action_dim
        frames = cfg.num_obs_history * cfg.num_cameras
        self.encoder = FrameEncoder()
        self.inp = nn.Linear(frames * FEATURES + cfg.num_obs_history * cfg.state_dim, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.head = nn.Linear(hidden, self.horizon * self.action_dim)
        # Normalization from the data's statistics, as buffers: they travel with the weights.
        for part, dim in (("state", cfg.state_dim), ("action", cfg.action_dim)):
            offset = torch.zeros(dim) if stats is None else stats[f"{part}_offset"].float().reshape(dim)
            scale = torch.ones(dim) if stats is None else stats[f"{part}_scale"].float().reshape(dim)
            self.register_buffer(f"{part}_offset", offset.clone())
            self.register_buffer(f"{part}_scale", scale.clone())

    def wrap_units(self) -> list[nn.Module]:
        return [self.encoder, *self.blocks]

    def _predict(self, batch: dict) -> torch.Tensor:
        images = batch["images"]  # [B, frames, H, W, 3]
        b, f = images.shape[:2]
        # A missing camera (image_mask false) contributes zeros, not a black image's features.
        feats = self.encoder(images.flatten(0, 1)).view(b, f, FEATURES) * batch["image_mask"][..., None]
        state = ((batch["state"].float() - self.state_offset) / self.state_scale).reshape(b, -1)
        h = self.inp(torch.cat([feats.flatten(1), state], dim=1))
        for block in self.blocks:
            h = block(h)
        return self.head(h).view(b, self.horizon, self.action_dim)

    def forward(self, batch: dict) -> dict:
        pred = self._predict(batch).float()
        target = (batch["actions"].float() - self.action_offset) / self.action_scale
        mask = batch["action_mask"][:, :, None].expand_as(pred).float()
        err = (pred - target).square() * mask
        per_sample_sum, per_sample_count = err.sum(dim=(1, 2)), mask.sum(dim=(1, 2))
        # Divided by a constant of the batch shape (not by the valid count): the loss of a global
        # batch is the mean of its shards' losses on any world size.
        loss = per_sample_sum.sum() / pred.numel()
        return {"loss": loss, "components": {"mse": (per_sample_sum.detach(), per_sample_count.detach())}}

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        return self._predict(batch).float() * self.action_scale + self.action_offset
