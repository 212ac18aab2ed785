"""Writing weights into a model, whoever holds it: the pieces a policy and the engine both need.

A policy initialises and loads its own weights (random initialisation, pretrained files); the
engine may have sharded the policy first (FSDP builds it on the meta device and materialises each
rank's shard, :mod:`slurmvla.engine.materialize`). Both write through these helpers, so a policy
loads weights without importing the parallelism layer, and a sharded build is bitwise the same as a
whole one:

- :func:`parameter_generator`: one generator per parameter, seeded by the policy's ``init_seed`` and
  the parameter's name, so a parameter's initial values do not depend on build order or sharding.
- :func:`copy_full_into`: write a whole tensor into a parameter, or into this rank's part of it when
  it is a sharded ``DTensor``.

This module sits at the bottom (it imports no other slurmvla layer). It knows the ``DTensor`` type,
never ranks or process groups: a shard's place comes from the tensor's own mesh and placements.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed.tensor import DTensor


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """One generator per parameter: its values do not depend on build order or sharding."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole tensor into ``param``: all of it, or, for a sharded DTensor, this rank's part."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
            part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            local = param.to_local()
            local[tuple(slice(0, s) for s in shape)].copy_(part.to(local.dtype))
        else:
            param.copy_(full.to(param.dtype))
