"""The engine: the one layer that knows the parallelism strategies. One dispatch on the name."""

from __future__ import annotations

import torch

from slurmvla.config import ENGINES, Config
from slurmvla.engine.single import SingleEngine
from slurmvla.launch import DistEnv


def build_engine(cfg: Config, env: DistEnv, device: torch.device, micro_batch_size: int) -> SingleEngine:
    name = cfg.engine.name
    if name == "single":
        if env.world_size > 1:
            raise ValueError(
                f"engine=single runs one process, but this job has world size {env.world_size}; "
                f"choose a multi-process engine: {[e for e in ENGINES if e != 'single']}"
            )
        return SingleEngine(cfg.engine, env, cfg.precision, device)
    if name == "ddp":
        from slurmvla.engine.ddp import DDPEngine

        return DDPEngine(cfg.engine, env, cfg.precision, device)
    if name in ("fsdp_full", "fsdp_grad_op", "hsdp"):
        from slurmvla.engine.fsdp import FSDPEngine

        return FSDPEngine(cfg.engine, env, cfg.precision, device)
    if name in ("zero1", "zero2", "zero3"):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ValueError(
                f"engine={name!r} needs DeepSpeed: pip install 'slurmvla[deepspeed]' (or choose one of "
                f"{[e for e in ENGINES if not e.startswith('zero')]})"
            ) from None
        from slurmvla.engine.zero import DeepSpeedEngine

        return DeepSpeedEngine(cfg.engine, env, cfg.precision, device, micro_batch_size,
                               cfg.trainer.grad_accum_steps, cfg.trainer.max_grad_norm)
    raise ValueError(f"engine={name!r} is not valid; choose one of {list(ENGINES)}")


def load_full_model_state(checkpoint, engine_name: str) -> dict[str, torch.Tensor]:  # noqa: ANN001 - a Path
    """The full fp32 policy state of a checkpoint folder, in one process, for any engine."""
    if engine_name in ("fsdp_full", "fsdp_grad_op", "hsdp"):
        from slurmvla.engine.fsdp import load_dcp_model

        return load_dcp_model(checkpoint)
    if engine_name in ("zero1", "zero2", "zero3"):
        from slurmvla.engine.zero import load_zero_model

        return load_zero_model(checkpoint)
    from safetensors.torch import load_file

    from slurmvla.engine.single import MODEL_FILE

    return load_file(str(checkpoint / MODEL_FILE))


__all__ = ["build_engine", "load_full_model_state", "SingleEngine"]
