"""The engine: the one layer that knows the parallelism strategies. One dispatch on the name."""

from __future__ import annotations

import torch

from slurmvla.config import ENGINES, EngineConfig
from slurmvla.engine.single import SingleEngine
from slurmvla.launch import DistEnv

_ENGINES = {"single": SingleEngine}


def build_engine(cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device) -> SingleEngine:
    if cfg.name not in _ENGINES:
        raise ValueError(f"engine={cfg.name!r} is not valid; choose one of {list(ENGINES)}")
    if cfg.name == "single" and env.world_size > 1:
        raise ValueError(
            f"engine=single runs one process, but this job has world size {env.world_size}; "
            f"choose a multi-process engine (available: {[e for e in ENGINES if e != 'single']})"
        )
    return _ENGINES[cfg.name](cfg, env, precision, device)


__all__ = ["build_engine", "SingleEngine"]
