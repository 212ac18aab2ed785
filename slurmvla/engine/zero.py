"""DeepSpeed ZeRO stages 1, 2 and 3 (the optional ``[deepspeed]`` extra, imported only here).

The policy is built at full shape (initialisers see real fan-in/out) and ZeRO partitions it in
``deepspeed.initialize``. Under bf16 DeepSpeed keeps fp32 master partitions and fp32 Adam state;
under fp32 it trains in fp32. The optimizer handed back to the trainer is the torch AdamW that
actually steps (DeepSpeed's wrapper is not a ``torch.optim.Optimizer``): the LR schedule mutates
its ``param_groups``. DeepSpeed clips inside ``step()``; ``clip_grad_norm`` returns a tensor that
the following ``step()`` fills with the global norm it measured. The stage comes from the
registry entry's options.

In the background (``checkpoint.async_save``) DeepSpeed's own ``save_checkpoint`` runs as usual (its
barriers, its file names) but with a checkpoint engine that serializes each file into host memory
instead of writing it; every rank writes its bytes later from its checkpoint thread. DeepSpeed's own
asynchronous engines do not serve here: the decoupled one (``checkpoint.writer.decoupled``) shares the
live tensors with a spawned process (no snapshot; it waits for the write before the next optimizer
step, needs DeepSpeed's launcher environment, and on the CPU fails to pass ZeRO's state through its
queue), the fast one writes synchronously through libaio, and DataStates is a separate package.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurmvla.config import OptimConfig
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.base import (
    BackgroundSave,
    EngineCore,
    StepSettings,
    WriteInBackground,
    checkpoint_group,
    read_param_groups,
)
from slurmvla.engine.memory import States, Tensors
from slurmvla.launch import DistEnv
from slurmvla.optim import build_adamw
from slurmvla.parameters import has_adapters

DS_DIR = "deepspeed"
DS_TAG = "state"
# DeepSpeed's defaults, which ds_config() leaves alone (elements): zero_optimization's reduce_bucket_size,
# stage3_prefetch_bucket_size, stage3_param_persistence_threshold and stage3_max_live_parameters.
REDUCE_BUCKET = 500_000_000
ZERO3_PREFETCH = 50_000_000
ZERO3_PERSISTENCE = 100_000
ZERO3_MAX_LIVE = 1_000_000_000


class DeepSpeedEngine(EngineCore):
    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device, settings: StepSettings,
                 stage: int, zero_options: dict[str, Any] | None = None):
        super().__init__(cfg, env, precision, device, settings)
        self.stage = stage
        # Extra "zero_optimization" settings (the policy checker partitions every parameter).
        self.zero_options = dict(zero_options or {})
        self._accumulating = False
        self._grad_norm = torch.zeros((), device=device)

    def ds_config(self) -> dict[str, Any]:
        bf16 = self.compute_dtype == torch.bfloat16
        s = self.settings
        return {
            "train_micro_batch_size_per_gpu": s.micro_batch_size,
            "gradient_accumulation_steps": s.grad_accum_steps,
            "train_batch_size": s.micro_batch_size * s.grad_accum_steps * self.env.world_size,
            # DeepSpeed clips inside its step; <= 0 means no clipping there too.
            "gradient_clipping": max(s.max_grad_norm, 0.0),
            "zero_optimization": {"stage": self.stage, **self.zero_options},
            "bf16": {"enabled": bf16},
            # Gradients are reduced in fp32 unless asked otherwise (bf16 sums lose bits).
            "communication_data_type": "fp32" if self.cfg.reduce_dtype == "fp32" or not bf16 else "bf16",
            # torch's own AdamW: no FusedAdam compile on CPU, same update rule as every other engine.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def prepare(self, policy: nn.Module, optim: OptimConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        # Full-shape and fp32 until deepspeed.initialize partitions (and, under bf16, casts) it.
        policy.to(self.device)
        self.module = policy
        # With low-rank adapters a checkpoint leaves out the frozen base (rebuilt from the config; under
        # bf16 DeepSpeed holds it in bf16 as it holds every live parameter).
        self._adapters = has_adapters(policy)
        base = build_adamw(read_param_groups(policy, optim), optim, self.device)
        self._ds, ds_optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=base, config=self.ds_config())
        # The torch optimizer that steps on the fp32 partitions: the LR schedule acts on it.
        self.optimizer = ds_optimizer.optimizer
        return self._ds, self.optimizer

    # -- one optimizer step -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already divided the loss by the accumulation steps.
        self._ds.backward(loss, scale_wrt_gas=False)
        if self._accumulating:
            self._ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def clip_grad_norm(self) -> torch.Tensor:
        # DeepSpeed clips to settings.max_grad_norm inside step(), which fills this tensor.
        return self._grad_norm

    def step(self) -> None:
        assert self._ds.is_gradient_accumulation_boundary(), "step() outside an accumulation boundary"
        self._ds.step()
        norm = self._ds.get_global_grad_norm()
        self._grad_norm.fill_(float(norm) if norm is not None else float("nan"))
        self._ds.zero_grad()

    # -- state ------------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 state (a collective under ZeRO-3: every rank must call it)."""
        from deepspeed.utils import safe_get_full_fp32_param

        state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                 for k, v in self.module.named_buffers()}
        for name, p in self.module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], enabled=self.stage == 3):
                    full = p.detach().float()
            state[name] = full.detach().to("cpu", torch.float32, copy=True)
        return state

    def master_tensors(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions, which DeepSpeed's optimizer steps (its ``param_groups`` hold
        them only during a step under ZeRO-3)."""
        ds = self._ds.optimizer
        return list(ds.fp32_partitioned_groups_flat if self.stage == 3 else ds.single_partition_of_fp32_groups)

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the fp32 partitions of the trained parameters from a full fp32 state (every rank passes it)."""
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in self.module.named_parameters():
            if p.requires_grad:
                safe_set_full_fp32_param(p, state[name].to(self.device))

    def save(self, directory: Path) -> None:
        self._ds.save_checkpoint(str(directory / DS_DIR), tag=DS_TAG, save_latest=False,
                                 exclude_frozen_parameters=self._adapters)

    @property
    def checkpointing(self) -> WriteInBackground:
        """Sharded: every rank copies its part to the host and writes it in the background."""
        return WriteInBackground(self.save_in_background)

    def save_in_background(self, directory: Path) -> BackgroundSave:
        """DeepSpeed's save, every file serialized into host memory now (the same bytes ``torch.save``
        would write: a snapshot of the state at this step); ``finish`` writes and flushes this rank's
        files (no collective: each rank's files are its own) and returns them."""
        capture = _in_memory_files()(self._ds.checkpoint_engine)  # the class imports DeepSpeed: built on first use
        original, self._ds.checkpoint_engine = self._ds.checkpoint_engine, capture
        try:
            self._ds.save_checkpoint(str(directory / DS_DIR), tag=DS_TAG, save_latest=False,
                                 exclude_frozen_parameters=self._adapters)
        finally:
            self._ds.checkpoint_engine = original
        files, capture.files = capture.files, []

        def finish() -> list[str]:
            written = []
            while files:
                path, data = files.pop(0)  # each buffer is freed once written
                with open(path, "wb") as fh:
                    fh.write(data.getbuffer())
                    fh.flush()
                    os.fsync(fh.fileno())
                written.append(str(Path(path).relative_to(directory)))
            return written

        return BackgroundSave(finish, checkpoint_group(self.cfg.timeout_s))

    def load(self, directory: Path) -> None:
        path, _ = self._ds.load_checkpoint(str(directory / DS_DIR), tag=DS_TAG, load_optimizer_states=True,
                                           load_lr_scheduler_states=False, load_module_strict=not self._adapters)
        if path is None:
            raise ValueError(f"{directory / DS_DIR} holds no DeepSpeed checkpoint with tag {DS_TAG!r}")


@functools.cache
def _in_memory_files() -> type:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class InMemoryFiles(CheckpointEngine):
        """A DeepSpeed checkpoint engine that keeps each file it is asked to save as bytes in memory."""

        def __init__(self, inner: Any):
            super().__init__()
            self.name = "slurmvla.InMemoryFiles"
            self.inner = inner
            # DeepSpeed's torch engine writes zip archives unless configured not to: the same here.
            self.zipfile = getattr(inner, "zipfile_serialization", True)
            self.files: list[tuple[str, io.BytesIO]] = []

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            data = io.BytesIO()
            torch.save(state_dict, data, _use_new_zipfile_serialization=self.zipfile)
            self.files.append((path, data))

        def load(self, path: str, map_location: Any = None) -> Any:
            return self.inner.load(path, map_location=map_location)

        def commit(self, info: Any) -> bool:
            return True

    return InMemoryFiles


def load_zero_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a ZeRO checkpoint, consolidated in one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(directory / DS_DIR), tag=DS_TAG)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def model_states(cfg: EngineConfig, precision: str, t: Tensors, world: int, gpus_per_node: int, stage: int) -> States:
    """The ZeRO paper's partitions as DeepSpeed lays them out: under bf16 the whole module in bf16 (frozen
    parameters too), fp32 partitions of the trainable ones and AdamW state on them; ZeRO-1/2's flat groups
    (one per optimizer parameter group) padded to a multiple of 2 x world. Gradients whole (stage 1) or
    partitioned (2, 3); parameters partitioned per tensor (3), gathered per module. Transient: the gradient
    bucket (and its fp32 copy for an fp32 reduction), at the step an fp32 copy of the gradient partition."""
    low = precision == "bf16"
    c = 2 if low else 4
    nt, nf = t.trainable, t.frozen
    part = t.partitioned(world, True) if stage == 3 else t.flat_partitions(world)
    align = 2 * world
    flat = sum(-(-n // align) * align for n in t.groups)
    params = c * t.partitioned(world) if stage == 3 else c * (flat + nf)
    grads = c * (nt if stage == 1 else part)
    held = {"parameters": params, "gradients": grads, "fp32 master weights": 4 * part,
            "AdamW state": 8 * part + 4 * len(t.groups),
            "buffers": (t.buffer_bytes - 2 * t.buffer_float_elements) if low else t.buffer_bytes}
    fb = {"DeepSpeed gradient bucket (reduce_bucket_size)": c * REDUCE_BUCKET}
    if low and cfg.reduce_dtype == "fp32":  # communication_data_type (ds_config)
        fb["its fp32 copy for the reduction"] = 4 * min(REDUCE_BUCKET, nt)
    if stage == 3:
        persistent = sum(n for n in (math.prod(s) for s, _ in t.params) if n < ZERO3_PERSISTENCE)
        gathered = min(ZERO3_MAX_LIVE, t.largest_module + min(ZERO3_PREFETCH, nt + nf) + persistent)
        fb["gathered parameters (largest module + prefetch bucket + persistent)"] = c * gathered
    step = {"fp32 gradient partition": 4 * part} if low else {}
    dtype = torch.bfloat16 if low else torch.float32
    return States(held, fb, step, {}, (dtype, dtype))
