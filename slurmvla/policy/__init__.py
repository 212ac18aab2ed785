"""Policies: the contract (``Policy``) and its implementations, named in ``slurmvla.registry.POLICIES``."""

from __future__ import annotations

import torch

from slurmvla.config import PolicyConfig
from slurmvla.data.spec import SampleSpec
from slurmvla.policy.base import Policy
from slurmvla.registry import POLICIES


def policy_class(cfg: PolicyConfig) -> type[Policy]:
    return POLICIES.get(cfg.name).load()


def sample_spec(cfg: PolicyConfig) -> SampleSpec:
    """What the configured policy needs its samples to look like (no model is built)."""
    return policy_class(cfg).sample_spec(cfg)


def build_policy(cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None = None) -> Policy:
    return policy_class(cfg)(cfg, stats)


__all__ = ["Policy", "build_policy", "policy_class", "sample_spec"]
