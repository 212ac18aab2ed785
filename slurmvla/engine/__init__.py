"""The engine: the one layer that knows the parallelism strategies. One dispatch on the name,
through ``slurmvla.registry.ENGINES``.

Importing the package imports no torch (``slurmvla.config.engine``, the engine's options, is read when any config
is composed): the builder and the contract's classes (``Engine``, the step API; ``StateIO``, the state I/O;
``TrainingEngine``, both; ``StepSettings``) load it when first used."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from slurmvla.registry import ENGINES

if TYPE_CHECKING:
    import torch

    from slurmvla.config import Config
    from slurmvla.engine.base import Engine, StateIO, StepSettings, TrainingEngine
    from slurmvla.launch import DistEnv


def build_engine(cfg: Config, env: DistEnv, device: torch.device, micro_batch_size: int) -> TrainingEngine:
    from slurmvla.engine.base import StepSettings

    entry = ENGINES.get(cfg.engine.name)
    if not entry.multi_process and env.world_size > 1:
        raise ValueError(
            f"engine={entry.name} runs one process, but this job has world size {env.world_size}; "
            f"choose a multi-process engine: {list(ENGINES.names(multi_process=True))}"
        )
    if entry.requires and importlib.util.find_spec(entry.requires) is None:
        raise ValueError(
            f"engine={entry.name!r} needs {entry.requires}: pip install -e '.[{entry.requires}]' (or choose one "
            f"of {list(ENGINES.names(requires=None))})"
        )
    settings = StepSettings(micro_batch_size, cfg.trainer.grad_accum_steps, cfg.trainer.max_grad_norm)
    return entry.load()(cfg.engine, env, cfg.precision, device, settings, **entry.options)


def __getattr__(name: str) -> Any:
    # slurmvla.engine.Engine / StateIO / TrainingEngine / StepSettings, the contract's classes, imported (with torch)
    # on first use.
    if name in _CONTRACT:
        from slurmvla.engine import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_CONTRACT = ("Engine", "StateIO", "TrainingEngine", "StepSettings")
__all__ = [*_CONTRACT, "build_engine"]
