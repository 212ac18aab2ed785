"""What a compiled training step holds (``trainer.compile=true``).

Training compiles each of the policy's repeated layers (``wrap_units()``, :func:`slurmvla.policy.compiled_layers.
compile_units`). Inductor's backend traces a layer's forward and backward together (AOTAutograd, with inductor's
decompositions) and splits the joint graph with the min-cut rematerialization partitioner: the forward keeps the
fewest bytes it can for the backward, which recomputes cheap elementwise chains (norms, activations, rotary
embeddings, casts) from them instead of keeping each intermediate as eager autograd does. Inside each graph its
generated kernels fuse chains of elementwise ops (and reductions over them), so only their ends are written to
memory.

Here each layer runs the same way on the fake tensors: traced by AOTAutograd with inductor's decompositions and
split by the same partitioner, once per kind of layer and input shapes (layers of one kind share the trace, as
they share compiled code in training); the two graphs then run op by op, counting only the tensors inductor
writes to memory: every output of an op it cannot fuse (matrix products, attention, copies into new layouts),
a reduction's, and an elementwise op's read by one of those or returned by the graph (the forward's returns are
what the backward keeps). Not reproduced: inductor's rewrites of the graph before partitioning and its own
choices of what to write out beyond that rule (its fusion heuristics can split a chain).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# Attributes of a layer that say where it sits, not what it computes (transformers' layer_idx: which cache slot
# it reads, none in training): layers differing only in them share a trace.
POSITIONAL = frozenset({"layer_idx"})


def _shape(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad)
    return repr(x)


def _kind(unit: nn.Module) -> tuple:
    """What makes two layers trace to the same graphs: their classes, parameter and buffer names, shapes,
    dtypes and trainability, and plain attributes (flags, sizes) other than a position."""
    out = []
    for name, m in unit.named_modules():
        plain = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k not in POSITIONAL
                             and isinstance(v, bool | int | float | str | type(None))))
        out.append((name, type(m).__qualname__, plain))
    out += [(n, _shape(t)) for n, t in (*unit.named_parameters(), *unit.named_buffers())]
    return tuple(out)


def _partitioner() -> tuple[Callable, dict]:
    """Inductor's own: its joint-graph passes, then the min-cut partitioner; and its decompositions."""
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return partition_fn, select_decomp_table()


class CompiledUnits:
    """The traces of one policy's layers, kept across the fake step's passes (micro-batches, recomputation
    settings, engines): keyed by the layer's kind and its inputs' shapes."""

    def __init__(self, policy: nn.Module):
        self.policy = policy
        self._traces: dict[tuple, Callable] = {}
        self.tracker: Any = None

    @contextmanager
    def active(self, tracker: Any) -> Iterator[None]:
        """Every wrap unit runs its compiled graphs while inside, counted by ``tracker`` (a
        :class:`slurmvla.planner.activations.LiveBytes`; the tracing itself is not counted)."""
        units = list(self.policy.wrap_units())
        self.tracker = tracker
        for unit in units:
            unit.forward = self._forward(unit, unit.forward)
        try:
            yield
        finally:
            self.tracker = None
            for unit in units:
                del unit.forward  # the class's own again

    def _forward(self, unit: nn.Module, eager: Callable) -> Callable:
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_flatten

        names = [n for n, _ in (*unit.named_parameters(), *unit.named_buffers())]
        kind = _kind(unit)

        def forward(*args: Any, **kwargs: Any) -> Any:
            state = [t for _, t in (*unit.named_parameters(), *unit.named_buffers())]
            leaves, spec = tree_flatten((args, kwargs))
            at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            key = (kind, str(spec), tuple(_shape(x) for x in leaves))
            inputs = (*state, *(leaves[i] for i in at))
            if key not in self._traces:
                self._traces[key] = self._trace(unit, eager, names, leaves, spec, at)
                # Traced, partitioned and both graphs made here, outside the dispatch modes (uncounted by the
                # tracker, untouched by a selective checkpoint's: training compiles a layer before any runs);
                # what this call saves goes to hooks of its own, not to a surrounding checkpoint's (whose
                # recomputation would then save fewer tensors than its forward did).
                with _disable_current_modes(), torch._functorch.config.patch(force_non_lazy_backward_lowering=True), \
                        torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    self._traces[key](*inputs)
            return self._traces[key](*inputs)

        return forward

    def _trace(self, unit: nn.Module, eager: Callable, names: list[str], leaves: list, spec: Any,
               at: list[int]) -> Callable:
        from torch._functorch.aot_autograd import aot_function
        from torch.nn.utils.stateless import _reparametrize_module
        from torch.utils._pytree import tree_unflatten

        partition, decompositions = _partitioner()
        n_state = len(names)

        def layer(*flat: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, x in zip(at, flat[n_state:], strict=True):
                filled[i] = x
            args, kwargs = tree_unflatten(filled, spec)
            with _reparametrize_module(unit, dict(zip(names, flat[:n_state], strict=True))):
                return eager(*args, **kwargs)

        def forward_graph(gm: torch.fx.GraphModule, _inputs: Any) -> Callable:
            return self._runner(gm)

        def backward_graph(gm: torch.fx.GraphModule, _inputs: Any) -> Callable:
            return self._runner(gm)

        def split(joint: torch.fx.GraphModule, inputs: Any, **options: Any) -> Any:
            # The layer's parameters and buffers live the whole step, as training's compile tells inductor.
            return partition(joint, inputs, **{**options, "static_lifetime_input_indices": list(range(n_state))})

        return aot_function(layer, forward_graph, backward_graph, partition_fn=split,
                            decompositions=decompositions, num_params_buffers=n_state)


    def _runner(self, gm: torch.fx.GraphModule) -> Callable:
        """The graph run op by op, the ops whose outputs inductor would not write to memory uncounted."""
        from torch._functorch._aot_autograd.utils import make_boxed_func

        written = written_nodes(gm.graph)
        units = self

        class Run(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                if n.op != "call_function" or n in written or units.tracker is None:
                    return super().run_node(n)
                with units.tracker.paused():
                    return super().run_node(n)

        return make_boxed_func(lambda *args: Run(gm).run(*args))


# Ops inductor lowers to elementwise code it can fuse into its readers besides those tagged pointwise: casts and
# copies, and the constants it generates in place.
_FUSED = frozenset({"_to_copy", "clone", "full", "scalar_tensor", "iota", "zeros_like", "ones_like", "full_like",
                    "where"})


def _op(n: torch.fx.Node) -> Any:
    return n.target if n.op == "call_function" else None


def _pointwise(n: torch.fx.Node) -> bool:
    op = _op(n)
    tags = getattr(op, "tags", ())
    name = getattr(getattr(op, "_schema", None), "name", "").split("::")[-1]
    return torch.Tag.pointwise in tags or name in _FUSED


def _reduction(n: torch.fx.Node) -> bool:
    return torch.Tag.reduction in getattr(_op(n), "tags", ())


def _view(n: torch.fx.Node) -> bool:
    op = _op(n)
    if op is None or not hasattr(op, "_schema"):
        return op is not None  # getitem and the like: no storage of their own
    return any(a.alias_info is not None and not a.alias_info.is_write for a in op._schema.returns)


def written_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose outputs inductor's generated code writes to memory: every op but an elementwise one
    (and views, which write nothing), and an elementwise op read (through views) by anything but an elementwise
    op or a reduction, e.g. a matrix product or the graph's output."""
    def readers(n: torch.fx.Node) -> Iterator[torch.fx.Node]:
        for u in n.users:
            if u.op == "call_function" and _view(u):
                yield from readers(u)
            else:
                yield u

    out = set()
    for n in graph.nodes:
        if n.op != "call_function" or _view(n):
            continue
        if not _pointwise(n) or any(u.op != "call_function" or not (_pointwise(u) or _reduction(u))
                                    for u in readers(n)):
            out.add(n)
    return out


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


