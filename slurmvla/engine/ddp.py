"""DistributedDataParallel: replicated weights, gradients all-reduced in backward."""

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurmvla.config.engine import EngineConfig
from slurmvla.engine.memory import States, Tensors
from slurmvla.engine.single import SingleEngine
from slurmvla.engine.single import model_states as replicated_states

# DDP's default bucket_cap_mb: the gradient buckets the all-reduce works on.
BUCKET_BYTES = 25 * 2**20

# DDP's broadcast_buffers became forward_sync_buffers after torch 2.11 (2.13 deprecates the old name; 2.11
# has only the old one): the name this torch has.
_NO_BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(
    DistributedDataParallel.__init__).parameters else "broadcast_buffers"


# (No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.)
def _allreduce_in_fp32(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a bf16 gradient bucket in fp32: summing many ranks' bf16 values in bf16 loses bits."""
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(process_group.size())
    future = dist.all_reduce(wide, group=process_group, async_op=True).get_future()

    def narrow(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(narrow)


class DDPEngine(SingleEngine):
    """The single engine with DDP's gradient all-reduce: the same numerics (fp32 masters under
    bf16) and the same replicated checkpoints (rank 0 writes them), so a DDP run resumes at any
    world size. Only the module the trainer calls and gradient synchronisation differ.
    """

    def wrap(self, policy: nn.Module) -> nn.Module:
        self._ddp = DistributedDataParallel(
            policy,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            # Normalization statistics are identical on every rank; no per-forward broadcast.
            **{_NO_BUFFER_SYNC: False},
        )
        if self.compute_dtype != torch.float32 and self.cfg.reduce_dtype == "fp32":
            self._ddp.register_comm_hook(dist.group.WORLD, _allreduce_in_fp32)
        return self._ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self._ddp.no_sync():
            yield


def model_states(cfg: EngineConfig, precision: str, t: Tensors, world: int, gpus_per_node: int) -> States:
    """The single engine's states, but the gradients resident: they are views of DDP's buckets
    (``gradient_as_bucket_view``), which live as long as the wrapper. Under bf16 with fp32 reduction, two
    buckets in flight are widened to fp32 by :func:`_allreduce_in_fp32`."""
    states = replicated_states(cfg, precision, t, world, gpus_per_node)
    states.gradients_resident = True
    if precision == "bf16" and cfg.reduce_dtype == "fp32":
        states.forward_backward["DDP gradient buckets widened to fp32"] = 2 * 2 * BUCKET_BYTES
    return states
