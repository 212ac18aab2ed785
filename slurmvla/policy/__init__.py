"""Policies: the contract (``Policy``) and the reference flow-matching VLA."""

from __future__ import annotations

import torch

from slurmvla.config import PolicyConfig
from slurmvla.policy.base import Policy
from slurmvla.policy.flow_vla import FlowMatchingVLA


def build_policy(cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None = None) -> Policy:
    if cfg.name == "flow_vla":
        return FlowMatchingVLA(cfg, stats)
    raise ValueError(f"policy.name={cfg.name!r} is not valid; choose one of ['flow_vla']")


__all__ = ["Policy", "FlowMatchingVLA", "build_policy"]
