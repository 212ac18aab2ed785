"""Optimizers and learning-rate schedules (a bottom layer: imports only ``slurmvla.config`` and the registry).

Schedules are multiplicative factors on each parameter group's base lr, computed from the step
alone, so a resumed run needs nothing but the step to continue exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from slurmvla.config import OptimConfig, SchedulerConfig
from slurmvla.registry import SCHEDULERS


def build_adamw(param_groups: list[dict[str, Any]], cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the given groups (each keeps its own lr and weight decay); fused on CUDA."""
    fused = device.type == "cuda" if cfg.fused == "auto" else cfg.fused == "true"
    if fused and device.type != "cuda":
        raise ValueError(f"optim.fused={cfg.fused!r} needs CUDA, but the device is {device}; use optim.fused=auto")
    kwargs: dict[str, Any] = {"betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if fused:
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    groups = [{k: v for k, v in g.items() if k != "param_names"} for g in param_groups]
    return torch.optim.AdamW(groups, lr=cfg.lr, **kwargs)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_constant(step: int, warmup: int) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


Factors = list[Callable[[int], float]]


# -- schedules: one function per entry of slurmvla.registry.SCHEDULERS ---------------------------

def cosine_schedule(cfg: SchedulerConfig, max_steps: int, group_names: list[str]) -> Factors:
    fn = lambda s: warmup_cosine(s, cfg.warmup_steps, cfg.decay_steps or max_steps, cfg.min_lr_ratio)  # noqa: E731
    return [fn for _ in group_names]


def constant_schedule(cfg: SchedulerConfig, max_steps: int, group_names: list[str]) -> Factors:
    return [lambda s: 1.0 for _ in group_names]


def warmup_constant_schedule(cfg: SchedulerConfig, max_steps: int, group_names: list[str]) -> Factors:
    fn = lambda s: warmup_constant(s, cfg.warmup_steps)  # noqa: E731
    return [fn for _ in group_names]


def frozen_backbone_schedule(cfg: SchedulerConfig, max_steps: int, group_names: list[str]) -> Factors:
    k = cfg.frozen_backbone_steps
    if k >= max_steps:
        raise ValueError(
            f"scheduler.frozen_backbone_steps={k} must be smaller than trainer.max_steps={max_steps}; "
            "to never train the backbone use policy.train_expert_only=true"
        )

    def expert(s: int) -> float:
        return warmup_cosine(s, cfg.warmup_steps, cfg.decay_steps or max_steps, cfg.min_lr_ratio)

    def backbone(s: int) -> float:
        # Frozen, then its own warmup, then the same cosine tail as the expert.
        if s < k:
            return 0.0
        return min(warmup_constant(s - k, cfg.warmup_steps), expert(s))

    return [backbone if name.startswith("backbone") else expert for name in group_names]


def lr_factors(cfg: SchedulerConfig, max_steps: int, group_names: list[str]) -> Factors:
    """One factor function per parameter group, by the group's name (backbone_* / expert_*)."""
    return SCHEDULERS.get(cfg.name).load()(cfg, max_steps, group_names)


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, max_steps: int) -> LambdaLR:
    """Build the schedule on the optimizer that actually steps (the engine's final one)."""
    names = [g.get("name", f"group{i}") for i, g in enumerate(optimizer.param_groups)]
    return LambdaLR(optimizer, lr_factors(cfg, max_steps, names))
