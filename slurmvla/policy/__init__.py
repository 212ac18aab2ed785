"""Policies: the contract (``Policy``), the built-in ones named in ``slurmvla.registry.POLICIES``, and
a user's own (``policy=custom policy.target=package.module.Class``).

Importing the package imports no torch: what every policy has (``slurmvla.config.policy``) and each built-in
policy's options (its schema, e.g. ``slurmvla.policy.pi0.config``) live here beside the models, and validating a
config imports the schemas alone. The contract and the builders import torch when first used."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from slurmvla.config.policy import PolicyConfig
from slurmvla.registry import POLICIES

if TYPE_CHECKING:
    import torch

    from slurmvla.data.spec import SampleSpec
    from slurmvla.policy.base import Policy


def policy_class(cfg: PolicyConfig) -> type[Policy]:
    """The class ``policy.name`` (or, for ``custom``, ``policy.target``) names, with the contract's defaults."""
    from slurmvla.policy.base import as_policy_class, import_class

    entry = POLICIES.get(cfg.name)
    if entry.target:
        return as_policy_class(entry.load(), where=f"policy.name={cfg.name}")
    return as_policy_class(import_class(cfg.target), where=f"policy.target={cfg.target}")


def sample_spec(cfg: PolicyConfig) -> SampleSpec:
    """What the configured policy needs its samples to look like (no model is built)."""
    return policy_class(cfg).sample_spec(cfg)


def build_policy(cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None = None, on_meta: bool = False) -> Policy:
    """The configured policy, with its low-rank adapters when ``policy.lora.enabled`` (added after the
    policy's own weights are in: slurmvla/policy/lora.py). ``on_meta``: a policy that can initialise
    parameter by parameter is built with its parameters on the meta device, for the caller to initialise
    or load where they will live (``slurmvla.engine.materialize``); one that cannot is built whole."""
    from slurmvla.parameters import parameters_on_meta, supports_deferred_init
    from slurmvla.policy.base import construct

    if getattr(cfg, "gradient_checkpointing", None) == "auto":
        # Training makes auto concrete before it builds (slurmvla.planner.recompute_choice); a policy built
        # anywhere else (checks, inference) has no GPU budget to fit and gets the policy's switch as a bool: off.
        cfg = dataclasses.replace(cfg, gradient_checkpointing=False)
    cls = policy_class(cfg)
    with parameters_on_meta() if on_meta and supports_deferred_init(cls) else contextlib.nullcontext():
        policy = construct(cls, cfg, stats)
        if cfg.lora.enabled:
            from slurmvla.policy.lora import apply_lora

            apply_lora(policy, cfg)
    return policy


def __getattr__(name: str) -> Any:
    # slurmvla.policy.Policy, the contract's base class, imported (with torch) on first use.
    if name == "Policy":
        from slurmvla.policy.base import Policy

        return Policy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Policy", "build_policy", "policy_class", "sample_spec"]
