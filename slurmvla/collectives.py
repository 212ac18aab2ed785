"""Rank-uniform decisions: the small helpers any layer may use (imports no other slurmvla layer).

A branch that decides whether a collective runs (an FSDP all-gather of a module used only for
some inputs, say) must go the same way on every rank, or the job hangs. ``agree`` settles several
such flags in one small all-reduce and, in the same call, checks that every rank's batch has the
same fields: a field present on some ranks and absent on others is a ``RuntimeError`` naming it,
never a hang. ``check_same_fields`` is that field check alone (a ``ValueError``): models decide
their inputs at build time and never call a collective, so the trainer runs it once, on its first
batch, before the first forward.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist


def _fields_hash(fields: Iterable[str]) -> int:
    digest = hashlib.blake2b("\0".join(sorted(fields)).encode(), digest_size=6).digest()
    return int.from_bytes(digest, "little")  # < 2**48: exact in float64


# Weak references only: holding a process group here would keep it (and gloo's worker threads)
# alive past destroy_process_group until interpreter shutdown, where tearing it down can abort the
# process ("terminate called without an active exception", SIGABRT) after training finished.
_control: tuple[weakref.ref, weakref.ref | None] | None = None


def _control_group() -> dist.ProcessGroup | None:
    """A CPU (gloo) group for these host-side decisions: under NCCL an all-reduce of a GPU tensor
    followed by ``.tolist()`` would stall the GPU stream every step. Created once per process group
    (all ranks reach the first call together); None means the default group is gloo already. The
    group itself is owned by torch.distributed's registry and destroyed with the default group."""
    global _control
    world = dist.group.WORLD
    if _control is None or _control[0]() is not world:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        _control = (weakref.ref(world), None if group is None else weakref.ref(group))
    return None if _control[1] is None else _control[1]()


def agree(flags: Mapping[str, bool], fields: Iterable[str] | None = None) -> dict[str, bool]:
    """Return each flag OR-ed over all ranks (true if any rank says true), in one CPU all-reduce.

    Every rank must call this with the same flag names. With ``fields`` (e.g. a batch's keys),
    raise ``RuntimeError`` on every rank when the field sets differ between ranks. The flags must
    be host-side values (no ``.item()`` of a GPU tensor), so deciding costs no GPU sync.
    """
    names = sorted(flags)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {n: bool(flags[n]) for n in names}
    field_list = sorted(fields) if fields is not None else []
    h = float(_fields_hash(field_list))
    # MAX over [flags..., hash, -hash] gives the OR of the flags and both the max and min hash.
    group = _control_group()
    values = torch.tensor([float(bool(flags[n])) for n in names] + [h, -h], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    out = values.tolist()
    if fields is not None and out[-2] != -out[-1]:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, field_list, group=group)
        detail = _fields_only_on(everyone)
        raise RuntimeError(f"batch fields differ between ranks (a rank-dependent branch would hang the job): {detail}")
    return {n: bool(v) for n, v in zip(names, out[: len(names)])}


def _fields_only_on(everyone: list[list[str]]) -> str:
    """``'text' only on ranks [0]; ...`` for each field that some ranks' lists lack ('' when none does)."""
    union = set().union(*map(set, everyone))
    partial = {f: [r for r, fs in enumerate(everyone) if f in fs] for f in sorted(union) if any(f not in fs for fs in everyone)}
    return "; ".join(f"{f!r} only on ranks {ranks}" for f, ranks in partial.items())


def check_same_fields(fields: Iterable[str], what: str = "batch") -> None:
    """Raise the same ``ValueError`` on every rank when the ranks' ``fields`` (a batch's keys) differ,
    naming each field and the ranks that have it; one object all-gather on the CPU control group, so
    every rank must call it. A model reads the fields it was built for without asking other ranks: a
    rank whose batch lacks one would stop alone and leave the others waiting in a collective, so the
    caller checks once, before the first forward (the trainer on its first batch)."""
    everyone = gather_objects(sorted(fields))
    detail = _fields_only_on(everyone)
    if detail:
        raise ValueError(f"{what} fields differ between ranks: {detail}; every rank's data must yield the same "
                         "fields (the policy's sample spec and the data config decide them, alike on every rank)")


def gather_objects(value: object) -> list:
    """``value`` from every rank, in rank order, on every rank (one object all-gather on the CPU
    control group); ``[value]`` without a process group. Every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=_control_group())
    return everyone


def gather_dict(values: Mapping[str, torch.Tensor], count: int) -> dict[str, torch.Tensor] | None:
    """Gather per-sample values from every rank to rank 0 in **one** gather of the whole dict.

    ``values`` maps names to 1-D tensors with the same length on one rank (padded entries allowed
    past ``count``, the number of real samples). Everything travels as one float64 block
    ``[num_keys + 1, length]`` whose first row carries ``count``, so the padding of a ragged last
    batch is removed with the same count from every entry. Every rank must pass the same keys and
    the same length (the validation loader pads ranks to equal batches). Integers below 2**53 are
    exact. Returns the concatenation in rank order on rank 0, None elsewhere; runs on the CPU
    control group (one collective per call on every rank).
    """
    names = sorted(values)
    length = len(values[names[0]]) if names else 0
    block = torch.zeros(len(names) + 1, length, dtype=torch.float64)
    if length:
        block[0, 0] = count
    for i, n in enumerate(names):
        block[i + 1] = values[n].detach().to("cpu", torch.float64).reshape(-1)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        blocks = [block]
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        blocks = [torch.empty_like(block) for _ in range(world)] if rank == 0 else None
        dist.gather(block, blocks, dst=0, group=_control_group())
        if rank != 0:
            return None
    kept = [b[:, : int(b[0, 0])] if b.shape[1] else b[:, :0] for b in blocks]
    return {n: torch.cat([b[i + 1] for b in kept]) for i, n in enumerate(names)}
