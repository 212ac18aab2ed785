"""FSDP2 (``fully_shard`` over a DeviceMesh): full shard, shard-grad-op and hybrid sharding.

Parameters stay fp32 (sharded DTensors); under bf16 a MixedPrecisionPolicy casts them for compute
and gradients are reduced in ``engine.reduce_dtype``, so the optimizer's parameters and state are
fp32 by construction. Each of the policy's wrap units (one per layer) is its own FSDP unit, then
the root. Checkpoints are torch.distributed.checkpoint (DCP) folders: every rank writes its shards,
and a run resumes at another world size (DCP reshards on load). In the background
(``checkpoint.async_save``) DCP's ``async_save`` copies each rank's shards to host memory and writes
them from a thread, its collectives on a gloo group of their own. The variants differ only in the
options their registry entries give: a 2-D (hybrid) mesh, and whether parameters are resharded
after forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

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
from slurmvla.engine.materialize import has_meta_parameters, materialize
from slurmvla.engine.memory import States, Tensors
from slurmvla.engine.precision import lower_frozen_base
from slurmvla.launch import DistEnv
from slurmvla.optim import build_adamw
from slurmvla.parameters import checkpoint_keys

DCP_DIR = "dcp"


def hsdp_degrees(cfg: EngineConfig, env: DistEnv) -> tuple[int, int]:
    """(replicate, shard) for hybrid sharding; the one place these degrees are checked."""
    shard = cfg.shard_degree or env.local_world_size
    replicate = cfg.replicate_degree or max(1, env.world_size // shard)
    if replicate * shard != env.world_size:
        raise ValueError(
            f"engine={cfg.name} needs engine.replicate_degree x engine.shard_degree = world size, but "
            f"replicate_degree={replicate} x shard_degree={shard} = {replicate * shard} != world size {env.world_size}"
            f" (ranks per node: {env.local_world_size}); set both degrees, or leave them 0 to shard within a node"
        )
    return replicate, shard


class FSDPEngine(EngineCore):
    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device, settings: StepSettings,
                 hybrid: bool = False, reshard_after_forward: bool = True):
        super().__init__(cfg, env, precision, device, settings)
        self.reshard_after_forward = reshard_after_forward
        self.mesh = self._mesh(hybrid)

    def _mesh(self, hybrid: bool) -> DeviceMesh:
        if hybrid:
            # An explicit 2-D mesh: HSDP without one can silently skip the replicate all-reduce.
            replicate, shard = hsdp_degrees(self.cfg, self.env)
            return init_device_mesh(self.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(self.device.type, (self.env.world_size,), mesh_dim_names=("shard",))

    def prepare(self, policy: nn.Module, optim: OptimConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        self.shard(policy)
        # Parameters are fp32 DTensors now: the optimizer's state is fp32 by construction.
        self.optimizer = build_adamw(read_param_groups(policy, optim), optim, self.device)
        return policy, self.optimizer

    def shard(self, policy: nn.Module) -> None:
        units = policy.wrap_units()
        if not units:
            raise ValueError(f"engine={self.name!r} shards per wrap unit, but {type(policy).__name__}.wrap_units() is empty")
        deferred = has_meta_parameters(policy)  # built on the meta device: materialised after sharding
        if not deferred:
            policy.to(self.device)
        # With low-rank adapters the frozen base is sharded in the compute dtype (FSDP needs one dtype
        # among a unit's trainable parameters only).
        lower_frozen_base(policy, self.compute_dtype)
        reduce = torch.float32 if self.cfg.reduce_dtype == "fp32" else torch.bfloat16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce) if self.compute_dtype != torch.float32 \
            else MixedPrecisionPolicy()
        for unit in units:
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        fully_shard(policy, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp)
        if deferred:
            materialize(policy, self.device)
        self.module = policy

    # -- one optimizer step -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def clip_grad_norm(self) -> torch.Tensor:
        max_norm = self.settings.max_grad_norm
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- state ------------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 state on rank 0 (a collective: every rank must call it); empty elsewhere."""
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}

    def master_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of the fp32 parameters the optimizer steps."""
        return [p.to_local() if isinstance(p, DTensor) else p for g in self.optimizer.param_groups for p in g["params"]]

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the sharded weights from a full fp32 state (every rank passes the full state)."""
        keys = checkpoint_keys(self.module)  # with adapters, a state of the trained tensors alone is whole
        strict = keys is None or set(state) != keys
        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def _sharded_state(self) -> dict:
        """What a checkpoint holds: the model's state (with low-rank adapters, the trained parameters and
        buffers only: :func:`slurmvla.parameters.checkpoint_keys`) and the optimizer's."""
        model, keys = get_model_state_dict(self.module), checkpoint_keys(self.module)
        if keys is not None:
            model = {k: v for k, v in model.items() if k in keys}
        return {"model": model, "optim": get_optimizer_state_dict(self.module, self.optimizer)}

    def save(self, directory: Path) -> None:
        try:
            dcp.save(self._sharded_state(), checkpoint_id=str(directory / DCP_DIR))
        except CheckpointException as e:
            raise first_failure(e) from None

    @property
    def checkpointing(self) -> WriteInBackground:
        """Sharded: every rank copies its part to the host and writes it in the background."""
        return WriteInBackground(self.save_in_background)

    def save_in_background(self, directory: Path) -> BackgroundSave:
        """Copy this rank's shards of the weights and optimizer state to host memory (returns once they
        are copied: training may change the live ones from then on) and write them from DCP's thread.
        Its collectives (the plan, then every rank's write results gathered on rank 0, which writes
        ``.metadata``, and the answer broadcast) run on a gloo group of their own, so ``finish``
        returns on a rank only once every rank's shards are written and flushed."""
        group = checkpoint_group(self.cfg.timeout_s)
        target = directory / DCP_DIR
        # The writer is also the stager DCP uses: it copies every tensor into new CPU memory (on torch
        # 2.11 as on 2.13), and sync_files flushes every shard before the write counts as done.
        writer = FileSystemWriter(str(target), sync_files=True)
        started = dcp.async_save(self._sharded_state(), storage_writer=writer, process_group=group)
        upload = getattr(started, "upload_completion", started)  # AsyncSaveResponse where staging is async
        rank, world = dist.get_rank(group), dist.get_world_size(group)

        def finish() -> list[str]:
            try:
                upload.result()
            except CheckpointException as e:
                raise first_failure(e) from None
            # Complete on every rank now: each checksums its share of the folder.
            names = sorted(str(f.relative_to(directory)) for f in target.rglob("*") if f.is_file())
            return names[rank::world]

        return BackgroundSave(finish, group)

    def load(self, directory: Path) -> None:
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(directory / DCP_DIR))
        # Model and optimizer separately: the combined set_state_dict path can hang on load.
        set_model_state_dict(self.module, state["model"],
                             options=StateDictOptions(strict=checkpoint_keys(self.module) is None))
        set_optimizer_state_dict(self.module, self.optimizer, state["optim"])


def first_failure(e: CheckpointException) -> Exception:
    """The exception behind DCP's report (a BaseException raised on every rank when any rank failed):
    the first failing rank's own (an OSError stays one, so a full disk is said as such)."""
    for rank, (cause, _) in sorted(e.failures.items()):
        if isinstance(cause, Exception):
            if isinstance(cause, OSError):
                return cause
            return RuntimeError(f"rank {rank}: {type(cause).__name__}: {cause}")
    return RuntimeError(f"DCP save failed on ranks {sorted(e.failures)}")


def load_dcp_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state of a DCP checkpoint, in one process and without the model's code."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(Path(directory) / DCP_DIR))
    metadata = reader.read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    dcp.load({"model": model}, storage_reader=reader, no_dist=True)
    return model


def model_states(cfg: EngineConfig, precision: str, t: Tensors, world: int, gpus_per_node: int, hybrid: bool = False,
                 reshard_after_forward: bool = True) -> States:
    """fp32 parameters, gradients and AdamW state sharded over the shard group (the world, or hsdp's shard
    degree), each rank holding ceil(rows / shard) rows of every tensor; no separate master. Transient: the
    gathered parameters in the compute dtype (the root's through backward, two wrap units: computing and
    prefetched; without resharding after forward, every unit from its forward to its backward), and under
    bf16 with fp32 reduction the gradients widened for the reduce-scatter."""
    if not t.units:
        raise ValueError(f"engine={cfg.name} shards per wrap unit, but the policy's wrap_units() is empty")
    low = precision == "bf16"
    c = 2 if low else 4
    fp32_reduce = low and cfg.reduce_dtype == "fp32"
    s = hsdp_degrees(cfg, DistEnv(world_size=world, local_world_size=gpus_per_node))[1] if hybrid else world
    # With low-rank adapters the frozen base is held in the compute dtype (precision.lower_frozen_base).
    frozen_bytes = 2 if (low and t.adapters > 0) else 4
    shard_t, shard_f = t.sharded(s, True), t.sharded(s, False)
    held = {"parameters": 4 * shard_t + frozen_bytes * shard_f, "gradients": 4 * shard_t, "fp32 master weights": 0,
            "AdamW state": 8 * shard_t + 4 * t.trainable_tensors, "buffers": t.buffer_bytes}
    unit_all, unit_trainable = max(t.units)
    if not reshard_after_forward:
        fb = {"gathered parameters (whole model, kept from forward to backward)": c * (t.root[0] + sum(u for u, _ in t.units))}
    else:
        fb = {"gathered parameters (root, kept through backward)": c * t.root[0],
              "gathered parameters (largest unit, x2: computing + prefetched)": 2 * c * unit_all}
    if fp32_reduce:
        fb["fp32 reduce-scatter input (largest unit's gradients)"] = 4 * unit_trainable
    end = {"gathered parameters (root)": c * t.root[0], "root's gradients": c * t.root[1]}
    if fp32_reduce:
        end["root's gradients widened to fp32 for the reduce-scatter"] = 4 * t.root[1]
    dtype = torch.bfloat16 if low else torch.float32
    return States(held, fb, {}, end, (dtype, dtype), [f"sharded over {s} rank(s)"], cast_inputs=low)
