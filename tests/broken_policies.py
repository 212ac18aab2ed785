"""Negative controls for ``python -m slurmvla.check``: a small sound policy, and one broken
variant per check, each with a bug that costs GPU hours in the field and that its check catches (the
multi-rank ones pass every single-process check; some single-process bugs trip more than one check).

Plain ``nn.Module`` classes (no slurmvla base class), built as ``Class(policy_cfg, stats)``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Sound(nn.Module):
    """State and a pooled image feature -> the action chunk, masked MSE over a constant denominator."""

    def __init__(self, cfg, stats=None, width: int = 32):  # noqa: ANN001
        super().__init__()
        self.horizon, self.action_dim = cfg.action_horizon, cfg.action_dim
        self.inp = nn.Linear(cfg.num_obs_history * cfg.state_dim + 3, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, self.horizon * self.action_dim)
        self.gradient_checkpointing = False

    def wrap_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def trunk(self, batch: dict) -> torch.Tensor:
        b = batch["state"].shape[0]
        pixels = batch["images"].float().mean(dim=(1, 2, 3)) / 255.0  # [B, 3]
        return self.inp(torch.cat([batch["state"].float().reshape(b, -1), pixels], dim=1))

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.gradient_checkpointing else block(h)
        return h

    def predict(self, batch: dict) -> torch.Tensor:
        h = self.run_blocks(self.trunk(batch))
        return self.head(h).view(-1, self.horizon, self.action_dim)

    def errors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.predict(batch)
        mask = batch["action_mask"][:, :, None].expand_as(pred).float()
        return (pred - batch["actions"].float()).square() * mask, mask

    def forward(self, batch: dict) -> dict:
        err, mask = self.errors(batch)
        s, c = err.sum(dim=(1, 2)), mask.sum(dim=(1, 2))
        return {"loss": s.sum() / err.numel(), "components": {"mse": (s.detach(), c.detach())}}

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        return self.predict(batch)


class BatchTotals(Sound):
    """output contract: components as batch totals, so validation cannot split a mixed batch."""

    def forward(self, batch: dict) -> dict:
        err, mask = self.errors(batch)
        return {"loss": err.sum() / err.numel(), "components": {"mse": (err.sum().detach(), mask.sum())}}


class LocalCountLoss(Sound):
    """shard invariance: the loss divided by this batch's count of valid elements, so the mean of
    two ranks' losses is not the global batch's loss, and the world size changes the model."""

    def forward(self, batch: dict) -> dict:
        err, mask = self.errors(batch)
        s, c = err.sum(dim=(1, 2)), mask.sum(dim=(1, 2))
        return {"loss": s.sum() / c.sum(), "components": {"mse": (s.detach(), c.detach())}}


class NestedUnits(Sound):
    """wrap units: a container and its blocks both listed, so each block's weights are in two units."""

    def wrap_units(self) -> list[nn.Module]:
        return [self.blocks, *self.blocks]


class ReachesIntoAUnit(Sound):
    """fsdp safety: the root reuses a block's weight from outside that block's forward; under FSDP the
    weight is a shard there (a DTensor), not the full matrix."""

    def predict(self, batch: dict) -> torch.Tensor:
        h = self.run_blocks(self.trunk(batch))
        h = h + F.linear(h, self.blocks[0].fc1.weight)
        return self.head(h).view(-1, self.horizon, self.action_dim)


class PenaltyOverParameters(Sound):
    """zero-3 construction: a weight penalty summed over ``self.parameters()`` inside forward. Under
    ZeRO-3 those are empty partitions there (only attribute access gathers a parameter), so the
    penalty silently vanishes and the run optimises another loss."""

    def forward(self, batch: dict) -> dict:
        out = super().forward(batch)
        penalty = sum(p.square().sum() for p in self.parameters())
        return {**out, "loss": out["loss"] + 1e-2 * penalty}


class LocalOptionalBranch(Sound):
    """rank-divergent inputs: an extra unit runs when this rank's batch holds an instruction, decided on
    its local values, so under FSDP one rank all-gathers a unit the other never asks for."""

    def __init__(self, cfg, stats=None, width: int = 32):  # noqa: ANN001
        super().__init__(cfg, stats, width)
        self.text = nn.Embedding(259, width)
        self.text_block = Block(width)

    def wrap_units(self) -> list[nn.Module]:
        return [*self.blocks, self.text_block]

    def trunk(self, batch: dict) -> torch.Tensor:
        h = super().trunk(batch)
        if bool((batch["text_mask"].sum(dim=1) > 2).any()):  # some sample has more than BOS / EOS
            h = h + self.text_block(self.text(batch["text"]).mean(dim=1))
        return h


class DetachedCheckpoint(Sound):
    """gradient checkpointing: the checkpointed segment starts from a detached activation, so with
    checkpointing on nothing before it learns."""

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing:
            return checkpoint(self.blocks[1], self.blocks[0](h).detach(), use_reentrant=False)
        return super().run_blocks(h)


class UnseededNoise(Sound):
    """determinism: noise from a generator seeded by the OS, so two ranks (or a resumed run) draw
    differently whatever the seed."""

    def trunk(self, batch: dict) -> torch.Tensor:
        h = super().trunk(batch)
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") % 2**63)
        return h + 0.1 * torch.randn(h.shape, generator=g)


# check name -> the broken policy that check must fail, and words of its message.
class PeeksAtActions(Sound):
    """output contract: inference that reads the recorded actions (perfect offline, impossible on a robot)."""

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        return batch["actions"].float() + 0 * self.predict(batch)


NEGATIVE_CONTROLS = {
    "output contract": ("BatchTotals", "not [4] (one value per sample)"),
    "shard invariance": ("LocalCountLoss", "relative from the mean of the two halves"),
    "wrap units": ("NestedUnits", "is in units"),
    "fsdp safety": ("ReachesIntoAUnit", "DTensor"),
    "zero-3 construction": ("PenaltyOverParameters", "rank 0: RuntimeError"),
    "rank-divergent inputs": ("LocalOptionalBranch", "rank 1's samples all without an instruction: "),
    "gradient checkpointing": ("DetachedCheckpoint", "get no gradient"),
    "determinism": ("UnseededNoise", "seeded forwards differ"),
}
