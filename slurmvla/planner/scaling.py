"""Step time and scaling: the planner's compute time, the collectives a step issues (slurmvla.planner.comms) timed
on the cluster's links (slurmvla.planner.network), and the overlap each engine schedules, per engine and node
count. Every time here is an ESTIMATE; docs/plan.md ("Step time and scaling") states the model.

One rank's step is simulated as a compute stream and one communication channel per link (NVLink, network),
each taking collectives in the order they become ready:

* compute: the step's issued FLOPs at the assumed utilization of the GPU's dense peak, split into segments per
  wrap unit (and the root: what no unit holds) in the proportions a FLOP-counted pass on the meta device gives;
  a segment's forward is a third of its model FLOPs, its backward the rest plus its share of recomputation; then
  the optimizer step, memory-bound (32 bytes of memory traffic per trainable element this rank steps, at the
  GPU's memory bandwidth);
* when a collective may start: a gather for a segment one segment ahead (FSDP2's implicit prefetch; ZeRO-3's
  prefetch likewise), a gradient reduction once its segment's backward is done (DDP's buckets, FSDP's
  reduce-scatters, ZeRO-2/3's buckets), HSDP's replica all-reduce once its reduce-scatter is done, ZeRO-1/2's
  parameter all-gathers once the optimizer step is done;
* what waits for it: the segment a gather is for; the optimizer step for every reduction; the next compute for
  a ZeRO-1/2 reduction (without overlap_comm DeepSpeed reduces on the compute stream); the step's end for the
  gathers after it.

Overlapped communication is free here: the slowdown of kernels that share the GPU with NCCL is not modelled, nor
data loading. Scaling is weak: the micro-batch per GPU is held, the global batch grows with the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slurmvla.config import Config
from slurmvla.planner import PlanError
from slurmvla.planner.comms import (
    Collective,
    CommOptions,
    Layout,
    engine_kind,
    hsdp_degrees,
    step_collectives,
)
from slurmvla.planner.gpus import GPU
from slurmvla.planner.network import Network, collective_seconds, placement

# Bytes of memory traffic per trainable element in an AdamW step on fp32 masters: the master read and written
# (8), the gradient read (4), both moments read and written (16), the bf16 parameter written (2) and its
# gradient zeroed (2).
OPTIMIZER_BYTES = 32


@dataclass
class Segment:
    name: str  # "forward unit 3", "backward root", "step"
    micro: int
    seconds: float


def compute_segments(layout: Layout, model_flops: float, issued_flops: float, micro_batch: int, accum: int,
                     flops_per_s: float) -> list[Segment]:
    """The compute stream of one optimizer step: each micro-batch's forward (root, then the units in order) and
    backward (the units in reverse, then the root), without the optimizer step."""
    total = layout.total_flops or 1.0
    shares = {f"unit {u}": f / total for u, f in enumerate(layout.unit_flops)}
    unit_share = sum(shares.values())
    root_share = max(0.0, 1.0 - unit_share)
    recompute = max(0.0, issued_flops - model_flops)
    out = []
    for m in range(accum):
        forward = [("root", root_share), *shares.items()]
        for name, share in forward:
            out.append(Segment(f"forward {name}", m, share * model_flops / 3 * micro_batch / flops_per_s))
        for name, share in reversed(forward):
            extra = recompute * share / unit_share if name != "root" and unit_share else 0.0
            out.append(Segment(f"backward {name}", m, (share * model_flops * 2 / 3 + extra) * micro_batch / flops_per_s))
    return out


def simulate(segments: list[Segment], optimizer_s: float, collectives: list[Collective],
             seconds_of: Any) -> dict[str, Any]:
    """The step's timeline (see the module docstring). ``seconds_of(c)``: (seconds, link) of a collective.
    Returns the step time, the compute and optimizer times, and the communication time exposed (not hidden
    behind compute) per link, and the time each link is busy."""
    order = [*segments, Segment("step", segments[-1].micro if segments else 0, optimizer_s)]
    pos = {(s.micro, s.name): k for k, s in enumerate(order)}
    last_backward = {}
    for k, s in enumerate(order):
        if s.name.startswith("backward"):
            last_backward[s.micro] = k
    step_pos = len(order) - 1
    # ready events: ("start" | "end", segment index); needs: segment index that waits
    ready_at: dict[tuple[str, int], list[int]] = {}
    needs: dict[int, list[int]] = {}
    blocking_after: dict[int, list[int]] = {}
    chained: dict[int, int] = {}
    for i, c in enumerate(collectives):
        before = step_pos if c.before == "step" else pos.get((c.micro, c.before)) if c.before else None
        if c.after_previous and i > 0:
            chained[i] = i - 1
            event = None
        elif c.after == "step":
            event = ("end", step_pos)
        elif c.after == "backward":
            event = ("end", last_backward.get(c.micro, step_pos - 1))
        elif c.after:
            event = ("end", pos.get((c.micro, c.after), last_backward.get(c.micro, step_pos - 1)))
        elif before is not None:
            event = ("start", max(0, min(before, step_pos) - 1))
        else:
            event = ("start", 0)
        if event is not None:
            ready_at.setdefault(event, []).append(i)
        if c.blocking and event is not None:
            blocking_after.setdefault(event[1], []).append(i)
        if before is not None and not c.blocking:
            needs.setdefault(before, []).append(i)
    end: dict[int, float] = {}
    link_of: dict[int, str] = {}
    free = {"nvlink": 0.0, "network": 0.0, "none": 0.0}
    busy = {"nvlink": 0.0, "network": 0.0}

    def launch(i: int, t: float) -> None:
        seconds, link = seconds_of(collectives[i])
        start = max(t, free[link]) if link != "none" else t
        end[i] = start + seconds
        link_of[i] = link
        if link != "none":
            free[link] = end[i]
            busy[link] += seconds
        for j, k in chained.items():
            if k == i:
                launch(j, end[i])

    exposed = {"nvlink": 0.0, "network": 0.0}
    t = 0.0
    compute = 0.0
    for k, seg in enumerate(order):
        for i in ready_at.get(("start", k), []):
            launch(i, t)
        waits = [i for i in needs.get(k, []) if i in end]
        start = max([t, *(end[i] for i in waits)])
        if start > t and waits:
            culprit = max(waits, key=lambda i: end[i])
            if link_of[culprit] in exposed:
                exposed[link_of[culprit]] += start - t
        t = start + seg.seconds
        if seg.name != "step":
            compute += seg.seconds
        for i in ready_at.get(("end", k), []):
            launch(i, t)
        blocked = [i for i in blocking_after.get(k, [])]
        if blocked:
            done = max(end[i] for i in blocked)
            if done > t:
                culprit = max(blocked, key=lambda i: end[i])
                if link_of[culprit] in exposed:
                    exposed[link_of[culprit]] += done - t
                t = done
    tail = max([t, *end.values()])
    if tail > t:
        culprit = max(end, key=end.get)
        if link_of[culprit] in exposed:
            exposed[link_of[culprit]] += tail - t
    return {"step_s": tail, "compute_s": compute, "optimizer_s": optimizer_s, "exposed_s": exposed, "busy_s": busy}


def local_trainable(kind: str, layout: Layout, world: int, shard: int) -> int:
    """Trainable elements this rank's optimizer steps: all (DDP), a shard's (FSDP), a partition's (ZeRO)."""
    n = sum(layout.numel(i) for i in layout.trainable_params)
    if kind == "ddp":
        return n
    return -(-n // (shard if kind == "fsdp" else world))


def step_estimate(cfg: Config, layout: Layout, gpu: GPU, net: Network, nodes: int, model_flops: float,
                  issued_flops: float, utilization: float, options: CommOptions | None = None) -> dict[str, Any]:
    """One configuration's step on ``nodes`` nodes of ``net``: the simulated timeline and its figures."""
    gpus_per_node = net.gpus_per_node
    world = nodes * gpus_per_node
    kind, entry_options = engine_kind(cfg.engine.name)
    shard = world
    if kind == "fsdp" and entry_options.get("hybrid"):
        shard, _ = hsdp_degrees(cfg, world, gpus_per_node)
    collectives = step_collectives(cfg, layout, world, gpus_per_node, options)
    micro = cfg.trainer.micro_batch_size(world)
    accum = cfg.trainer.grad_accum_steps
    flops_per_s = utilization * gpu.peak_flops(cfg.precision)
    segments = compute_segments(layout, model_flops, issued_flops, micro, accum, flops_per_s)
    optimizer_s = local_trainable(kind, layout, world, shard) * OPTIMIZER_BYTES / (gpu.hbm_gbps * 1e9) \
        if gpu.hbm_gbps else 0.0
    timings: dict[int, tuple[float, str]] = {}
    volume = {"nvlink": 0, "network": 0}
    latency = {"nvlink": 0.0, "network": 0.0}

    def seconds_of(c: Collective) -> tuple[float, str]:
        key = id(c)
        if key not in timings:
            where = placement(c.span, c.group, world, gpus_per_node, shard)
            t = collective_seconds(c.kind, c.bytes, where, net)
            timings[key] = (t["bandwidth"] + t["latency"], t["link"])
            if t["link"] in volume:
                volume[t["link"]] += c.bytes
                latency[t["link"]] += t["latency"]
        return timings[key]

    sim = simulate(segments, optimizer_s, collectives, seconds_of)
    step_s = sim["step_s"]
    exposed = sim["exposed_s"]
    parts = {"compute": sim["compute_s"], "optimizer step (memory)": optimizer_s,
             "network (exposed)": exposed["network"], "NVLink (exposed)": exposed["nvlink"]}
    bottleneck = max(parts, key=parts.get)
    if bottleneck.endswith("(exposed)"):
        link = "network" if bottleneck.startswith("network") else "nvlink"
        busy = sim["busy_s"][link]
        if busy and latency[link] > busy / 2:
            bottleneck += ", latency-bound"
    global_batch = micro * accum * world
    return {
        "engine": cfg.engine.name, "nodes": nodes, "gpus_per_node": gpus_per_node, "world_size": world,
        "shard_degree": shard if kind == "fsdp" else None, "micro_batch_size": micro, "grad_accum_steps": accum,
        "global_batch_size": global_batch, "collectives": len(collectives),
        "bytes_per_step": {"nvlink": volume["nvlink"], "network": volume["network"]},
        "step_s": step_s, "compute_s": sim["compute_s"], "optimizer_s": optimizer_s,
        "exposed_comm_s": exposed, "busy_comm_s": sim["busy_s"], "latency_s": latency,
        "samples_per_s": global_batch / step_s if step_s else 0.0,
        "samples_per_s_per_gpu": global_batch / step_s / world if step_s else 0.0,
        "bottleneck": bottleneck,
    }


# -- the table -------------------------------------------------------------------------------------------------


def candidates(gpus_per_node: int, nodes: int) -> list[tuple[str, int | None]]:
    """(engine, hsdp shard degree) pairs worth planning on ``nodes`` nodes: every engine the model counts, hsdp at
    each shard degree of one node and its multiples up to half the world (the whole world is fsdp_full)."""
    from slurmvla.planner.comms import RULES
    from slurmvla.registry import ENGINES

    out: list[tuple[str, int | None]] = []
    for name in ENGINES:
        entry = ENGINES.get(name)
        if entry.target not in RULES or not entry.multi_process:
            continue
        if dict(entry.options).get("hybrid"):
            shard = gpus_per_node
            while shard <= max(gpus_per_node, nodes * gpus_per_node // 2):
                out.append((name, shard))
                shard *= 2
        else:
            out.append((name, None))
    return out


def scaling_table(overrides: list[str], gpu: GPU, net: Network, nodes_list: list[int], utilization: float,
                  margin: float, options: CommOptions | None = None, engines: list[str] | None = None
                  ) -> dict[str, Any]:
    """Every engine (``engines``: those only) at every node count: memory (the plan's, per engine and world), step
    time, samples/s, scaling efficiency against the smallest node count, the bottleneck; and per node count the
    recommended (engine, shard degree): the fastest that fits."""
    from slurmvla.compose import compose
    from slurmvla.planner.fit import plan_engine, planner_for
    from slurmvla.planner.recompute_choice import choose

    base = compose(overrides)
    gpn = net.gpus_per_node
    accum = base.trainer.grad_accum_steps
    first = min(nodes_list)
    micro = base.trainer.micro_batch_size(first * gpn)
    layout = layout_for(base)
    rows: list[dict[str, Any]] = []
    for nodes in sorted(set(nodes_list)):
        world = nodes * gpn
        for name, shard in candidates(gpn, nodes):
            if engines and name not in engines:
                continue
            extra = [f"engine={name}", f"engine.name={name}",
                     f"trainer.global_batch_size={micro * accum * world}"]
            if shard is not None:
                extra += [f"engine.shard_degree={shard}", f"engine.replicate_degree={world // shard}"]
            label = name if shard is None else f"{name}"
            try:
                cfg = compose([*overrides, *extra])
                # policy.gradient_checkpointing=auto: the setting training would choose on this GPU and world.
                if cfg.policy.recompute_auto:
                    cfg = choose(cfg, gpu, nodes, gpn, margin).setting.apply(cfg)
                plan = plan_engine(planner_for(cfg), cfg, gpu, nodes, gpn, margin, utilization)
            except ValueError as e:  # a refused combination: said, not planned
                rows.append({"engine": label, "shard_degree": shard, "nodes": nodes, "world_size": world,
                             "refused": str(e).splitlines()[0]})
                continue
            est = plan.get("time_estimate")
            if not est:
                rows.append({"engine": label, "shard_degree": shard, "nodes": nodes, "world_size": world,
                             "fits": plan["fits"], "peak_bytes": plan["peak_bytes"],
                             "refused": "no time estimate (the activations could not be measured)"})
                continue
            row = step_estimate(cfg, layout, gpu, net, nodes, est["model_flops_per_sample"],
                                est["issued_flops_per_sample"], utilization, options)
            row.update(fits=plan["fits"], peak_bytes=plan["peak_bytes"], budget_bytes=plan["budget_bytes"],
                       gradient_checkpointing=_recompute_setting(cfg),
                       mfu=est["model_flops_per_sample"] * row["micro_batch_size"] * accum
                       / (row["step_s"] * gpu.peak_flops(cfg.precision)))
            rows.append(row)
    # Scaling efficiency: per-GPU throughput against the same engine (and shard degree) at the fewest nodes.
    ref: dict[tuple, float] = {}
    for r in rows:
        if "step_s" in r and r["nodes"] == first:
            ref[(r["engine"], r["shard_degree"] if r["engine"] == "hsdp" else None)] = r["samples_per_s_per_gpu"]
    for r in rows:
        if "step_s" in r:
            base_rate = ref.get((r["engine"], r["shard_degree"] if r["engine"] == "hsdp" else None))
            if base_rate is None and r["engine"] == "hsdp":  # a shard degree first possible at more nodes
                base_rate = ref.get(("hsdp", gpn))
            r["scaling_efficiency"] = r["samples_per_s_per_gpu"] / base_rate if base_rate else None
    recommended = {}
    for nodes in sorted(set(nodes_list)):
        ok = [r for r in rows if r["nodes"] == nodes and r.get("fits") and "step_s" in r]
        if ok:
            best = max(ok, key=lambda r: r["samples_per_s"])
            recommended[nodes] = {"engine": best["engine"], "shard_degree": best["shard_degree"],
                                  "samples_per_s": best["samples_per_s"], "step_s": best["step_s"]}
            best["recommended"] = True
        else:
            recommended[nodes] = None
    return {"policy": base.policy.size, "precision": base.precision, "gpu": gpu.name, "network": net.name,
            "network_description": net.describe(), "gpus_per_node": gpn, "micro_batch_size": micro,
            "grad_accum_steps": accum, "assumed_utilization": utilization, "nodes": sorted(set(nodes_list)),
            "rows": rows, "recommended": recommended}


def _recompute_setting(cfg: Config) -> str:
    p = cfg.policy
    if not p.gradient_checkpointing:
        return "off"
    return f"saves {p.checkpoint_saves}, every {p.checkpoint_every}"


_LAYOUTS: dict[str, Layout] = {}


def layout_for(cfg: Config) -> Layout:
    """The policy's layout (slurmvla.planner.comms.layout_of), kept for the next plan of the same policy."""
    from omegaconf import OmegaConf

    from slurmvla.planner.comms import layout_of

    key = f"{OmegaConf.to_yaml(OmegaConf.structured(cfg.policy))}|{cfg.precision}|{cfg.data.mode}|{cfg.optim}"
    if key not in _LAYOUTS:
        _LAYOUTS.clear()
        _LAYOUTS[key] = layout_of(cfg)
    return _LAYOUTS[key]


def parse_nodes(text: str) -> list[int]:
    """``4`` or ``1,2,4,8``: node counts, each >= 1; a PlanError naming the value otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise PlanError(f"--nodes {text} is not valid; it must be a count >= 1 or a comma-separated list of them, "
                        "e.g. 1,2,4,8")
    return values
