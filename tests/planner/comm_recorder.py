"""Every collective a piece of code issues, as torch.distributed's dispatcher sees it.

Every c10d collective (``dist.all_reduce`` from Python, DDP's C++ reducer, FSDP2's all-gathers and
reduce-scatters, DeepSpeed's calls through ``deepspeed.comm``) is a ``c10d::`` operator of torch's dispatcher;
a ``TorchDispatchMode`` sees each one with its tensors and its process group (a ``ScriptObject`` that
``ProcessGroup.unbox`` turns back into the group). Nothing of the engine is patched. One record per tensor a
collective moves (a coalesced call of k tensors gives k), in the vocabulary of
:class:`slurmvla.planner.comms.Collective`: kind, the group's size, the dtype and the bytes of the full buffer
(an all-gather's output, a reduce-scatter's input, an all-reduce's, broadcast's or reduce's tensor).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d operator -> (kind, how its full buffers are found in the arguments)
_FULL_IS_OUTPUT = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather"}
_FULL_IS_INPUT = {"_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter"}
_IN_PLACE = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast",
             "reduce_": "reduce"}
_NO_DATA = {"barrier", "monitored_barrier_"}


def _group(args: tuple) -> Any:
    for a in args:
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp, not a group
                continue
    return None


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


class CollectiveRecorder(TorchDispatchMode):
    """``with CollectiveRecorder() as rec: ...``; ``rec.records``: dicts of phase, kind, group, ranks, dtype,
    bytes, op (the c10d operator's name). ``rec.phase`` labels what follows (forward, backward, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = kwargs or {}
        if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            # A tensor subclass (DTensor): its own dispatch runs first, and the collectives it issues for
            # its local tensors come back here (a mode's handler would run it with the mode off).
            return NotImplemented
        if func.namespace == "c10d":
            self._record(func._opname, args)
        elif func.namespace == "_c10d_functional":
            self._record_functional(func._opname, args, kwargs)
        return func(*args, **kwargs)

    def _record_functional(self, op: str, args: tuple, kwargs: dict) -> None:
        """DTensor's redistributions (e.g. a gradient norm's partial sum made whole) go through torch's
        functional collectives: the same records, the group named by its registered name."""
        if op.startswith("wait") or op.startswith("_"):  # wait_tensor, _wrap_tensor_autograd: no data moved
            return
        name = args[-1] if args else kwargs.get("group_name")
        if isinstance(name, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(name)
        else:
            pg = _group((name,))
        if pg is None:
            raise RuntimeError(f"no process group in {op}: {[type(a) for a in args]} {kwargs}")
        base = op.removesuffix("_").removesuffix("_out").removesuffix("_coalesced")
        kind = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast"}.get(base, op)
        size = pg.size()
        for t in _tensors(args[0]):
            n = t.numel() * t.element_size() * (size if kind == "all_gather" else 1)
            self.records.append({"phase": self.phase, "kind": kind, "group": size,
                                 "ranks": dist.get_process_group_ranks(pg), "dtype": str(t.dtype).removeprefix("torch."),
                                 "bytes": n, "op": f"functional.{op}"})

    def _record(self, op: str, args: tuple) -> None:
        if op in _NO_DATA:
            return
        pg = _group(args)
        size = pg.size() if pg is not None else dist.get_world_size()
        try:
            ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(size))
        except (ValueError, RuntimeError, KeyError):
            ranks = None
        if op in _FULL_IS_OUTPUT:
            kind, full = _FULL_IS_OUTPUT[op], _tensors(args[0])
        elif op in _FULL_IS_INPUT:
            kind, full = _FULL_IS_INPUT[op], _tensors(args[1])
        elif op in _IN_PLACE:
            kind, full = _IN_PLACE[op], _tensors(args[0])
        elif op == "allgather_":  # a list of outputs per input: each input's gathered list is one buffer
            kind = "all_gather"
            for outs in args[0]:
                n = sum(t.numel() * t.element_size() for t in _tensors(outs))
                self.records.append({"phase": self.phase, "kind": kind, "group": size, "ranks": ranks,
                                     "dtype": str(_tensors(outs)[0].dtype).removeprefix("torch."), "bytes": n, "op": op})
            return
        else:
            kind, full = op, _tensors(args)
        for t in full:
            self.records.append({"phase": self.phase, "kind": kind, "group": size, "ranks": ranks,
                                 "dtype": str(t.dtype).removeprefix("torch."), "bytes": t.numel() * t.element_size(),
                                 "op": op})
