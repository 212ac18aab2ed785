"""The plan as a person reads it: one engine's figures line by line, and every engine side by side."""

from __future__ import annotations

from typing import Any

from slurmvla.units import GiB, MiB


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", GiB) if largest >= GiB / 4 else ("MiB", MiB)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _flops(n: float) -> str:
    return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"


def _recompute(r: dict[str, Any]) -> str:
    if not r["gradient_checkpointing"]:
        return "off"
    if r.get("checkpoint_saves") in (None, "inputs") and r.get("checkpoint_every") in (None, 1):
        return "on"
    return f"on (saves {r['checkpoint_saves']}, every {r['checkpoint_every']})"


def format_plan(r: dict[str, Any]) -> str:
    p, a = r["parameters"], r["activations"]
    name, div = _unit(max(r["peak_bytes"], r["budget_bytes"] if r["peak_bytes"] >= GiB / 4 else 0))

    def row(label: str, v: float) -> tuple[str, float]:
        return label, v

    lines: list[str | tuple[str, float]] = [
        f"policy={r['policy']} ({_count(p['total'])} parameters: {_count(p['trainable'])} trainable, "
        f"{_count(p['frozen'])} frozen{', LoRA adapters' if p['adapters'] else ''}), precision={r['precision']}, "
        f"engine={r['engine']}, gradient checkpointing {_recompute(r)}",
        f"{r['world_size']} x {r['gpu']} ({r['nodes']} node(s) x {r['gpus_per_node']} GPU(s)); global batch "
        f"{r['global_batch_size']} = micro {r['micro_batch_size']} x accumulation {r['grad_accum_steps']} x "
        f"{r['world_size']} GPU(s)",
        ("per GPU (worst rank)", None),
    ]
    lines += [row(k, v) for k, v in r["held_bytes"].items() if v]
    lines.append(row("= model states", sum(r["held_bytes"].values())))
    lines.append(row(f"activations, micro-batch {r['micro_batch_size']}: {a['method'].split(' (')[0]}",
                     a["bytes_at_micro_batch"]))
    if a["method"].startswith("measured"):
        lines.append(f"    = {a['fixed_bytes'] / div:.2f} {name} + {a['per_sample_bytes'] / div:.3f} {name} per sample "
                     f"(fake runs at micro-batch {' and '.join(a['measured_bytes'])}; parameters "
                     f"{'/'.join(a['compute_dtypes'])} (trainable/frozen))")
        if "compile" in a["method"]:  # trainer.compile: whose saved tensors were measured
            lines.append(f"    {a['method'].split(' (', 1)[1].removesuffix(')')}")
    else:
        lines.append(f"    {a['method']}")
    for title, key in (("forward + backward", "forward_backward_bytes"), ("optimizer step", "step_bytes"),
                       ("end of backward", "end_of_backward_bytes")):
        lines += [row(f"{title}: {k}", v) for k, v in r[key].items() if v]
    lines.append(row(f"= peak ({r['peak_phase']})", r["peak_bytes"]))
    verdict = "FITS" if r["fits"] else f"DOES NOT FIT (over by {(r['peak_bytes'] - r['budget_bytes']) / GiB:.2f} GiB)"
    lines.append(f"budget: {r['gpu_memory_bytes'] / GiB:.1f} GiB - {r['reserved_bytes'] / GiB:.0f} GiB reserved (CUDA "
                 f"context, workspaces) - {100 * r['margin']:.0f}% allocator margin = {r['budget_bytes'] / GiB:.2f} GiB "
                 f"-> {verdict}")
    if r["largest_micro_batch"] > 0:
        s = r["to_fit"]
        keep = (f"; trainer.grad_accum_steps={s['grad_accum_steps']} keeps the global batch {r['global_batch_size']} "
                f"at micro-batch {s['micro_batch_size']}") if s else \
            f"; no split of the global batch {r['global_batch_size']} over {r['world_size']} GPU(s) is that small"
        lines.append(f"largest micro-batch that fits: {r['largest_micro_batch']} (ESTIMATE: linear in the micro-batch "
                     f"beyond the measured sizes){keep}")
    else:
        lines.append("largest micro-batch that fits: none (the model states alone, or with one sample, exceed the "
                     "budget: shard them over more GPUs (engine=fsdp_full / zero2 / zero3), freeze parts, or use LoRA)")
    est = r.get("time_estimate")
    if est:
        lines.append(
            f"ESTIMATE, not a measurement: {_flops(est['model_flops_per_sample'])} per sample (forward + backward; "
            f"{_flops(est['issued_flops_per_sample'])} issued with recomputation); at an assumed "
            f"{100 * est['assumed_utilization']:.0f}% of {est['peak_tflops']:.0f} TFLOP/s ({r['precision']}, dense) a "
            f"step takes ~{est['step_s']:.3g} s, {est['samples_per_s']:.3g} samples/s, MFU {100 * est['mfu']:.0f}% "
            "(communication and data loading not modelled)")
    lines += [f"note: {n}" for n in r["notes"]]
    if r.get("auto_recompute"):
        lines.append(r["auto_recompute"])
    # The figures' column sits after the longest label: a label is never cut.
    width = max(64, *(len(x[0]) for x in lines if isinstance(x, tuple)))

    def render(x: str | tuple[str, float | None]) -> str:
        if isinstance(x, str):
            return x
        label, v = x
        return f"{label:{width + 2}s} {name:>9s}" if v is None else f"  {label:{width}s} {v / div:9.2f}"

    return "\n".join(render(x) for x in lines)


def format_comparison(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "refused" not in r]
    name, div = _unit(max((r["peak_bytes"] for r in ok), default=GiB))
    lines = [f"{'engine':13s} {'params':>7s} {'grads':>7s} {'master':>7s} {'AdamW':>7s} {'transnt':>7s} "
             f"{'activ.':>7s} {'peak':>7s}  {'fits':4s} {'max micro':>9s} {'accum':>5s} {'step s':>7s}"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['engine']:13s} {r['refused']}")
            continue
        h = r["held_bytes"]
        transient = max(sum(r["forward_backward_bytes"].values()), sum(r["step_bytes"].values()),
                        sum(r["end_of_backward_bytes"].values()))
        s = r["to_fit"]
        step = r.get("time_estimate", {}).get("step_s")
        g = lambda v: f"{v / div:7.2f}"  # noqa: E731
        lines.append(f"{r['engine']:13s} {g(h['parameters'])} {g(h['gradients'])} {g(h['fp32 master weights'])} "
                     f"{g(h['AdamW state'])} {g(transient)} {g(r['activations']['bytes_at_micro_batch'])} "
                     f"{g(r['peak_bytes'])}  {'yes' if r['fits'] else 'NO':4s} {r['largest_micro_batch']:9d} "
                     f"{(s['grad_accum_steps'] if s else '-')!s:>5s} {f'{step:7.3g}' if step else '      -'}")
    lines.append(f"{name} per GPU (worst rank). transnt: the largest transient besides the activations (gathered "
                 "parameters, buckets, fp32 gradient copies); activ.: measured at the configured micro-batch; accum: "
                 "the fewest grad_accum_steps that fit and keep the global batch; step s: an ESTIMATE at the assumed "
                 "utilization")
    lines += [f"{r['engine']}: {r['auto_recompute']}" for r in ok if r.get("auto_recompute")]
    return "\n".join(lines)



def format_scaling(t: dict[str, Any]) -> str:
    """The scaling table: every engine at every node count, the recommended one per node count marked ``*``."""
    lines = [
        f"ESTIMATE, not a measurement: policy={t['policy']}, precision={t['precision']}, {t['gpus_per_node']} x "
        f"{t['gpu']} per node; micro-batch {t['micro_batch_size']} per GPU x accumulation {t['grad_accum_steps']} "
        f"(weak scaling: the global batch grows with the nodes); compute at an assumed "
        f"{100 * t['assumed_utilization']:.0f}% of the GPU's dense peak",
        f"network {t['network_description']}",
        f"{'nodes':>5s} {'GPUs':>5s}  {'engine':13s} {'shard':>5s}  {'fits':4s} {'step s':>9s} {'samples/s':>10s} "
        f"{'per GPU':>9s} {'scaling':>7s}  {'exposed comm s':>19s}  bottleneck",
    ]
    for r in t["rows"]:
        shard = "-" if r.get("shard_degree") is None or r["engine"] not in ("hsdp",) else str(r["shard_degree"])
        head = f"{r['nodes']:5d} {r['world_size']:5d}  {r['engine']:13s} {shard:>5s}"
        if "step_s" not in r:
            lines.append(f"{head}  {r['refused']}")
            continue
        e = r["exposed_comm_s"]
        exposed = f"{e['network']:.3g} / {e['nvlink']:.3g}"
        scale = f"{100 * r['scaling_efficiency']:6.0f}%" if r.get("scaling_efficiency") else "      -"
        mark = "*" if r.get("recommended") else " "
        lines.append(f"{head}  {'yes' if r['fits'] else 'NO':4s} {r['step_s']:9.4g} {r['samples_per_s']:10.4g} "
                     f"{r['samples_per_s_per_gpu']:9.4g} {scale}  {exposed:>19s} {mark}{r['bottleneck']}")
    lines.append("exposed comm s: communication not hidden behind compute, network / NVLink; scaling: samples/s per GPU "
                 "against the same engine at the fewest nodes; * the recommended engine at that node count (the "
                 "fastest that fits)")
    for nodes, rec in t["recommended"].items():
        if rec is None:
            lines.append(f"recommended at {nodes} node(s): none fits")
        else:
            shard = f", engine.shard_degree={rec['shard_degree']}" if rec["engine"] == "hsdp" else ""
            lines.append(f"recommended at {nodes} node(s): engine={rec['engine']}{shard} ({rec['samples_per_s']:.4g} "
                         f"samples/s, {rec['step_s']:.4g} s a step)")
    return "\n".join(lines)
