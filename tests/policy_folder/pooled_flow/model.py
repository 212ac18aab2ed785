"""Flow matching as the built-in policies train it (slurmvla/policy/flow_matching.py), at its smallest."""

from __future__ import annotations

import torch
from slurmvla.policy.pooled_flow.config import PooledFlowConfig
from torch import nn

from slurmvla.policy.base import register_normalization
from slurmvla.policy.flow_matching import flow_matching_loss, noise_and_time, noisy_actions


class PooledFlowPolicy(nn.Module):
    """The mean colour of each frame, the normalized state, the noisy chunk and the time in, the velocity out,
    through one MLP."""

    def __init__(self, cfg: PooledFlowConfig, stats: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.horizon, self.action_dim, self.steps = cfg.action_horizon, cfg.action_dim, cfg.num_inference_steps
        frames = cfg.num_obs_history * cfg.num_cameras
        inputs = 3 * frames + cfg.num_obs_history * cfg.state_dim + cfg.action_horizon * cfg.action_dim + 1
        self.net = nn.Sequential(nn.Linear(inputs, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
                                 nn.Linear(cfg.hidden, cfg.action_horizon * cfg.action_dim))
        register_normalization(self, cfg, stats)

    def wrap_units(self) -> list[nn.Module]:
        return [self.net]

    def velocity(self, batch: dict, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b = x_t.shape[0]
        pixels = batch["images"].float().mean(dim=(2, 3)).flatten(1) / 255.0
        state = ((batch["state"].float() - self.state_offset) / self.state_scale).reshape(b, -1)
        out = self.net(torch.cat([pixels, state, x_t.flatten(1), t[:, None]], dim=1))
        return out.view(b, self.horizon, self.action_dim)

    def forward(self, batch: dict) -> dict:
        actions = (batch["actions"].float() - self.action_offset) / self.action_scale
        noise, t = noise_and_time(batch, actions, None, None)
        pred = self.velocity(batch, noisy_actions(actions, noise, t), t)
        return flow_matching_loss(pred, noise, actions, batch["action_mask"])

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        """Euler steps from noise (t = 1) to the chunk (t = 0), in the dataset's units."""
        b = batch["state"].shape[0]
        x = torch.randn(b, self.horizon, self.action_dim, device=batch["state"].device)
        for i in range(self.steps):
            t = torch.full((b,), 1.0 - i / self.steps, device=x.device)
            x = x - self.velocity(batch, x, t) / self.steps
        return x * self.action_scale + self.action_offset
