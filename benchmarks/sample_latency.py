"""Real-time inference: ``sample_actions`` latency at batch 1, eager against CUDA graphs, and what the
server adds.

    python benchmarks/sample_latency.py policy=pi05 precision=bf16 [--iters 200] [--server] [--kernels 15] [--json OUT]

The policy is built with random weights straight on the device (the meta device, then materialised
there: no fp32 copy on the host), put in eval mode and given one DROID observation as the server
builds it: an image at 180 x 320 for each camera the policy reads (three; two under ``experiment=pi05_droid``:
benchmarks/observations.py), resized with padding by the policy, 8 state values, a prompt,
``policy.num_inference_steps`` denoising steps, noise seeded on the CPU. Modes, in this order on one
model:

- ``eager_autocast``: fp32 weights under bf16 autocast (the server before it held its weights in bf16);
- ``eager``: the weights in bf16 (as training's forward and the server now hold them), autocast;
- ``graph``: ``serve.cuda_graph=true``: the whole ``sample_actions`` replayed from one CUDA graph;
- ``compile_graph``: ``serve.compile=true`` as well: the repeated layers compiled, then graphed.

Each prints p50 / p99 / min over ``--iters`` calls (after warm-up; a GPU is synchronised after each
call), and the largest difference of its actions from ``eager``'s (same weights, same noise).
``--server``: the server (openpi's ``WebsocketClientPolicy``, this machine) against the runner alone,
both through CUDA graphs (of the compiled layers when ``compile_graph`` ran): p50 of both and their
difference. On a CPU only the eager modes run. Every mode runs with pi0 / pi0.5's projections fused as the server
runs them (``serve.fused_projections``; ``serve.fused_projections=false`` times them unfused).

``--jitter``: where the latency tail comes from (benchmarks/jitter.py). Per mode (default ``graph,compile_graph``
on a GPU, ``eager`` on a CPU), ``--iters`` (default 500) calls of the server's path, a session's
``infer(obs)`` on a :class:`PolicyRunner` (under ``serve.cuda_graph`` / ``serve.compile`` for the graphed
modes), each split into the runner's stages (preprocess / prompt / h2d / launch / sync / post), with the
collector's passes, the caching allocator's retries and cudaMalloc calls, CUDA events around the sampler and
the SM clock; then the slowest 1 % attributed to the stage that grew over its median and to collector passes.
``--variants`` (default ``full,nogc,act,replay``) repeats the loop in the same warm state with the collector
frozen and disabled (``nogc``), with the observation prepared once (``act``: ``runner.act`` alone) and with the
sampler alone (``replay``: the captured graph replayed; eager: ``sample_actions`` on a prepared batch), and
says which of them brings p99 / p50 within 1.15.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import torch
from jitter import Instrumented, SmClock, StageClock, measure, slowest, summary, table, verdict
from observations import compose_every_camera_sent, observation, observation_as_batch

from slurmvla.engine.materialize import place
from slurmvla.inference.graphs import GraphedSampler
from slurmvla.inference.harness import serving_in_thread
from slurmvla.inference.load import Loaded
from slurmvla.inference.optimize import fuse_projections, lower_weights
from slurmvla.inference.runner import PolicyRunner
from slurmvla.inference.server import PolicyServer
from slurmvla.policy import build_policy
from slurmvla.policy.base import seeded_sample_actions
from slurmvla.profile import kernel_table

VARIANTS = ("full", "nogc", "act", "replay")
def timed(fn, iters: int, cuda: bool) -> dict:
    for _ in range(3):
        fn()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ms.append((time.perf_counter() - t0) * 1000)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "min_ms": float(min(ms))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, help="timed calls per mode (default 100; 500 with --jitter)")
    parser.add_argument("--modes", help="default eager_autocast,eager,graph,compile_graph; with --jitter graph,compile_graph "
                        "(a CPU: eager)")
    parser.add_argument("--jitter", action="store_true", help="where the latency tail comes from: per-call stages, "
                        "the collector, the allocator, the clock (see above)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"with --jitter, of {list(VARIANTS)}")
    parser.add_argument("--deadline", type=float, metavar="S", help="with --jitter, skip a variant that would not end "
                        "within S seconds of the start (its calls at the last p50), so that a time limit leaves a "
                        "finished table")
    parser.add_argument("--server", action="store_true", help="also time the server through openpi's client")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="per mode, the N most expensive kernels of 5 calls under torch's profiler, and their kinds")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    args.start = time.perf_counter()
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        parser.error(f"--variants: {bad[0]!r} is not a variant; choose from {list(VARIANTS)}")
    args.iters = args.iters or (500 if args.jitter else 100)
    if args.modes is None:
        args.modes = ("graph,compile_graph" if torch.cuda.is_available() else "eager") if args.jitter \
            else "eager_autocast,eager,graph,compile_graph"
    cfg, cameras = compose_every_camera_sent(args.overrides)
    args.fused = cfg.serve.fused_projections  # serve.fused_projections=false: as the server would run
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    policy = place(build_policy(cfg.policy, on_meta=True), device).eval()  # pi0 / pi0.5: built on the device
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in policy.parameters())
    print(f"policy={cfg.policy.name}: {params / 1e6:.1f}M parameters, {len(cameras)} cameras, built on {device} in "
          f"{build_s:.1f} s; "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}", flush=True)

    loaded = Loaded(policy=policy, cfg=cfg, step=0, source="benchmark")
    spec = type(policy).sample_spec(cfg.policy)
    batch = observation_as_batch(observation(cameras), cameras, spec, cfg, device)
    autocast = cuda and cfg.precision == "bf16"
    ctx = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else torch.no_grad

    if args.jitter:
        jitter(loaded, batch, ctx, autocast, cuda, args)
        return

    results, eager = {}, None
    for mode in args.modes.split(","):
        row = run_mode(mode, policy, spec, batch, ctx, autocast, cuda, args)
        if row is None:
            continue
        actions = row.pop("actions")
        if mode == "eager":
            eager = actions
        elif eager is not None:
            row["max_abs_diff_vs_eager"] = float((actions - eager).abs().max())
        table = row.pop("kernel_table", None)
        results[mode] = row
        print(f"{mode:>15}: p50 {row['p50_ms']:8.2f} ms  p99 {row['p99_ms']:8.2f} ms  min {row['min_ms']:8.2f} ms  "
              f"first call {row['first_call_s']:.1f} s"
              + (f"  max |a - eager| {row['max_abs_diff_vs_eager']:.4f}" if "max_abs_diff_vs_eager" in row else ""),
              flush=True)
        if table:
            print(table, flush=True)

    if args.server:
        results["server"] = server_overhead(loaded, cfg, args.iters, cuda)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": cfg.policy.name, "params": params, "build_s": build_s, "device": str(device),
                       "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                       "results": results}, f, indent=2)


def run_mode(mode: str, policy, spec, batch: dict, ctx, autocast: bool, cuda: bool, args) -> dict | None:
    """One mode's timings (and its actions, and with ``--kernels`` its kernel table); None where it cannot run."""
    if mode != "eager_autocast" and autocast and next(policy.parameters()).dtype != torch.bfloat16:
        lower_weights(policy, torch.bfloat16)
    if mode.endswith("graph") and not cuda:
        print(f"{mode}: skipped (no GPU)")
        return None
    if args.fused:  # after any change of dtype, which leaves a fused weight behind
        fuse_projections(policy)
    sampler = policy if mode.startswith("eager") else GraphedSampler(policy, compile=mode == "compile_graph")

    def call():
        with torch.no_grad(), ctx():
            return seeded_sample_actions(sampler, spec, batch, 0)

    t1 = time.perf_counter()
    call()
    if cuda:
        torch.cuda.synchronize()
    row = {"first_call_s": time.perf_counter() - t1, **timed(call, args.iters, cuda)}
    actions = call().float().cpu()
    row["action_abs_max"] = float(actions.abs().max())
    row["actions"] = actions
    if args.kernels:
        row["kernel_table"] = kernel_table(call, torch.device("cuda" if cuda else "cpu"), args.kernels, calls=5)
    return row


def jitter(loaded: Loaded, batch: dict, ctx, autocast: bool, cuda: bool, args) -> None:
    """``--jitter``: per mode, the variants' tables and the verdict; JSON (``--json``) rewritten after each mode."""
    policy, cfg = loaded.policy, loaded.cfg
    cfg.serve.seed = 0  # one observation and a fixed serve.seed: the same noise every call
    device = torch.device("cuda" if cuda else "cpu")
    sm = SmClock(device) if cuda else None
    if sm is not None:
        print(f"SM clock: {sm.source or 'not read (' + sm.why + ')'}", flush=True)
    out = {"policy": cfg.policy.name, "device": str(device), "gpu": torch.cuda.get_device_name() if cuda else None,
           "torch": torch.__version__, "iters": args.iters, "sm_clock": sm.source if sm else None, "modes": {}}
    print(f"jitter: {args.iters} calls per variant; stages in ms (exclusive), the slowest 1 % against each stage's "
          f"median" + ("" if cuda else "; a CPU's figures, not a GPU's"), flush=True)
    for mode in args.modes.split(","):
        if mode != "eager_autocast" and autocast and next(policy.parameters()).dtype != torch.bfloat16:
            lower_weights(policy, torch.bfloat16)
        if mode.endswith("graph") and not cuda:
            print(f"{mode}: skipped (no GPU)", flush=True)
            continue
        if args.fused:
            fuse_projections(policy)
        sampler = None if mode.startswith("eager") else GraphedSampler(policy, compile=mode == "compile_graph")
        runner = PolicyRunner(loaded, sampler)  # as build_runner makes it under serve.cuda_graph / serve.compile
        session, obs = runner.session(), observation(list(cfg.serve.cameras))
        t1 = time.perf_counter()
        plain = session.infer(obs)["actions"]
        row = {"first_call_s": time.perf_counter() - t1, "variants": {}}
        clock = StageClock()
        inst = Instrumented(runner, clock, cuda)
        with inst:
            same = np.array_equal(session.infer(obs)["actions"], plain)
        print(f"{mode}: first call {row['first_call_s']:.1f} s; timing wrappers change no action: {same}", flush=True)
        row["same_actions_instrumented"] = bool(same)
        p50 = None
        for variant in args.variants.split(","):
            left = None if args.deadline is None else args.deadline - (time.perf_counter() - args.start)
            if left is not None and p50 is not None and (args.iters + 10) * p50 / 1000 > left:
                print(f"  {variant}: skipped, {args.iters} calls at {p50:.1f} ms would not end within --deadline "
                      f"{args.deadline:.0f} s ({left:.0f} s left)", flush=True)
                continue
            call = jitter_call(variant, runner, session, obs, batch, ctx, clock, inst, cuda)
            if variant in ("full", "nogc", "act"):
                with inst:
                    rec = measure(call, args.iters, clock, cuda, inst, sm, no_gc=variant == "nogc")
            else:
                rec = measure(call, args.iters, clock, cuda, inst, sm)
            print(table(variant, rec), flush=True)
            p50 = float(np.median(rec.total))
            row["variants"][variant] = {"summary": summary(rec), "slowest": slowest(rec),
                                        "calls": {"total": np.round(rec.total, 4).tolist(),
                                                  "gc_ms": np.round(rec.gc_ms, 4).tolist(),
                                                  "device_ms": [None if np.isnan(x) else round(float(x), 4)
                                                                for x in rec.device_ms],
                                                  "sm_mhz": [None if np.isnan(x) else float(x) for x in rec.sm_mhz]}}
        ratios = {v: r["summary"]["p99_over_p50"] for v, r in row["variants"].items()}
        row["verdict"] = verdict(ratios)
        print(f"  {mode}: p99/p50 " + ", ".join(f"{v} {x:.2f}" for v, x in ratios.items()) + f" -> {row['verdict']}",
              flush=True)
        out["modes"][mode] = row
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)


def jitter_call(variant: str, runner: PolicyRunner, session, obs: dict, batch: dict, ctx, clock: StageClock,
                inst: Instrumented, cuda: bool):
    """One call of ``variant``: the session's ``infer`` (full, nogc); ``runner.act`` on a batch prepared once (act);
    the sampler alone (replay): the captured graph replayed, or (eager) ``sample_actions`` on a prepared batch."""
    if variant in ("full", "nogc"):
        return lambda: session.infer(obs)
    if variant == "act":
        host = runner.processor.batch(collections.deque([runner.processor.read(obs)], maxlen=1))
        return lambda: runner.act(host)
    sampler = runner.sampler
    if isinstance(sampler, GraphedSampler):
        entry = next(reversed(sampler.graphs.values()))  # the graph the calls above replayed

        def replay():
            inst._sampler_before()
            entry.graph.replay()
            inst._sampler_after()
            torch.cuda.synchronize()
        return replay
    policy = runner.policy
    on = {k: v.to(runner.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    prepared = policy.prepare_inference(on) if policy.prepare_inference is not None else on
    draw = next((d for d in runner.spec.draws if d.name == "noise"), None)
    noise = None if draw is None else torch.randn((1, *draw.shape), generator=torch.Generator().manual_seed(0)).to(
        runner.device)

    def eager():
        inst._sampler_before()
        with torch.no_grad(), ctx():
            if noise is None:
                seeded_sample_actions(sampler, runner.spec, prepared, 0)
            else:
                sampler.sample_actions(prepared, noise=noise)
        inst._sampler_after()
        if cuda:
            torch.cuda.synchronize()
    return eager


def server_overhead(loaded: Loaded, cfg, iters: int, cuda: bool) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    cfg.serve.seed = 0
    # The layers were compiled in place by the compile_graph mode when it ran: the graphs hold its kernels.
    runner = PolicyRunner(loaded, GraphedSampler(loaded.policy) if cuda else None)
    obs = observation(list(cfg.serve.cameras))
    batch = runner.processor.batch(collections.deque([runner.processor.read(obs)], maxlen=1))
    alone = timed(lambda: runner.act(batch), iters, cuda)
    server = PolicyServer(runner, "127.0.0.1", 0)
    with serving_in_thread(server) as port:
        client = WebsocketClientPolicy("127.0.0.1", port)
        wire = timed(lambda: client.infer(obs), iters, False)
    row = {"runner_p50_ms": alone["p50_ms"], "server_p50_ms": wire["p50_ms"], "server_p99_ms": wire["p99_ms"],
           "overhead_p50_ms": wire["p50_ms"] - alone["p50_ms"]}
    print(f"{'server':>15}: openpi client p50 {wire['p50_ms']:.2f} ms (p99 {wire['p99_ms']:.2f}), runner alone p50 "
          f"{alone['p50_ms']:.2f} ms: the server adds {row['overhead_p50_ms']:.2f} ms", flush=True)
    return row


if __name__ == "__main__":
    main()
