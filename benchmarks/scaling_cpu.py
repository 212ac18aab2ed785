"""The scaling model checked where it can be measured: on this machine's CPUs, gloo between processes.

    python benchmarks/scaling_cpu.py [--worlds 2 4] [--steps 5] [--engines ddp ...] [--json OUT] [overrides...]

For each world size, one torchrun job (gloo, one thread a rank) does, on every rank at once:

1. calibration: all-reduce and all-gather of fp32 buffers from 4 KiB to 16 MiB, timed; the model's link figures
   (bandwidth, latency per ring step, launch cost) are fitted to them by least squares
   (``t = launch + steps x latency + factor x bytes / bandwidth``, the ring costs of slurmvla/planner/network.py);
2. compute alone: the same policy's forward + backward and AdamW step in every process, without collectives
   (the processes share the cores as the training ranks do);
3. each engine's training step (the steps of tests/planner/comm_driver.py: forward, backward, clip, step),
   warmed up for two steps, then timed (the slowest rank's, median over ``--steps``).

The prediction is slurmvla.planner.scaling's timeline: compute from the measured compute-alone step, split per
wrap unit in the planner's FLOP proportions, the optimizer step scaled to what the engine's rank steps, and the
engine's collectives (slurmvla.planner.comms) timed with the fitted links and overlapped as the engine
schedules them. It prints measured / predicted per engine and world size. The policy by default: the reference
policy widened to 3.7M parameters (communication and compute both matter on two cores). Not a test: timings on
a shared machine vary; docs/plan.md keeps a run's figures with this command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICY = ["policy.width=256", "policy.expert_width=192", "policy.depth=4", "policy.vision_width=128",
          "policy.vision_depth=2", "policy.num_heads=4", "policy.head_dim=64", "policy.vision_heads=4"]
ENGINES = ["ddp", "fsdp_full", "fsdp_grad_op", "hsdp", "zero1", "zero2", "zero3"]
SIZES = [2**k for k in range(10, 23, 2)]  # fp32 elements: 4 KiB .. 16 MiB
MICRO = 2


def _compose(overrides: list[str], engine: str, world: int):
    from slurmvla.compose import compose

    return compose([*POLICY, *overrides, f"engine={engine}", f"trainer.global_batch_size={MICRO * world}",
                    "logging.wandb.mode=disabled"])


# -- the worker (one rank of the torchrun job) ------------------------------------------------------------------


def _timed(fn, reps: int) -> float:
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / reps


def worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from slurmvla.engine.base import StepSettings
    from slurmvla.engine.distributed import init_process_group
    from slurmvla.launch import DistEnv
    from slurmvla.planner.activations import fake_batch
    from slurmvla.policy import build_policy
    from slurmvla.registry import ENGINES as REGISTRY
    from slurmvla.seeding import seed_everything

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    env = DistEnv.from_environ()
    init_process_group(env, torch.device("cpu"), "gloo", 600, required=True)
    world = env.world_size
    out: dict = {"world": world, "calibration": [], "compute": {}, "engines": {}}
    # 1. calibration
    barrier_s = _timed(dist.barrier, 20)
    for n in SIZES if spec.get("calibrate", True) else []:
        x = torch.ones(n)
        part = torch.ones(n // world)
        full = torch.empty(n)
        reps = max(10, min(100, int(4e7 // (n * 4 * world))))
        out["calibration"].append({"kind": "all_reduce", "bytes": 4 * n,
                                   "s": _timed(lambda x=x: dist.all_reduce(x), reps) - barrier_s / reps})
        out["calibration"].append({"kind": "all_gather", "bytes": 4 * n,
                                   "s": _timed(lambda p=part, f=full: dist.all_gather_into_tensor(f, p), reps)
                                   - barrier_s / reps})
        out["calibration"].append({"kind": "reduce_scatter", "bytes": 4 * n,
                                   "s": _timed(lambda p=part, f=full: dist.reduce_scatter_tensor(p, f), reps)
                                   - barrier_s / reps})
    # 2. compute alone: every rank its own copy, no collectives
    cfg = _compose(spec["overrides"], "ddp", world)
    seed_everything(0)
    policy = build_policy(cfg.policy, None)
    batch = fake_batch(cfg, policy, MICRO, (64, 64))
    opt = torch.optim.AdamW(policy.parameters())
    fb, st = [], []
    for i in range(spec["steps"] + 2):
        t0 = time.perf_counter()
        policy(dict(batch))["loss"].backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= 2:
            fb.append(t1 - t0)
            st.append(t2 - t1)
    times = torch.tensor([statistics.median(fb), statistics.median(st)], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    out["compute"] = {"forward_backward_s": times[0].item(), "optimizer_s": times[1].item()}
    del policy, opt
    # 3. each engine's step
    for name in spec["engines"]:
        cfg = _compose(spec["overrides"], name, world)
        entry = REGISTRY.get(name)
        seed_everything(0)
        policy = build_policy(cfg.policy, None, on_meta=entry.deferred_init)
        settings = StepSettings(MICRO, 1, cfg.trainer.max_grad_norm)
        engine = entry.load()(cfg.engine, env, cfg.precision, torch.device("cpu"), settings, **entry.options)
        model, _ = engine.prepare(policy, cfg.optim)
        sample = fake_batch(cfg, policy, MICRO, (64, 64))
        steps = []
        for i in range(spec["steps"] + 2):
            dist.barrier()
            t0 = time.perf_counter()
            with engine.autocast():
                loss = model(dict(sample))["loss"]
            engine.backward(loss)
            engine.clip_grad_norm()
            engine.step()
            if i >= 2:
                steps.append(time.perf_counter() - t0)
        per_step = torch.tensor(steps, dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        out["engines"][name] = {"step_s": statistics.median(per_step.tolist()), "steps_s": per_step.tolist()}
        del engine, model, policy
        dist.barrier()
    if env.rank == 0:
        Path(spec["out"]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the fit and the prediction ---------------------------------------------------------------------------------


def fit_links(world: int, samples: list[dict]) -> tuple[dict[str, dict[str, float]], float]:
    """Per collective kind, the ring cost whose launch, per-step latency and bandwidth best fit the measured
    samples (least squares, each sample weighted by 1 / its time), all on one 'node' of ``world`` ranks. gloo's
    all-gather and reduce-scatter are not the bandwidth-optimal rings NCCL runs, so each kind gets its own
    figures. Returns them and the worst sample's relative distance from its fit."""
    import numpy as np

    fits, worst = {}, 0.0
    n = world
    for kind in sorted({s["kind"] for s in samples}):
        rows, ys = [], []
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        for s in samples:
            if s["kind"] == kind:
                rows.append([1.0, factor * s["bytes"]])
                ys.append(s["s"])
        a, y = np.array(rows), np.array(ys)
        w = 1 / np.maximum(y, 1e-9)
        (fixed, per_byte), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
        fixed, per_byte = max(float(fixed), 0.0), max(float(per_byte), 1e-15)
        fits[kind] = {"fixed_s": fixed, "latency_per_step_s": fixed / (1 + steps), "gbps": 1e-9 / per_byte,
                      "factor": factor}
        worst = max(worst, float(np.max(np.abs(a @ np.array([fixed, per_byte]) - y) / y)))
    return fits, worst


def seconds(fits: dict, kind: str, nbytes: int, group: int) -> float:
    if group <= 1:
        return 0.0
    f = fits.get(kind, fits["all_reduce"])
    return f["fixed_s"] + f["factor"] * nbytes * 1e-9 / f["gbps"]


def predict(overrides: list[str], engine: str, world: int, fits: dict, compute: dict, overhead: float) -> dict:
    """The model's step at ``world``: compute alone at this world (its measured forward + backward, times the
    engine's own overhead measured at world 1), the optimizer step scaled to the rank's share, and the engine's
    collectives timed with the fitted links: overlapped as the engine schedules them (slurmvla.planner.scaling)
    and, for comparison, serialized after the compute."""
    from slurmvla.planner.comms import engine_kind, hsdp_degrees, layout_of, step_collectives
    from slurmvla.planner.scaling import compute_segments, local_trainable, simulate

    cfg = _compose(overrides, engine, world)
    if "layout" not in _layouts:
        _layouts["layout"] = layout_of(cfg, autocast="cpu")
    layout = _layouts["layout"]
    kind, options = engine_kind(engine)
    shard = hsdp_degrees(cfg, world, world)[0] if options.get("hybrid") else world
    flops = layout.total_flops
    fb = compute["forward_backward_s"] * overhead
    segments = compute_segments(layout, flops, flops, MICRO, 1, flops * MICRO / fb)
    total = sum(layout.numel(i) for i in layout.trainable_params)
    optimizer_s = compute["optimizer_s"] * local_trainable(kind, layout, world, shard) / total
    collectives = step_collectives(cfg, layout, world, world)

    def seconds_of(c):
        return seconds(fits, c.kind, c.bytes, c.group), "nvlink" if c.group > 1 else "none"

    sim = simulate(segments, optimizer_s, collectives, seconds_of)
    comm = sum(seconds_of(c)[0] for c in collectives)
    return {"step_s": sim["step_s"], "serial_s": fb + optimizer_s + comm, "compute_s": fb,
            "optimizer_s": optimizer_s, "comm_s": comm, "exposed_s": sum(sim["exposed_s"].values()),
            "collectives": len(collectives)}


_layouts: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engines", nargs="+", default=ENGINES)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    results = {"policy": POLICY + args.overrides, "micro_batch_size": MICRO, "worlds": {}}
    measured = {}
    for world in sorted({1, *args.worlds}):  # world 1: each engine's own overhead over the bare step
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / "spec.json"
            out = Path(tmp) / "out.json"
            spec.write_text(json.dumps({"out": str(out), "overrides": args.overrides, "steps": args.steps,
                                        "engines": args.engines, "calibrate": world > 1}))
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc_per_node={world}", __file__, "--worker", str(spec)],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"world {world}: the torchrun job failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            measured[world] = json.loads(out.read_text())
            measured[world]["seconds"] = time.perf_counter() - t0
    one = measured[1]
    overhead = {name: one["engines"][name]["step_s"] / (one["compute"]["forward_backward_s"]
                                                       + one["compute"]["optimizer_s"]) for name in args.engines}
    print(f"world 1 ({one['seconds']:.0f} s): compute alone {one['compute']['forward_backward_s']:.4f} s forward + "
          f"backward, {one['compute']['optimizer_s']:.4f} s optimizer; each engine's step over it: "
          + ", ".join(f"{k} x{v:.2f}" for k, v in overhead.items()))
    for world in args.worlds:
        m = measured[world]
        fits, worst = fit_links(world, m["calibration"])
        print(f"world {world} ({m['seconds']:.0f} s): gloo fitted per kind: " + "; ".join(
            f"{k} {f['gbps']:.2f} GB/s + {1e6 * f['fixed_s']:.0f} us" for k, f in fits.items())
            + f" (worst sample {100 * worst:.0f} % off its fit); compute alone: forward + backward "
            f"{m['compute']['forward_backward_s']:.4f} s, optimizer {m['compute']['optimizer_s']:.4f} s")
        rows = {}
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            for name in args.engines:
                p = predict(args.overrides, name, world, fits, m["compute"], overhead[name])
                t = m["engines"][name]["step_s"]
                rows[name] = {"measured_s": t, "predicted": p, "ratio": t / p["step_s"],
                              "ratio_serialized": t / p["serial_s"]}
        print(f"{'engine':13s} {'measured s':>10s} {'predicted s':>11s} {'ratio':>6s} {'serialized':>10s} {'ratio':>6s}"
              "   (predicted: compute + optimizer; communication, of which exposed)")
        for name, r in rows.items():
            p = r["predicted"]
            print(f"{name:13s} {r['measured_s']:10.4f} {p['step_s']:11.4f} {r['ratio']:6.2f} {p['serial_s']:10.4f} "
                  f"{r['ratio_serialized']:6.2f}   ({p['compute_s']:.4f} + {p['optimizer_s']:.4f}; {p['comm_s']:.4f}, "
                  f"{p['exposed_s']:.4f})")
        results["worlds"][world] = {"links": fits, "fit_worst_relative_error": worst, "calibration": m["calibration"],
                                    "compute": m["compute"], "engines": rows}
    results["world_1"] = {"compute": one["compute"], "engines": one["engines"], "overhead": overhead}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
