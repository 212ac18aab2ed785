"""Step profiler: where a training step's time goes, global throughput, peak memory, FLOPs and MFU.

    python -m slurmvla.profile [train overrides] [--json OUT.json] [--plot OUT.png]
    torchrun --nproc_per_node=2 -m slurmvla.profile engine=fsdp_full profile.steps=20
    python -m slurmvla.profile policy=small --compare engine=single "engine=single precision=bf16"

It builds the same Trainer as ``slurmvla.train`` (same config system), runs ``profile.warmup_steps``
untimed optimizer steps, then ``profile.steps`` timed ones through the trainer's own step with a
mark at the end of each phase: data wait, host->device, forward, backward, grad clip, optimizer
step (+ zero-grad, which the engine does inside its step), scheduler. On GPU the marks are CUDA
events on the compute stream; on CPU, wall-clock. Phases tile the step, so their shares add up to
100% with no aggregate row. A step is an optimizer step: with gradient accumulation, forward and
backward add up over its micro-batches and it counts ``trainer.global_batch_size`` samples.

Throughput is global: every rank's mean step time is gathered and the slowest rank sets samples/s.
Peak memory is reset at the warmup -> measured boundary and the worst rank reported (allocated and
reserved on GPU; resident set size, sampled after every step, on CPU). Model FLOPs per sample are
counted with torch's FlopCounterMode over one forward + backward of the policy (every matmul, convolution
and attention, the backward pass included; recomputation not), twice: as run (each sample at the width the
batch's prompt was cut to, padding included) and useful (each sample over its own tokens: padding is work
the hardware does that carries no data). MFU and useful MFU are the two over ``profile.peak_tflops``, per
device.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import shlex
import tempfile
import time
from pathlib import Path

import psutil
import torch

from slurmvla.cli import ArgumentParser, program
from slurmvla.collectives import gather_dict
from slurmvla.compose import compose
from slurmvla.config import Config
from slurmvla.errors import Failure, exit_code, exit_with
from slurmvla.planner.recompute_choice import Setting
from slurmvla.registry import ENGINES

log = logging.getLogger("slurmvla")

PHASES = ("data wait", "host->device", "forward", "backward", "grad clip", "optimizer step + zero-grad", "scheduler")


class PhaseTimer:
    """Marks at phase ends; one step's durations per phase. Uses CUDA events on GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._now()))

    def durations(self) -> dict[str, float]:
        """Seconds per phase for the step just run (waits for the GPU once)."""
        if self.cuda:
            self.marks[-1][1].synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        for (_, a), (phase, b) in zip(self.marks[:-1], self.marks[1:]):
            out[phase] = out.get(phase, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


# Kinds of kernel by name, first match wins (cuBLAS / CUTLASS / nvjet matrix products, FlashAttention /
# memory-efficient attention, Triton's fused kernels from torch.compile, copies, reductions, the rest).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matrix product", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "aten::mm", "aten::addmm", "aten::bmm",
                        "aten::linear", "conv")),
    ("compiled (triton)", ("triton",)),
    ("copy / cast", ("copy", "memcpy", "memset", "cat", "aten::to", "_to_copy")),
    ("reduction / norm", ("reduce", "norm", "softmax", "sum", "mean")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def kernel_table(fn, device: torch.device, top: int = 15, calls: int = 1) -> str:
    """Run ``fn`` ``calls`` times under torch's profiler; the ``top`` kernels (GPU: device time of each
    kernel, graph replays included) or operators (CPU: self time) by total time, their kinds' totals,
    and the device's busy time per call against the wall clock (a GPU busy for less than the wall is
    waiting on the host: launches, synchronisation)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t0) / calls
    totals: dict[str, list] = {}
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):  # a named range (e.g. the optimizer's step), not work
            continue
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.device_time
        else:
            if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        row = totals.setdefault(e.name, [0.0, 0])
        row[0] += us
        row[1] += 1
    busy = sum(us for us, _ in totals.values()) / calls / 1e3
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in totals.items():
        kinds[kernel_kind(name)] += us / calls / 1e3
    what = "kernels (device time)" if cuda else "operators (self CPU time)"
    lines = [f"{what} per call: {busy:.2f} ms busy in {wall * 1e3:.2f} ms of wall clock ({100 * busy / (wall * 1e3):.0f}%)",
             f"{'kind':20s} {'ms':>9s} {'share':>6s}"]
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"{kind:20s} {ms:9.2f} {100 * ms / max(busy, 1e-9):5.1f}%")
    lines.append(f"{'top ' + str(top):20s} {'ms':>9s} {'share':>6s} {'count':>6s}  name")
    for name, (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        ms = us / calls / 1e3
        lines.append(f"{kernel_kind(name):20s} {ms:9.2f} {100 * ms / max(busy, 1e-9):5.1f}% {n // calls:6d}  {name[:110]}")
    return "\n".join(lines)


def count_flops_per_sample(cfg: Config, batch: dict, policy: torch.nn.Module | None = None) -> float:
    """Model FLOPs (forward + backward, no recomputation) of the policy on one sample of ``batch``, by the
    planner's counter (:func:`slurmvla.planner.activations.count_flops`: a copy built on the meta device).
    ``policy``: the real one, which first does the sample's host-side work where it has any
    (``prepare_inference``: pi0.5 writes its prompt from the state's values, which a meta tensor does not
    have), its prompt cut exactly as the training forward cuts it."""
    from slurmvla.planner.activations import count_flops

    one = {k: v[:1] for k, v in batch.items()}
    if policy is not None and policy.prepare_inference is not None:
        with torch.no_grad():
            one = policy.prepare_inference(one, bucket=1)
    return count_flops(cfg, one, issued=False)[0]


def padding_flops(cfg: Config, batch: dict, policy: torch.nn.Module) -> tuple[float, float]:
    """(executed, useful) model FLOPs per sample of one training micro-batch (forward + backward, no recomputation).
    Executed: as the trainer runs the batch (``prepare_training``: pi0 / pi0.5 cut the prompt to the batch's
    longest, rounded up to ``policy.prompt_bucket`` columns, so shorter samples carry padding through every
    layer). Useful: each sample over its own tokens (``prepare_inference(bucket=1)`` on the sample alone), the
    work that carries data. Equal for a policy without a prompt to cut.

    The samples' shapes differ only in their prompt's width L, and a forward + backward costs a polynomial of
    degree 2 in L (every linear layer's FLOPs are linear in the tokens, attention's scores and weighted sums
    quadratic): with more than three widths, three are counted and the rest read off the polynomial through
    them, so a micro-batch costs at most three counts (each about a count's time at pi0.5's size)."""
    from slurmvla.planner.activations import count_flops_of

    size = len(batch["state"])
    with torch.no_grad():
        run = policy.prepare_training(batch) if policy.prepare_training is not None else batch
        ones = [_sample(batch, i) for i in range(size)]
        if policy.prepare_inference is not None:
            ones = [policy.prepare_inference(one, bucket=1) for one in ones]
    samples = {_shapes(one): one for one in ones}
    executed = _sample(run, 0)
    samples.setdefault(_shapes(executed), executed)
    widths = _widths(list(samples))
    if widths is None or len(samples) <= 3:
        counted = dict(zip(samples, (f for f, _ in count_flops_of(cfg, list(samples.values()), issued=False))))
    else:  # three widths counted, the others on the polynomial through them
        by_width = sorted(samples, key=widths.__getitem__)
        picked = [by_width[0], by_width[len(by_width) // 2], by_width[-1]]
        flops = [f for f, _ in count_flops_of(cfg, [samples[k] for k in picked], issued=False)]
        xs = [float(widths[k]) for k in picked]
        counted = {k: quadratic_through(xs, flops, float(widths[k])) for k in samples}
    useful = sum(counted[_shapes(one)] for one in ones) / size
    return counted[_shapes(executed)], useful


def _sample(batch: dict, i: int) -> dict:
    return {k: v[i:i + 1] for k, v in batch.items()}


def _shapes(sample: dict) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in sorted(sample.items()) if isinstance(v, torch.Tensor))


def _widths(keys: list[tuple]) -> dict[tuple, int] | None:
    """Each shape signature's one varying size (the prompt's width), or None if they differ otherwise."""
    sizes = [[d for _, shape in key for d in shape] for key in keys]
    if len({len(s) for s in sizes}) != 1 or len({tuple(k for k, _ in key) for key in keys}) != 1:
        return None
    varying = {tuple(s[j] for s in sizes) for j in range(len(sizes[0])) if len({s[j] for s in sizes}) > 1}
    if len(varying) != 1:
        return None
    (column,) = varying
    return dict(zip(keys, column))


def quadratic_through(xs: list[float], ys: list[float], x: float) -> float:
    """The degree-2 polynomial through three points, at x (Lagrange)."""
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = yi
        for j, xj in enumerate(xs):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


def profile_run(cfg: Config, run_dir: Path) -> dict:
    """Profile one configuration on every rank; the report on rank 0 (None elsewhere)."""
    from slurmvla.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    ready_s = time.perf_counter() - t0
    try:
        report = _measure(trainer)
        if report is not None:
            report["trainer_ready_s"] = ready_s
        if cfg.profile.kernels:
            table = kernel_table(trainer.run_step, trainer.device, cfg.profile.kernels)
            if report is not None:
                report["kernels"] = table
        return report
    finally:
        trainer.close(keep_process_group=True)


def _measure(trainer) -> dict | None:
    cfg, device = trainer.cfg, trainer.device
    for _ in range(cfg.profile.warmup_steps):
        trainer.run_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    proc = psutil.Process()
    rss = proc.memory_info().rss
    per_step: list[dict[str, float]] = []
    timer = PhaseTimer(device)
    for _ in range(cfg.profile.steps):
        timer.start()
        trainer.run_step(timer)
        per_step.append(timer.durations())
        rss = max(rss, proc.memory_info().rss)
    # A batch for counting FLOPs (taken after the timed steps so it costs them nothing).
    batch = trainer._next_batch()
    flops, useful = padding_flops(cfg, batch, trainer.policy)
    mean = {p: sum(s[p] for s in per_step) / len(per_step) for p in per_step[0]}
    step_s = sum(mean.values())
    local = {"step_s": torch.tensor([step_s]), "rss": torch.tensor([float(rss)])}
    if device.type == "cuda":
        local["allocated"] = torch.tensor([float(torch.cuda.max_memory_allocated(device))])
        local["reserved"] = torch.tensor([float(torch.cuda.max_memory_reserved(device))])
    for p, v in mean.items():
        local[f"phase/{p}"] = torch.tensor([v])
    gathered = gather_dict(local, 1)
    if gathered is None:
        return None
    world = trainer.env.world_size
    slowest = float(gathered["step_s"].max())
    samples_per_s = cfg.trainer.global_batch_size / slowest
    report = {
        "config": {"engine": cfg.engine.name, "precision": cfg.precision, "policy": cfg.policy.size,
                   "world_size": world, "device": device.type, "global_batch_size": cfg.trainer.global_batch_size,
                   "micro_batch_size": trainer.micro_batch_size, "grad_accum_steps": cfg.trainer.grad_accum_steps,
                   "warmup_steps": cfg.profile.warmup_steps, "steps": cfg.profile.steps,
                   "attention": cfg.policy.attention_implementation, "loader": cfg.data.loader,
                   "recompute": str(Setting.of(cfg.policy) or "n/a")},
        # Rank 0's phase means; every rank's step time below.
        "phases_s": {p: float(gathered[f"phase/{p}"][0]) for p in mean},
        "step_s_per_rank": gathered["step_s"].tolist(),
        "step_s": slowest,
        "samples_per_s": samples_per_s,
        "peak_rss_bytes": float(gathered["rss"].max()),
        "flops_per_sample": flops,
        "useful_flops_per_sample": useful,
    }
    if "allocated" in gathered:
        report["peak_allocated_bytes"] = float(gathered["allocated"].max())
        report["peak_reserved_bytes"] = float(gathered["reserved"].max())
    if cfg.profile.peak_tflops > 0 and device.type == "cuda":
        report["mfu"] = flops * samples_per_s / world / (cfg.profile.peak_tflops * 1e12)
        report["useful_mfu"] = useful * samples_per_s / world / (cfg.profile.peak_tflops * 1e12)
    return report


def format_report(r: dict) -> str:
    c = r["config"]
    lines = [
        f"engine={c['engine']} precision={c['precision']} policy={c['policy']} world={c['world_size']} "
        f"device={c['device']} attention={c['attention']} recompute={c.get('recompute', 'n/a')}; {c['steps']} optimizer steps after {c['warmup_steps']} "
        f"warmup; global batch {c['global_batch_size']} (micro {c['micro_batch_size']} x accum "
        f"{c['grad_accum_steps']} x {c['world_size']} ranks)",
        f"{'phase (rank 0)':30s} {'ms/step':>9s} {'share':>7s}",
    ]
    step = sum(r["phases_s"].values())
    for p, v in r["phases_s"].items():
        lines.append(f"{p:30s} {v * 1e3:9.2f} {100 * v / step:6.1f}%")
    lines.append(f"{'step':30s} {step * 1e3:9.2f} {100.0:6.1f}%")
    per_rank = ", ".join(f"{s * 1e3:.2f}" for s in r["step_s_per_rank"])
    lines.append(f"throughput: {r['samples_per_s']:.1f} samples/s, set by the slowest rank ({r['step_s'] * 1e3:.2f} "
                 f"ms/step); mean step per rank (ms): [{per_rank}]")
    if "peak_allocated_bytes" in r:
        lines.append(f"peak memory (worst rank): {r['peak_allocated_bytes'] / 2**30:.2f} GiB allocated, "
                     f"{r['peak_reserved_bytes'] / 2**30:.2f} GiB reserved")
    lines.append(f"peak resident memory (worst rank): {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    lines.append(f"model FLOPs per sample (forward + backward, FlopCounterMode; no recomputation): "
                 f"{r['flops_per_sample'] / 1e9:.3f} GFLOP as run, {r['useful_flops_per_sample'] / 1e9:.3f} GFLOP on "
                 f"the tokens that carry data ({100 * (1 - r['useful_flops_per_sample'] / r['flops_per_sample']):.1f}% "
                 "spent on prompt padding)")
    if "mfu" in r:
        lines.append(f"MFU: {100 * r['mfu']:.1f}% of the configured peak; useful MFU (padding excluded): "
                     f"{100 * r['useful_mfu']:.1f}%")
    if "trainer_ready_s" in r:
        lines.append(f"start-up: the Trainer was ready in {r['trainer_ready_s']:.1f} s (built, on its device, first "
                     "batch not yet read)")
    if "kernels" in r:
        lines.append(f"one more optimizer step under torch's profiler: {r['kernels']}")
    note = ENGINES.get(c["engine"]).profile_note
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def format_comparison(reports: list[dict], labels: list[str]) -> str:
    base = reports[0]
    mem = "peak_allocated_bytes" if "peak_allocated_bytes" in base else "peak_rss_bytes"
    lines = [f"{'config':40s} {'samples/s':>10s} {'ratio':>6s} {'step ms':>9s} {'ratio':>6s} {'peak MiB':>9s} {'ratio':>6s}"]
    for label, r in zip(labels, reports):
        lines.append(f"{label[:40]:40s} {r['samples_per_s']:10.1f} {r['samples_per_s'] / base['samples_per_s']:6.2f} "
                     f"{r['step_s'] * 1e3:9.2f} {r['step_s'] / base['step_s']:6.2f} {r[mem] / 2**20:9.0f} "
                     f"{r[mem] / base[mem]:6.2f}")
    lines.append(f"peak memory: {'allocated (GPU)' if mem == 'peak_allocated_bytes' else 'resident set (CPU)'}; ratios "
                 "to the first config")
    return "\n".join(lines)


def plot(reports: list[dict], labels: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[profile]'") from e
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(reports)))
    for i, r in enumerate(reports):
        left = 0.0
        for j, (p, v) in enumerate(r["phases_s"].items()):
            ax.barh(i, v * 1e3, left=left, color=plt.cm.tab10(j), label=p if i == 0 else None)
            left += v * 1e3
    ax.set_yticks(range(len(reports)), labels)
    ax.set_xlabel("ms per optimizer step (rank 0)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.profile"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train overrides (key=value), shared by every compared config")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plot", type=Path, help="write the phase breakdown as a PNG")
    parser.add_argument("--compare", nargs="+", metavar="OVERRIDES",
                        help="profile several configs side by side; each argument is a quoted set of overrides")
    args = parser.parse_args(argv)

    from slurmvla.engine.distributed import shutdown_process_group

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    base = [*args.overrides, "logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false",
            "checkpoint.every_steps=0", "trainer.val_every_steps=0"]
    variants = args.compare or [""]
    reports, labels = [], []
    try:
        for variant in variants:
            cfg = compose([*base, *shlex.split(variant)])
            steps = cfg.profile.warmup_steps + cfg.profile.steps + 1 + (cfg.profile.kernels > 0)
            cfg.trainer.max_steps = max(cfg.trainer.max_steps, steps)
            with tempfile.TemporaryDirectory(prefix="slurmvla-profile-") as run_dir:
                report = profile_run(cfg, Path(run_dir))
            if report is not None:
                print(format_report(report), flush=True)
                print(flush=True)
                reports.append(report)
                labels.append(variant or " ".join(args.overrides) or "defaults")
    except (ValueError, Failure) as e:  # one line, exit 2 or 1 (errors.exit_code), as inside errors.boundary
        exit_with(e, exit_code(e))
    finally:
        shutdown_process_group()
    if not reports:
        return  # not rank 0
    if len(reports) > 1:
        print(format_comparison(reports, labels))
    if args.json:
        args.json.write_text(json.dumps({"runs": [dict(r, label=lbl) for r, lbl in zip(reports, labels)]}, indent=2))
    if args.plot:
        plot(reports, labels, args.plot)


if __name__ == "__main__":
    main()
