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
- :func:`parameters_on_meta`: build a policy without memory for its parameters (``build_policy(...,
  on_meta=True)``), for whoever initialises or loads them afterwards.

This module sits at the bottom (it imports no other slurmvla layer). It knows the ``DTensor`` type,
never ranks or process groups: a shard's place comes from the tensor's own mesh and placements.
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from collections.abc import Iterator

import torch
from torch import nn


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """One generator per parameter: its values do not depend on build order or sharding."""
    return torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def supports_deferred_init(cls: type) -> bool:
    """Whether a policy class can initialise each parameter on its own (``init_parameter(name, tensor,
    generator)``): then it can be built on the meta device and initialised where it will live. ``cls``: a
    policy class as :func:`slurmvla.policy.policy_class` gives it (the contract declared: ``init_parameter`` is
    None where not offered)."""
    return cls.init_parameter is not None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every ``nn.Parameter`` a module registers lives on the meta device (buffers do not)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a sharded ``DTensor``, without importing ``torch.distributed.tensor`` (a second of start-up)
    where nothing has: no DTensor exists before that module is loaded (the sharding engines load it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a whole tensor into ``param``: all of it, or, for a sharded DTensor, this rank's part."""
    with torch.no_grad():
        if is_dtensor(param):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(full.shape, param.device_mesh, param.placements)
            part = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            local = param.to_local()
            local[tuple(slice(0, s) for s in shape)].copy_(part.to(local.dtype))
        else:
            param.copy_(full.to(param.dtype))


# -- names of a policy with low-rank adapters (slurmvla.policy.lora, through peft) ---------------------
# peft replaces an adapted nn.Linear by a wrapper that keeps the original as ``base_layer`` and adds
# the adapters' factors beside it: ``q_proj.weight`` becomes ``q_proj.base_layer.weight`` next to
# ``q_proj.lora_A.default.weight`` and ``q_proj.lora_B.default.weight``.
BASE_LAYER = ".base_layer"
ADAPTER_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def is_adapter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def plain_name(name: str) -> str:
    """The name a base weight has in the policy without adapters (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``): pretrained files, initialisation and exports speak these names."""
    return name.replace(BASE_LAYER + ".", ".")


def has_adapters(module: torch.nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in module.named_parameters())


def base_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The module's parameters by their plain names, adapters left out (the whole set without adapters)."""
    return {plain_name(n): p for n, p in module.named_parameters() if not is_adapter(n)}


def checkpoint_keys(module: torch.nn.Module) -> set[str] | None:
    """What a checkpoint of ``module`` holds: None (everything) for a policy without adapters; with
    adapters, the trained parameters and the buffers, never the frozen base, which every run rebuilds
    bitwise from its config (the seed or the pretrained file)."""
    if not has_adapters(module):
        return None
    return {n for n, p in module.named_parameters() if p.requires_grad} | {n for n, _ in module.named_buffers()}
