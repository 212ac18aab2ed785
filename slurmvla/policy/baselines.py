"""Reference policies for the closed loop, built through the plug-in contract (``policy=custom``) so they
train, export and serve like any other policy:

- :class:`MeanChunkPolicy`: the baseline a trained policy must beat. It learns one action chunk, the
  mean of the training chunks (its loss is the MSE of that one chunk against every sample), and plays
  it whatever it sees.
- :class:`ZeroPolicy`: outputs zeros (the arm holds still, the gripper stays open): the floor.
- :class:`ReplayPolicy`: replays the recorded actions of a dataset: for the observed state it finds the
  nearest recorded state and returns the actions that followed it in that episode. On the seeds the
  dataset was recorded from (without ``--noise``), the simulator is deterministic, so the loop
  reproduces the expert step for step.

    python -m slurmvla.train experiment=sim_pick policy=custom policy.target=slurmvla.policy.baselines.MeanChunkPolicy
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from slurmvla.policy.base import register_normalization


def chunk_mse(module: nn.Module, pred: torch.Tensor, batch: dict) -> dict:
    """The contract's output for a normalized chunk prediction: the masked MSE against the normalized
    target, divided by a constant of the batch shape (a global batch's loss is its shards' mean)."""
    target = (batch["actions"].float() - module.action_offset) / module.action_scale
    pred = pred.expand_as(target)
    mask = batch["action_mask"][:, :, None].expand_as(pred).float()
    err = (pred - target).square() * mask
    per_sample_sum, per_sample_count = err.sum(dim=(1, 2)), mask.sum(dim=(1, 2))
    return {"loss": per_sample_sum.sum() / pred.numel(),
            "components": {"mse": (per_sample_sum.detach(), per_sample_count.detach())}}


class MeanChunkPolicy(nn.Module):
    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None):  # noqa: ANN001 - a PolicyConfig
        super().__init__()
        self.horizon, self.action_dim = cfg.action_horizon, cfg.action_dim
        self.chunk = nn.Parameter(torch.zeros(self.horizon, self.action_dim))
        register_normalization(self, cfg, stats)

    def forward(self, batch: dict) -> dict:
        return chunk_mse(self, self.chunk, batch)

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        b = batch["state"].shape[0]
        return (self.chunk.float() * self.action_scale + self.action_offset).expand(b, -1, -1).clone()


class ZeroPolicy(MeanChunkPolicy):
    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        return torch.zeros(batch["state"].shape[0], self.horizon, self.action_dim, device=self.chunk.device)


class ReplayPolicy(MeanChunkPolicy):
    """``root``: the recorded dataset; ``state_keys`` / ``action_keys``: the features the policy's state
    and actions are (the experiment's ``data.state_keys`` / ``data.action_keys``)."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, root: str = "",  # noqa: ANN001
                 state_keys: tuple[str, ...] = ("observation.state",),
                 action_keys: tuple[str, ...] = ("action.joint_velocity", "action.gripper_position")):
        super().__init__(cfg, stats)

        import numpy as np

        files = sorted(Path(root).glob("data/*/*.parquet"))
        if not files:
            raise ValueError(f"policy.kwargs.root={root!r} holds no LeRobot data files (data/*/*.parquet)")
        tables = [pq.read_table(f) for f in files]

        def column(key: str) -> np.ndarray:
            values = np.concatenate([t.column(key).to_numpy(zero_copy_only=False) for t in tables])
            return np.stack(values).reshape(len(values), -1).astype(np.float32)

        states = np.concatenate([column(k) for k in state_keys], axis=1)
        actions = np.concatenate([column(k) for k in action_keys], axis=1)
        episodes = np.concatenate([t.column("episode_index").to_numpy() for t in tables])
        self.register_buffer("states", torch.from_numpy(states))
        self.register_buffer("actions", torch.from_numpy(actions))
        self.register_buffer("episodes", torch.from_numpy(episodes))

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        state = batch["state"].float().reshape(batch["state"].shape[0], -1)
        nearest = torch.cdist(state, self.states).argmin(dim=1)
        steps = nearest[:, None] + torch.arange(self.horizon, device=state.device)
        steps = steps.clamp_max(len(self.states) - 1)
        # Past the episode's end: hold its last action.
        last = torch.searchsorted(self.episodes, self.episodes[nearest], right=True) - 1
        steps = torch.minimum(steps, last[:, None])
        return self.actions[steps]
