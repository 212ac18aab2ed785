"""A loaded policy's weights made ready for inference, without changing what it computes: in one dtype
(:func:`lower_weights`), and the projections that read one input as one matrix product each
(:func:`fuse_projections`, over the groups a policy declares with ``projection_groups()``). Call them with
the policy on its device, before compiling or capturing."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)


def lower_weights(policy: nn.Module, dtype: torch.dtype) -> None:
    """The policy's floating-point parameters in ``dtype`` (its buffers, e.g. normalization statistics, stay)."""
    for p in policy.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def fuse_linears(owner: nn.Module, name: str, linears: list[nn.Module]) -> bool:
    """Store ``linears``' weights as one tensor, ``owner.<name>`` (rows in their order), each module's
    weight becoming a view of its rows: one matrix product where there were several on the same input, with
    no copy kept (the parameters, their names and ``state_dict`` are unchanged; an update to either is seen
    by both). Only plain bias-free ``nn.Linear`` layers on one device and dtype (not LoRA's wrappers, whose
    adapters would be left out; not a quantized weight, a tensor subclass: ``serve.fp8_prefix``'s): False, and
    nothing changed, otherwise. For inference on a policy already on its device and dtype: moving or casting
    its parameters afterwards leaves the fused tensor behind (then the product fails on its device or dtype,
    it is never silently stale)."""
    if any(type(m) is not nn.Linear or m.bias is not None or type(m.weight) is not nn.Parameter for m in linears):
        return False
    weights = [m.weight for m in linears]
    if len({(w.device, w.dtype, w.shape[1]) for w in weights}) != 1:
        return False
    fused = torch.cat([w.detach() for w in weights])
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight.data = fused[start:start + rows]
        start += rows
    object.__setattr__(owner, name, fused)  # a plain attribute: never a parameter, buffer or saved tensor
    return True


def fuse_projections(policy: nn.Module) -> int:
    """Each group of projections the policy declares (``projection_groups()``: ``(owner, name, linears)``,
    e.g. pi0 / pi0.5's q / k / v and gate / up of every Gemma layer) fused by :func:`fuse_linears`; the model
    reads ``owner.<name>`` when it is there. Returns how many groups were fused (none for a policy that
    declares none; a LoRA-wrapped group stays as it is)."""
    groups = policy.projection_groups
    if groups is None:
        return 0
    fused = sum(fuse_linears(owner, name, linears) for owner, name, linears in groups())
    log.info("fused %d groups of projections for inference", fused)
    return fused
