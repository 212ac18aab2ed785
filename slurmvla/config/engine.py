"""The engine's options (``engine.*``; read by ``slurmvla.engine``'s engines) and the precisions (``precision``,
``engine.reduce_dtype``). A schema module of ``slurmvla.config``: it imports no torch and nothing of ``slurmvla`` above
the configuration (layer 1; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.registry import ENGINES
from slurmvla.validators import check_choice, check_positive

# precision (bf16: bf16 compute with fp32 master weights and fp32 optimizer state, on every engine) and
# engine.reduce_dtype.
PRECISIONS = ("fp32", "bf16")
# engine.backend: the process group's; auto picks nccl on CUDA and gloo on CPU.
BACKENDS = ("auto", "nccl", "gloo")


@dataclass
class EngineConfig:
    name: str = "single"
    # Process-group backend: "auto" picks nccl on CUDA and gloo on CPU.
    backend: str = "auto"
    timeout_s: int = 1800
    # Under precision=bf16: the dtype gradients are reduced in across ranks.
    reduce_dtype: str = "fp32"
    # hsdp: shard within groups of shard_degree ranks, replicate across replicate_degree groups.
    # 0 means derived: shard_degree = ranks per node, replicate_degree = world size / shard_degree.
    replicate_degree: int = 0
    shard_degree: int = 0

    def __post_init__(self) -> None:
        ENGINES.check(self.name)
        check_choice("engine.backend", self.backend, BACKENDS)
        check_choice("engine.reduce_dtype", self.reduce_dtype, PRECISIONS)
        check_positive("engine.timeout_s", self.timeout_s)
        check_positive("engine.replicate_degree", self.replicate_degree, allow_zero=True)
        check_positive("engine.shard_degree", self.shard_degree, allow_zero=True)
