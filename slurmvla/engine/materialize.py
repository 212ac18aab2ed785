"""Building a large policy without holding it whole on every rank.

Under an FSDP engine, a policy that can initialise each parameter on its own (it defines
``init_parameter(name, tensor, generator)``) is built with its parameters on the meta device (no
memory; buffers stay real: they are small and come from the data's statistics), sharded, and only
then materialised: each rank allocates its shard, and every parameter is initialised whole, one at a
time, from its own generator (seeded by the policy's ``init_seed`` and the parameter's name) and cut
to the rank's shard. Host memory at start-up is the shard plus a few single tensors (one per
initialising thread), not the model, and the weights are bitwise those of a single-process build
with the same seed. The engines that hold the whole model (single, DDP) build the same way and
materialise on their device: no fp32 copy of the model in host memory, nothing moved afterwards, and
the parameters initialised in parallel (each from its own generator, so the threads change nothing). A policy's
``load_initial_weights()`` (pretrained weights) runs after that, writing each rank's part. The
per-parameter generator and the shard-aware copy live in :mod:`slurmvla.parameters`, shared with the
policies, which initialise and load through them without importing this layer.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from slurmvla.parameters import (
    copy_full_into,
    is_dtensor,
    parameter_generator,
    parameters_on_meta,
    supports_deferred_init,
)

# Threads initialising parameters at once (each holds one fp32 tensor on the host while it draws).
INIT_THREADS = max(1, min(8, os.cpu_count() or 1))


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta or (is_dtensor(p) and p.to_local().is_meta) for p in module.parameters())


def materialize(policy: nn.Module, device: torch.device) -> None:
    """Allocate a sharded, meta-built policy's parameters on ``device`` and initialise them (see the
    module docstring)."""
    buffers = {name: b.detach().clone() for name, b in policy.named_buffers()}
    policy.to_empty(device=device)
    with torch.no_grad():
        for name, b in policy.named_buffers():
            b.copy_(buffers[name])

    def init(item: tuple[str, torch.Tensor]) -> None:
        name, p = item
        full = torch.empty(p.shape, dtype=torch.float32)
        policy.init_parameter(name, full, parameter_generator(policy.init_seed, name))
        copy_full_into(p, full)

    # Largest first, so the longest draws start at once; torch's kernels release the GIL.
    params = sorted(policy.named_parameters(), key=lambda item: -item[1].numel())
    with torch.no_grad(), ThreadPoolExecutor(max_workers=INIT_THREADS) as pool:
        list(pool.map(init, params))
    if policy.load_initial_weights is not None:
        policy.load_initial_weights()


def place(policy: nn.Module, device: torch.device) -> nn.Module:
    """A whole policy on ``device``: materialised there when it was built on the meta device, else moved."""
    if has_meta_parameters(policy):
        materialize(policy, device)
    else:
        policy.to(device)
    return policy


__all__ = ["has_meta_parameters", "materialize", "parameters_on_meta", "place", "supports_deferred_init"]
