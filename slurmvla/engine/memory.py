"""What an engine's memory rule reads and says: the vocabulary of ``EngineEntry.memory_rule``.

A rule is ``f(cfg: EngineConfig, precision, tensors: Tensors, world, gpus_per_node, **options) -> States``
(``options``: the registry entry's, as the engine class gets them), written beside its engine. It turns
the policy's parameter counts into bytes per GPU (the worst rank), so that ``python -m slurmvla.plan``
plans any registered engine without knowing its name. docs/plan.md lists every engine's rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Tensors:
    """The policy's parameters as an engine sees them: shapes, which train, how they group."""

    # (shape, trainable) per parameter.
    params: list[tuple[tuple[int, ...], bool]]
    buffer_bytes: int
    buffer_float_elements: int
    # Elements (all, trainable) of each wrap unit (policy.wrap_units()), and of whatever no unit holds.
    units: list[tuple[int, int]]
    root: tuple[int, int]
    # Trainable elements of each optimizer parameter group (DeepSpeed flattens each one).
    groups: list[int]
    # Elements of the module holding the most parameters directly (ZeRO-3 gathers per module).
    largest_module: int
    adapters: int = 0

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for s, t in self.params if t)

    @property
    def frozen(self) -> int:
        return sum(math.prod(s) for s, t in self.params if not t)

    @property
    def trainable_tensors(self) -> int:
        return sum(1 for _, t in self.params if t)

    def sharded(self, shard: int, trainable: bool | None = None) -> int:
        """Elements per rank when every tensor is cut into ``shard`` parts along its first dimension, each
        rank holding ceil(rows / shard) rows (FSDP2's padded shards; the worst rank)."""
        total = 0
        for shape, t in self.params:
            if trainable is not None and t != trainable:
                continue
            rows = shape[0] if shape else 1
            total += -(-rows // shard) * (math.prod(shape[1:]) if shape else 1)
        return total

    def partitioned(self, world: int, trainable: bool | None = None) -> int:
        """Elements per rank when every tensor is flattened and cut into ``world`` parts (ZeRO-3)."""
        return sum(-(-math.prod(s) // world) for s, t in self.params if trainable is None or t == trainable)

    def flat_partitions(self, world: int) -> int:
        """Elements per rank of ZeRO-1/2's flat groups: each padded to a multiple of 2 x world, then split."""
        align = 2 * world
        return sum(-(-n // align) * align // world for n in self.groups)


@dataclass
class States:
    """Bytes per GPU: held for the whole run (``held``) and transient in three phases, each a dict of what
    -> bytes (the report prints the names). ``held`` names at least parameters, gradients, fp32 master
    weights and AdamW state (the comparison's columns; 0 where an engine has none)."""

    held: dict[str, int]
    forward_backward: dict[str, int]
    step: dict[str, int]
    end_of_backward: dict[str, int]
    # Parameter dtypes the engine computes with: (trainable, frozen).
    compute: tuple[torch.dtype, torch.dtype]
    notes: list[str] = field(default_factory=list)
    # FSDP2's mixed precision casts the floating inputs of every unit's (and the root's) forward to bf16.
    cast_inputs: bool = False
    # True: ``held["gradients"]`` live through the whole step (DDP's buckets, DeepSpeed's partitions). False: they
    # exist only from the backward that makes them to the optimizer step that frees them
    # (``zero_grad(set_to_none=True)``); the planner's fake step then starts without gradients and counts each
    # as the backward makes it, so the forward + backward phase holds only those made by its peak (with
    # gradient accumulation the planner holds them resident: the first micro-batch's outlive the later forwards).
    gradients_resident: bool = True

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())
