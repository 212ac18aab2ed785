"""The engine contract: what the trainer, the checkpoint layer and the tools call, and nothing more.

Two faces, each typed on its own: the step API (:class:`Engine`: prepare, forward's autocast, backward, the
optimizer step), which the trainer calls, and the state I/O (:class:`StateIO`: the full weights, the tensors the
optimizer steps, a checkpoint's part and the strategy that writes it), which the checkpoint layer and the moving
average call. Every engine implements both (:class:`TrainingEngine`).

An engine owns placement, wrapping or sharding, the optimizer that steps, mixed precision and
gradient synchronisation. Engines are named in ``slurmvla.registry.ENGINES`` with their
capabilities; ``slurmvla.engine.build_engine`` is the one dispatch on the name. Implementations
share behaviour by composition (``precision.MasterWeights``, :func:`autocast`), not by overriding
one another.
"""

from __future__ import annotations

import contextlib
import datetime
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from slurmvla.config import OptimConfig
from slurmvla.config.engine import EngineConfig
from slurmvla.launch import DistEnv


@dataclass(frozen=True)
class StepSettings:
    """How one optimizer step is made, fixed for the run: every engine gets them at construction."""

    micro_batch_size: int
    grad_accum_steps: int
    # <= 0: measure the norm, never clip.
    max_grad_norm: float


@runtime_checkable
class Engine(Protocol):
    """The step API: what the trainer calls to make one optimizer step. The engine's state (its weights, the
    tensors the optimizer steps, its part of a checkpoint) is its other face, :class:`StateIO`."""

    name: str
    precision: str
    env: DistEnv
    device: torch.device
    settings: StepSettings

    def prepare(self, policy: nn.Module, optim: OptimConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place, wrap or shard the policy and build its optimizer from the policy's parameter groups
        (read after wrapping: sharding replaces the parameter objects). Returns the module to call
        for forward (a DDP / DeepSpeed wrapper where there is one) and the optimizer that actually
        steps (the one an LR schedule must act on). Called once."""
        ...

    def autocast(self) -> contextlib.AbstractContextManager:
        """Around forward: the compute dtype (a no-op in fp32)."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around every micro-batch of an accumulation but the last: no gradient synchronisation."""
        ...

    def clip_grad_norm(self) -> torch.Tensor:
        """Clip to ``settings.max_grad_norm``; returns the global norm before clipping (no host sync)."""
        ...

    def step(self) -> None:
        """Optimizer step, then zero the gradients."""
        ...


# -- the state I/O ---------------------------------------------------------------------------------
#
# How an engine writes its part of a checkpoint is declared, as one of three strategies
# (``StateIO.checkpointing``); the checkpoint layer dispatches on the strategy's type, never on which methods an
# engine happens to have. A strategy that writes in the background (``background``) is used under
# ``checkpoint.async_save`` when the engine's registry entry says ``background_save`` too (the two agree for every
# registered engine: tests/engine/test_state_io.py).


@dataclass(frozen=True)
class BackgroundSave:
    """One rank's part of a checkpoint, copied to host memory when the save was called and written
    while training goes on (:class:`WriteInBackground`).

    ``finish`` runs in this rank's checkpoint thread: it blocks until this rank's part is on disk and
    flushed, and returns the files (relative to the checkpoint folder) this rank checksums; it raises
    when the write failed. ``group`` is a CPU process group only checkpoint threads use, in the same
    order on every rank: never the one the training thread's collectives run on."""

    finish: Callable[[], list[str]]
    group: Any  # torch.distributed.ProcessGroup


@dataclass(frozen=True)
class Synchronous:
    """Every save blocks training: :meth:`StateIO.save` on every rank."""

    background: ClassVar[bool] = False


@dataclass(frozen=True)
class SnapshotThenWrite:
    """Replicated state: ``snapshot()`` (every rank calls it) copies the state to the host now and returns a
    function that writes it into a directory later, from rank 0's checkpoint thread (a no-op on the other ranks).
    ``StateIO.save`` is then ``snapshot()(directory)``."""

    snapshot: Callable[[], Callable[[Path], None]]
    background: ClassVar[bool] = True


@dataclass(frozen=True)
class WriteInBackground:
    """Sharded state: ``start(directory)`` (every rank calls it) copies this rank's part to the host and starts
    writing it; each rank's checkpoint thread then waits for it (:class:`BackgroundSave`)."""

    start: Callable[[Path], BackgroundSave]
    background: ClassVar[bool] = True


# The strategies an engine may declare.
CheckpointStrategy = Synchronous | SnapshotThenWrite | WriteInBackground


@runtime_checkable
class StateIO(Protocol):
    """The engine's state: the full weights, the tensors the optimizer steps, and its part of a checkpoint,
    written by the strategy it declares. What the checkpoint layer and the moving average call (the trainer's
    step goes through :class:`Engine`)."""

    name: str
    precision: str
    env: DistEnv
    # The policy as prepared (``Engine.prepare``; its adapters decide what a checkpoint holds); None before.
    module: nn.Module | None

    @property
    def checkpointing(self) -> CheckpointStrategy:
        """How :meth:`save`'s files are written under ``checkpoint.async_save`` (declared, the same for every
        instance of the class; :class:`Synchronous` where the engine has no background write)."""
        ...

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 policy state as CPU tensors (a collective where the state is sharded:
        every rank calls it)."""
        ...

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 tensors the optimizer steps, as this rank holds them (its shards or partitions);
        the same list, in the same order, at every call. The moving average is kept of these."""
        ...

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the trained fp32 weights from a full state (every rank passes it)."""
        ...

    def save(self, directory: Path) -> None:
        """Write this rank's part of a checkpoint into ``directory`` now (the checkpoint layer makes it atomic)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what :meth:`save` (or the background strategy) wrote, weights and optimizer state."""
        ...


@runtime_checkable
class TrainingEngine(Engine, StateIO, Protocol):
    """What :func:`slurmvla.engine.build_engine` returns: one object with both faces. The trainer steps it and
    hands it, as :class:`StateIO`, to the checkpoint layer and the moving average."""


# Weak references, as for the collectives' control group: the group belongs to torch.distributed's
# registry and goes with the default group (a reference held here would outlive it).
_checkpoint_group: tuple[weakref.ref, weakref.ref] | None = None


def checkpoint_group(timeout_s: float) -> Any:
    """A gloo group for the collectives of background checkpoint writes (DCP's plan and write
    exchanges, the checksum gather), created once per default group. It is never the training's own
    group: two threads issuing collectives on one group would interleave them differently on different
    ranks. Every rank must reach the first call together (inside a save)."""
    global _checkpoint_group
    world = dist.group.WORLD
    group = _checkpoint_group[1]() if _checkpoint_group is not None and _checkpoint_group[0]() is world else None
    if group is None:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        _checkpoint_group = (weakref.ref(world), weakref.ref(group))
    return group


class EngineCore:
    """What every engine holds: its settings, the compute dtype, the policy it prepared and the optimizer
    that steps; and the autocast around forward that follows from them. The engines derive from it and
    override none of it (they share behaviour by composition otherwise)."""

    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device, settings: StepSettings):
        self.cfg, self.env, self.precision, self.device, self.settings = cfg, env, precision, device, settings
        self.name = cfg.name
        self.compute_dtype = compute_dtype(precision)
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.compute_dtype)


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def read_param_groups(policy: nn.Module, optim: OptimConfig) -> list[dict]:
    """The policy's parameter groups (backbone / expert x decay / no decay) with the configured lrs."""
    return policy.param_groups(optim.weight_decay, optim.lr, optim.backbone_lr_scale)
