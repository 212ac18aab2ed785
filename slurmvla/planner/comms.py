"""The collectives one training step issues, per engine: kind, group, dtype and bytes, counted from the policy's
parameter layout (built on the meta device) and each engine's options, as torch's DDP and FSDP2 and DeepSpeed
ZeRO (the versions slurmvla pins) issue them. tests/planner/test_comms.py records what a real step issues under
torchrun (gloo, world 2 and 4) and holds these lists to it, collective for collective; docs/plan.md
("Communication") states each engine's rule and where a library's behaviour makes a figure depend on something.

Vocabulary: a :class:`Collective` is one call moving one buffer; ``bytes`` is the full buffer (an all-gather's
output, a reduce-scatter's input, an all-reduce's tensor), whatever the algorithm then sends. ``span`` names the
group: ``world``, ``shard`` (FSDP's shard group), ``replicate`` (HSDP's replica group). A steady-state step is
counted (DDP's first step all-reduces one bucket and its second broadcasts the rebuilt bucket order: see
:func:`first_steps`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from slurmvla.config import Config
from slurmvla.planner import PlanError

# torch.distributed's DDP: bucket_cap_mb's default (MiB), and the first bucket's cap when bucket_cap_mb is left
# at its default (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES).
DDP_BUCKET_MB = 25
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
MiB = 1024 * 1024

# DeepSpeed's zero_optimization defaults (deepspeed/runtime/zero/config.py), which slurmvla's ds_config leaves alone.
ZERO_DEFAULTS: dict[str, Any] = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": None,  # None: True for stage 3, False for 1 and 2
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "use_multi_rank_bucket_allreduce": True,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_model_persistence_threshold": 2**63 - 1,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
PHASES = ("forward", "backward", "clip", "step")


@dataclass(frozen=True)
class Collective:
    phase: str  # forward, backward, clip (the gradient norm), step (the optimizer step)
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast
    group: int  # ranks in the group
    span: str  # world, shard or replicate: which ranks (the link it crosses)
    dtype: str  # float32, bfloat16, float64, uint8
    bytes: int  # the full buffer
    what: str = ""
    # The compute segment after which it can start ("" at once), and the one that waits for it ("" none
    # before the step ends): the step-time model's dependencies (slurmvla.planner.scaling).
    after: str = ""
    before: str = ""
    # Issued on the compute stream: the next compute waits for it (ZeRO-1/2 without overlap_comm).
    blocking: bool = False
    # Starts when the collective listed before it ends (HSDP's replica all-reduce of a reduce-scatter's output).
    after_previous: bool = False
    # The micro-batch (of trainer.grad_accum_steps) whose segments ``after`` and ``before`` name.
    micro: int = 0

    def key(self) -> tuple[str, str, int, str, int]:
        return (self.phase, self.kind, self.group, self.dtype, self.bytes)


@dataclass
class Layout:
    """The policy's parameters as the engines see them, from one pass on the meta device."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    trainable: list[bool]
    # Parameter indices: each wrap unit's own (policy.wrap_units(), in order), then the root's (the rest).
    units: list[list[int]]
    root: list[int]
    # The optimizer's parameter groups (trainable parameters, in the policy's param_groups order).
    groups: list[list[int]]
    # Trainable parameters in the order their gradients are ready in backward (autograd's order).
    ready: list[int]
    # Every module call of the forward that has parameters of its own, in order: its parameters (ZeRO-3's
    # trace: it gathers per module).
    module_calls: list[list[int]]
    # Forward + backward FLOPs of one sample in each wrap unit (same order), and in all (the root: the rest).
    unit_flops: list[float] = field(default_factory=list)
    total_flops: float = 0.0
    # (weight, bias) of every nn.Linear with a bias.
    linear_pairs: list[tuple[int, int]] = field(default_factory=list)

    def numel(self, i: int) -> int:
        return math.prod(self.shapes[i])

    @property
    def trainable_params(self) -> list[int]:
        return [i for i, t in enumerate(self.trainable) if t]


def layout_of(cfg: Config, autocast: str = "cuda") -> Layout:
    """The layout of the configured policy: built on the meta device, one training forward + backward of one
    sample there (hooks note the order gradients are ready and the modules called; a FLOP counter, each wrap
    unit's FLOPs). Under bf16 the pass runs with ``autocast``'s lists: CUDA's (emulated: the plan's GPU) or the
    CPU's (a run on the CPU, as the tests make): which ops run in fp32 changes the graph, and with it the order
    in which gradients of one op's inputs (a norm's weight and bias) are ready."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from slurmvla.planner.activations import CpuAttention, backward, fake_batch
    from slurmvla.planner.autocast import CudaAutocast
    from slurmvla.planner.model_states import build_on_meta
    from slurmvla.planner.step_time import sdpa_flop_mapping

    policy = build_on_meta(cfg)
    sample = fake_batch(cfg, policy, 1)
    # The CPU's autocast acts on CPU tensors only: fake ones then (shapes, no memory), the meta device otherwise.
    fake = FakeTensorMode(allow_non_fake_inputs=True) if autocast == "cpu" else None
    with fake if fake is not None else _Nothing():
        policy.to_empty(device="cpu" if fake is not None else "meta")
    policy.train()
    low = cfg.precision == "bf16"
    if low:  # the parameters as every engine computes with them under bf16 (no cast in the graph)
        with torch.no_grad(), fake if fake is not None else _Nothing():
            for p in policy.parameters():
                if p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
    named = list(policy.named_parameters())
    index = {id(p): i for i, (_, p) in enumerate(named)}
    owner: dict[int, int] = {}
    units: list[list[int]] = []
    unit_modules = policy.wrap_units()
    for u, unit in enumerate(unit_modules):
        own = [index[id(p)] for p in unit.parameters() if index[id(p)] not in owner]
        for i in own:
            owner[i] = u
        units.append(own)
    root = [i for i in range(len(named)) if i not in owner]
    o = cfg.optim
    groups = [[index[id(p)] for p in g["params"] if p.requires_grad]
              for g in policy.param_groups(o.weight_decay, o.lr, o.backbone_lr_scale)]
    ready: list[int] = []
    calls: list[list[int]] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: ready.append(i))
             for i, (_, p) in enumerate(named) if p.requires_grad]

    def pre(module: nn.Module, _args: Any) -> None:
        own = [index[id(p)] for p in module.parameters(recurse=False)]
        if own:
            calls.append(own)

    hooks += [m.register_forward_pre_hook(pre) for m in policy.modules()]
    if fake is not None:
        batch = {k: (fake.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}
    else:
        batch = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}
    # Each wrap unit's forward FLOPs, read off the counter around its calls (a module tracker's attribution of
    # backward ops to modules is not reliable across the joint layers of pi0); its backward is taken in the
    # same proportion of the backward's total.
    forward_counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping())
    unit_forward = [0.0] * len(unit_modules)
    started: dict[int, float] = {}

    def unit_pre(u: int) -> Any:
        def hook(_m: nn.Module, _a: Any) -> None:
            started[u] = float(forward_counter.get_total_flops())
        return hook

    def unit_post(u: int) -> Any:
        def hook(_m: nn.Module, _a: Any, _o: Any) -> None:
            unit_forward[u] += float(forward_counter.get_total_flops()) - started.pop(u, 0.0)
        return hook

    for u, unit in enumerate(unit_modules):
        hooks += [unit.register_forward_pre_hook(unit_pre(u)), unit.register_forward_hook(unit_post(u))]
    backward_counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping())
    try:
        cast = _Nothing() if not low else CudaAutocast(torch.bfloat16) if autocast == "cuda" else \
            torch.autocast("cpu", torch.bfloat16)
        place = (fake, _Nothing()) if fake is not None else (torch.device("meta"), CpuAttention())
        with place[0], place[1], cast:
            with forward_counter:
                out = policy(batch)
            with backward_counter:
                backward(out["loss"] if isinstance(out, dict) else out)
    finally:
        for h in hooks:
            h.remove()
    forward_total = float(forward_counter.get_total_flops())
    total = forward_total + float(backward_counter.get_total_flops())
    scale = total / forward_total if forward_total else 0.0
    pairs = [(index[id(m.weight)], index[id(m.bias)]) for m in policy.modules()
             if isinstance(m, nn.Linear) and m.bias is not None]
    return Layout([n for n, _ in named], [tuple(p.shape) for _, p in named], [p.requires_grad for _, p in named],
                  units, root, groups, ready, calls, [f * scale for f in unit_forward], total, pairs)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# -- engine options ---------------------------------------------------------------------------------------


@dataclass
class CommOptions:
    """The engine options that change what a step sends. Defaults: what slurmvla's engines build (DDP with torch's
    default buckets, FSDP2 per wrap unit, DeepSpeed's zero_optimization defaults)."""

    # DDP: bucket_cap_mb (None: torch's default, 25 MiB with a 1 MiB first bucket). gradient_as_bucket_view
    # (slurmvla sets it) changes memory, not what is sent.
    ddp_bucket_cap_mb: float | None = None
    # FSDP2: reshard_after_forward (None: the registry entry's: fsdp_full / hsdp True, fsdp_grad_op False).
    # Prefetching (FSDP2's implicit one-ahead) changes when, not what.
    reshard_after_forward: bool | None = None
    # DeepSpeed's zero_optimization, over ZERO_DEFAULTS.
    zero: dict[str, Any] = field(default_factory=dict)

    def zero_option(self, key: str, stage: int) -> Any:
        value = {**ZERO_DEFAULTS, **self.zero}.get(key)
        if key == "overlap_comm" and value is None:
            return stage == 3
        return value


# The engine classes this model counts (a registry entry's target), and how.
RULES = {"slurmvla.engine.ddp:DDPEngine": "ddp", "slurmvla.engine.fsdp:FSDPEngine": "fsdp",
         "slurmvla.engine.zero:DeepSpeedEngine": "zero", "slurmvla.engine.single:SingleEngine": "single"}


def engine_kind(name: str) -> tuple[str, dict[str, Any]]:
    """("ddp" | "fsdp" | "zero" | "single", the registry entry's options) of a registered engine, read from its
    entry's target class; a PlanError naming the engines the model counts otherwise (a plug-in's engine)."""
    from slurmvla.registry import ENGINES

    entry = ENGINES.get(name)
    if entry.target not in RULES:
        counted = [e for e in ENGINES if ENGINES.get(e).target in RULES]
        raise PlanError(f"engine={name}: no communication model for its class {entry.target}; the model counts "
                        f"{counted}")
    return RULES[entry.target], dict(entry.options)


def _dtype(low: bool) -> str:
    return "bfloat16" if low else "float32"


def _size(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float64": 8, "uint8": 1}[dtype]


# -- the engines' rules -------------------------------------------------------------------------------------


def step_collectives(cfg: Config, layout: Layout, world: int, gpus_per_node: int,
                     options: CommOptions | None = None) -> list[Collective]:
    """Every collective one steady-state optimizer step issues on each rank (the same list on every rank),
    for ``cfg``'s engine, precision and ``engine.reduce_dtype`` on ``world`` ranks, ``gpus_per_node`` a node.
    With gradient accumulation (trainer.grad_accum_steps micro-batches a step) DDP, FSDP and ZeRO-1 reduce on
    the last micro-batch only (no_sync; DeepSpeed's boundary), ZeRO-2 and -3 reduce every micro-batch, and FSDP
    and ZeRO-3 gather the parameters for every micro-batch's forward and backward."""
    options = options or CommOptions()
    kind, entry_options = engine_kind(cfg.engine.name)
    low = cfg.precision == "bf16"
    reduce_wide = not low or cfg.engine.reduce_dtype == "fp32"
    accum = cfg.trainer.grad_accum_steps
    if world == 1 or kind == "single":
        return []
    if kind == "ddp":
        return ddp_collectives(layout, world, low, reduce_wide, options.ddp_bucket_cap_mb, accum)
    if kind == "fsdp":
        hybrid = bool(entry_options.get("hybrid"))
        reshard = options.reshard_after_forward
        if reshard is None:
            reshard = bool(entry_options.get("reshard_after_forward", True))
        shard, replicate = world, 1
        if hybrid:
            shard, replicate = hsdp_degrees(cfg, world, gpus_per_node)
        return fsdp_collectives(layout, shard, replicate, low, reduce_wide, reshard, hybrid, accum)
    stage = int(entry_options["stage"])
    return zero_collectives(layout, world, stage, low, reduce_wide, options, accum)


def hsdp_degrees(cfg: Config, world: int, gpus_per_node: int) -> tuple[int, int]:
    """(shard, replicate) as the engine derives them (slurmvla.engine.fsdp.hsdp_degrees), a PlanError when they
    do not multiply to the world."""
    shard = cfg.engine.shard_degree or gpus_per_node
    replicate = cfg.engine.replicate_degree or max(1, world // shard)
    if shard * replicate != world:
        raise PlanError(f"engine.shard_degree={shard} x engine.replicate_degree={replicate} != world size {world}; "
                        f"choose a shard degree that divides {world} (e.g. {gpus_per_node})")
    return shard, replicate


def ddp_buckets(layout: Layout, low: bool, bucket_cap_mb: float | None) -> list[list[int]]:
    """DDP's buckets after its rebuild (from the second iteration on): the trainable parameters in the order their
    gradients were ready in the first backward, cut as torch's ``compute_bucket_assignment_by_size`` cuts them: a
    bucket closes once its bytes (in the parameters' dtype) reach its cap, the first cap being 1 MiB when
    bucket_cap_mb is the default and bucket_cap_mb otherwise."""
    cap = int((DDP_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb) * MiB)
    first = DDP_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    element = 2 if low else 4
    buckets, current, size, limit = [], [], 0, first
    for i in layout.ready:
        current.append(i)
        size += layout.numel(i) * element
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap
    if current:
        buckets.append(current)
    return buckets


def ddp_collectives(layout: Layout, world: int, low: bool, reduce_wide: bool,
                    bucket_cap_mb: float | None = None, accum: int = 1) -> list[Collective]:
    """One all-reduce per bucket in backward, in the gradients' dtype (bf16 buckets widened to fp32 by the
    engine's comm hook when engine.reduce_dtype=fp32). The weights' norm is clipped on each rank's own (replicated)
    fp32 gradients: no collective."""
    dtype = "float32" if reduce_wide else "bfloat16"
    unit_of = _unit_of(layout)
    out = []
    for b, bucket in enumerate(ddp_buckets(layout, low, bucket_cap_mb)):
        n = sum(layout.numel(i) for i in bucket)
        out.append(Collective("backward", "all_reduce", world, "world", dtype, n * _size(dtype), f"bucket {b}",
                              after=f"backward {unit_of[bucket[-1]]}", before="step", micro=accum - 1))
    return out


def _unit_of(layout: Layout) -> dict[int, str]:
    out = {i: "root" for i in layout.root}
    for u, params in enumerate(layout.units):
        out.update({i: f"unit {u}" for i in params})
    return out


def fsdp_padded(layout: Layout, params: list[int], shard: int) -> int:
    """Elements of the unsharded buffer FSDP2 gathers or reduces for these parameters: each cut along its first
    dimension into ``shard`` equal parts, the last padded (ceil(rows / shard) rows per rank)."""
    total = 0
    for i in params:
        shape = layout.shapes[i] or (1,)
        total += -(-shape[0] // shard) * math.prod(shape[1:]) * shard
    return total


def fsdp_collectives(layout: Layout, shard: int, replicate: int, low: bool, reduce_wide: bool, reshard: bool,
                     hybrid: bool, accum: int = 1) -> list[Collective]:
    """FSDP2 (fully_shard on each wrap unit, then on the root). Forward: each unit's parameters all-gathered
    (the root first), every parameter of the unit in one buffer, in the compute dtype (bf16 under
    MixedPrecisionPolicy, frozen parameters too). Backward: with reshard_after_forward (fsdp_full, hsdp; the root
    too) each unit gathered again; each unit with trainable parameters reduce-scatters its gradients in
    engine.reduce_dtype (bf16 or fp32), and under hsdp all-reduces its shard of them across the replica group
    (issued even with a replica group of one). The clip: the gradients' per-tensor norms, partial over the shard
    group, summed in one all-reduce of fp32 scalars (one per trainable tensor)."""
    dtype = _dtype(low)
    rdtype = "float32" if reduce_wide else "bfloat16"
    named = [("root", layout.root), *((f"unit {u}", p) for u, p in enumerate(layout.units))]
    named = [(name, params) for name, params in named if params]
    out = []
    last = accum - 1
    for m in range(accum):  # every micro-batch gathers; only the last reduces
        for name, params in named:
            out.append(Collective("forward", "all_gather", shard, "shard", dtype,
                                  fsdp_padded(layout, params, shard) * _size(dtype), f"{name}'s parameters",
                                  before=f"forward {name}", micro=m))
        for name, params in reversed(named):
            if reshard:
                out.append(Collective("backward", "all_gather", shard, "shard", dtype,
                                      fsdp_padded(layout, params, shard) * _size(dtype), f"{name}'s parameters again",
                                      before=f"backward {name}", micro=m))
            grads = [i for i in params if layout.trainable[i]]
            if grads and m == last:
                n = fsdp_padded(layout, grads, shard)
                out.append(Collective("backward", "reduce_scatter", shard, "shard", rdtype, n * _size(rdtype),
                                      f"{name}'s gradients", after=f"backward {name}", before="step", micro=m))
                if hybrid:
                    out.append(Collective("backward", "all_reduce", replicate, "replicate", rdtype,
                                          n // shard * _size(rdtype), f"{name}'s gradient shard across replicas",
                                          before="step", after_previous=True, micro=m))
    tensors = sum(layout.trainable)
    if tensors:
        out.append(Collective("clip", "all_reduce", shard, "shard", "float32", 4 * tensors,
                              "per-tensor gradient norms", after="backward", before="step", micro=last))
    return out


def zero_collectives(layout: Layout, world: int, stage: int, low: bool, reduce_wide: bool, options: CommOptions,
                     accum: int = 1) -> list[Collective]:
    """DeepSpeed ZeRO (see the stage functions)."""
    if stage == 3:
        return zero3_collectives(layout, world, low, reduce_wide, options, accum)
    return zero12_collectives(layout, world, stage, low, reduce_wide, options, accum)


def _ipg_buckets(layout: Layout, order: list[int], cap: int, flush_empty: bool) -> list[list[int]]:
    """DeepSpeed's gradient buckets (ipg): a gradient that would take the bucket past ``cap`` elements first
    sends the bucket; one larger than the cap goes alone."""
    buckets, current, size = [], [], 0
    for i in order:
        n = layout.numel(i)
        if size + n > cap and (current or flush_empty):
            if current:
                buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def zero12_collectives(layout: Layout, world: int, stage: int, low: bool, reduce_wide: bool,
                       options: CommOptions, accum: int = 1) -> list[Collective]:
    """ZeRO-1 / 2 (deepspeed/runtime/zero/stage_1_and_2.py). Backward: the gradients gathered in buckets of
    reduce_bucket_size elements (communication_data_type: fp32 unless engine.reduce_dtype=bf16), each bucket
    all-reduced whole (use_multi_rank_bucket_allreduce, the default; each rank keeps its partition): stage 2 (or
    overlap_comm) fills them from backward hooks in the order gradients are ready, stage 1 at the end of backward
    group by group. Step: under bf16 one byte all-reduced (the overflow check); one fp32 norm per parameter group;
    then every group's updated parameters all-gathered whole (all_gather_into_tensor: allgather_bucket_size is
    not used when the backend has it; the flat group padded to a multiple of 2 x world)."""
    rdtype = "float32" if reduce_wide else "bfloat16"
    hooks = stage == 2 or options.zero_option("overlap_comm", stage)
    order = list(layout.ready) if hooks else [i for g in layout.groups for i in g]
    cap = int(options.zero_option("reduce_bucket_size", stage))
    unit_of = _unit_of(layout)
    blocking = not options.zero_option("overlap_comm", stage)
    out = []
    buckets = _ipg_buckets(layout, order, cap, flush_empty=False)
    for m in range(accum) if stage == 2 else [accum - 1]:
        for b, bucket in enumerate(buckets):
            n = sum(layout.numel(i) for i in bucket)
            after = f"backward {unit_of[bucket[-1]]}" if hooks else "backward"
            out.append(Collective("backward", "all_reduce", world, "world", rdtype, n * _size(rdtype),
                                  f"gradient bucket {b}", after=after, before="step", blocking=blocking, micro=m))
    last = accum - 1
    if low:
        out.append(Collective("step", "all_reduce", world, "world", "uint8", 1, "overflow check", after="backward",
                              before="step", micro=last))
    groups = [g for g in layout.groups if g]
    out += [Collective("step", "all_reduce", world, "world", "float32", 4, f"group {k}'s gradient norm",
                       after="backward", before="step", micro=last) for k in range(len(groups))]
    align = 2 * world
    dtype = _dtype(low)
    for k, g in enumerate(groups):
        n = sum(layout.numel(i) for i in g)
        out.append(Collective("step", "all_gather", world, "world", dtype, -(-n // align) * align * _size(dtype),
                              f"group {k}'s updated parameters", after="step", micro=last))
    return out


def zero3_persistent(layout: Layout, options: CommOptions) -> set[int]:
    """Parameters ZeRO-3 keeps whole on every rank (fewer elements than stage3_param_persistence_threshold, up
    to stage3_model_persistence_threshold elements in all; DeepSpeed's parameter_offload)."""
    threshold = int(options.zero_option("stage3_param_persistence_threshold", 3))
    budget = int(options.zero_option("stage3_model_persistence_threshold", 3))
    kept, total = set(), 0
    for i in range(len(layout.shapes)):
        n = layout.numel(i)
        if total + n > budget:
            continue
        if n < threshold:
            kept.add(i)
            total += n
    return kept


def zero3_gathers(layout: Layout, world: int, options: CommOptions, persistent: set[int]
                  ) -> list[tuple[str, list[int], str]]:
    """ZeRO-3's parameter all-gathers in one forward + backward, as its PartitionedParameterCoordinator issues
    them once its trace is complete (from the second step): at each module call, the module's own parameters not
    available yet (one coalesced all-gather), then a prefetch of the next parameters of the trace, up to
    stage3_prefetch_bucket_size elements and while fewer than stage3_max_live_parameters are available (another);
    after the call a parameter is released unless it is used again within stage3_max_reuse_distance elements of
    the trace. The backward's trace is taken as the forward's module calls reversed (autograd's order, in which
    DeepSpeed's pre-backward hooks fire). Returns (phase, parameters, segment) per all-gather: the phase it is
    issued in, and the compute segment (``forward unit 3``) that first needs it."""
    calls = [("forward", c) for c in layout.module_calls] + [("backward", c) for c in reversed(layout.module_calls)]
    trace = [(step, i) for step, (_, c) in enumerate(calls) for i in sorted(set(c))]
    prefetch = int(options.zero_option("stage3_prefetch_bucket_size", 3))
    max_live = int(options.zero_option("stage3_max_live_parameters", 3))
    reuse = int(options.zero_option("stage3_max_reuse_distance", 3))
    available = set(persistent)
    n_available = 0
    fetched_for: dict[int, int] = {}
    queue = list(trace)
    head = 0
    gathers = []
    segment_of = _module_segments(layout)
    for step, (phase, call) in enumerate(calls):
        own = sorted(set(call))
        segment = f"{phase} {segment_of.get(tuple(own), 'root')}"
        fetch = [i for i in own if i not in available]
        if fetch:
            gathers.append((phase, fetch, segment))
            available.update(fetch)
            n_available += sum(layout.numel(i) for i in fetch)
        # The queue's next entries are this call's own parameters (those not already fetched for a later use).
        pending = {i for i in own if fetched_for.get(i, -1) < step}
        discarded: set[int] = set()
        while head < len(queue) and len(discarded) < len(pending):
            s, i = queue[head]
            head += 1
            fetched_for[i] = s
            discarded.add(i)
        if prefetch > 0:
            limit = min(max_live - n_available, prefetch)
            chosen: list[int] = []
            numel, needed = 0, None
            while head < len(queue) and numel < limit:
                s, i = queue[head]
                head += 1
                fetched_for[i] = max(fetched_for.get(i, -1), s)
                if i not in available and i not in chosen:
                    chosen.append(i)
                    numel += layout.numel(i)
                    needed = s if needed is None else needed
            if chosen:  # needed first by the call at trace step ``needed``
                later_phase, later_call = calls[needed]
                gathers.append((phase, chosen, f"{later_phase} {segment_of.get(tuple(sorted(set(later_call))), 'root')}"))
                available.update(chosen)
                n_available += numel
        # Release after the call (__params_to_release).
        release = {i for i in own if i not in persistent and fetched_for.get(i, -1) <= step}
        traversed = 0
        for _, later in calls[step + 1:]:
            if traversed >= reuse:
                break
            for i in later:
                release.discard(i)
                traversed += layout.numel(i)
        for i in release:
            if i in available:
                available.discard(i)
                n_available -= layout.numel(i)
    return gathers


def _module_segments(layout: Layout) -> dict[tuple[int, ...], str]:
    unit_of = _unit_of(layout)
    return {tuple(sorted(set(c))): unit_of[c[0]] for c in layout.module_calls}


def zero3_collectives(layout: Layout, world: int, low: bool, reduce_wide: bool, options: CommOptions,
                      accum: int = 1) -> list[Collective]:
    """ZeRO-3 (deepspeed/runtime/zero/stage3.py, partitioned_param_coordinator.py). Parameters of fewer than
    stage3_param_persistence_threshold elements stay whole on every rank (persistent); the others are gathered by
    module in forward and backward (:func:`zero3_gathers`), each coalesced all-gather a flat buffer of every
    parameter's partition (ceil(numel / world) elements) times the world, in the compute dtype. Backward: the
    gradients bucketed (reduce_bucket_size elements, in the order they are ready) and each bucket reduce-scattered
    in one call (each gradient padded to a multiple of the world) in communication_data_type. Step: one fp64
    norm per parameter sub-group (sub_group_size elements of partitions), then every persistent parameter
    all-gathered on its own (its partitions were updated)."""
    dtype = _dtype(low)
    rdtype = "float32" if reduce_wide else "bfloat16"
    persistent = zero3_persistent(layout, options)
    out = []

    def padded(params: list[int]) -> int:
        return sum(-(-layout.numel(i) // world) for i in params) * world

    gathers = zero3_gathers(layout, world, options, persistent)
    cap = int(options.zero_option("reduce_bucket_size", 3))
    unit_of = _unit_of(layout)
    buckets = _ipg_buckets(layout, zero3_ready(layout), cap, flush_empty=False)
    for m in range(accum):
        for phase, params, segment in gathers:
            out.append(Collective(phase, "all_gather", world, "world", dtype, padded(params) * _size(dtype),
                                  f"{len(params)} parameter(s) for {segment}", before=segment, micro=m))
        for b, bucket in enumerate(buckets):
            out.append(Collective("backward", "reduce_scatter", world, "world", rdtype,
                                  padded(bucket) * _size(rdtype), f"gradient bucket {b}",
                                  after=f"backward {unit_of[bucket[-1]]}", before="step", micro=m))
    last = accum - 1
    sub_size = int(options.zero_option("sub_group_size", 3))
    for k, g in enumerate(g for g in layout.groups if g):
        for s in range(_sub_groups(layout, g, world, sub_size)):
            out.append(Collective("step", "all_reduce", world, "world", "float64", 8,
                                  f"group {k}.{s}'s gradient norm", after="backward", before="step", micro=last))
    for i in sorted(persistent):
        out.append(Collective("step", "all_gather", world, "world", dtype, padded([i]) * _size(dtype),
                              f"persistent {layout.names[i]}", after="step", micro=last))
    return out


def zero3_ready(layout: Layout) -> list[int]:
    """The order gradients are ready under ZeRO-3: autograd's, but with every nn.Linear's weight before its bias
    (DeepSpeed replaces F.linear by its own autograd function, LinearFunctionForZeroStage3, whose backward returns
    them in that order; torch's addmm backward readies the bias first)."""
    order = list(layout.ready)
    at = {i: k for k, i in enumerate(order)}
    for weight, bias in layout.linear_pairs:
        if weight in at and bias in at and at[bias] < at[weight]:
            order[at[bias]], order[at[weight]] = weight, bias
            at[weight], at[bias] = at[bias], at[weight]
    return order


def _sub_groups(layout: Layout, group: list[int], world: int, size: int) -> int:
    """DeepSpeed's _create_fp16_sub_groups: a group's parameters cut once their partitions reach sub_group_size."""
    parts = [-(-layout.numel(i) // world) for i in group]
    if size >= sum(parts):
        return 1
    count, running = 0, 0
    for k, n in enumerate(parts):
        running += n
        if running >= size or k == len(parts) - 1:
            count, running = count + 1, 0
    return count


def first_steps(cfg: Config, layout: Layout, world: int) -> str:
    """What the first steps send beyond a steady step's list (not counted there)."""
    kind, _ = engine_kind(cfg.engine.name)
    if kind == "ddp":
        return ("step 1: one all-reduce of every gradient (one bucket: before its first backward DDP does not know "
                "the order gradients are ready); step 2's forward: the rebuilt bucket order broadcast from rank 0 "
                "(two int64 broadcasts)")
    if kind == "zero":
        return "step 1: ZeRO-3 records its module trace and gathers module by module without prefetching"
    return "step 1: the same collectives"


def summary(collectives: list[Collective]) -> list[dict[str, Any]]:
    """Identical collectives counted: (phase, kind, group, dtype, bytes) -> count, in first-issued order."""
    counts = Counter(c.key() for c in collectives)
    seen, out = set(), []
    for c in collectives:
        if c.key() not in seen:
            seen.add(c.key())
            out.append({"phase": c.phase, "kind": c.kind, "group": c.group, "span": c.span, "dtype": c.dtype,
                        "bytes": c.bytes, "count": counts[c.key()]})
    return out


def volume(collectives: list[Collective]) -> dict[str, int]:
    """Bytes per kind and span (the full buffers, summed)."""
    out: dict[str, int] = {}
    for c in collectives:
        key = f"{c.kind} ({c.span})"
        out[key] = out.get(key, 0) + c.bytes
    return out
