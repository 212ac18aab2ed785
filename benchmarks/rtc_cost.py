"""What real-time chunking's guidance costs per call: ``sample_actions`` with a previous chunk (RTC) against
plain sampling, same policy, observation and noise.

    python benchmarks/rtc_cost.py policy=tiny [--reps 20] [--delay 3] [--overlap 6] [--json OUT]
    python benchmarks/rtc_cost.py policy=pi05 precision=bf16        # on a GPU (benchmarks/gpu_suite.sh rtc)
    python benchmarks/rtc_cost.py policy=tiny policy.rtc_training.max_delay=4   # training-time RTC: its prefix

The policy is built with random weights on the device (the meta device, then materialised there), its
projections fused as the server runs them, given one DROID observation as the server builds it. Each
repetition times one plain call and one RTC call, their order alternating (paired, interleaved: a shared
machine's drift hits both); printed: the median ms per call of each and the median of the per-pair ratios.
With ``serve.rtc_jacobian=model`` RTC differentiates through every flow step (a vector-Jacobian product per
step), so the expected ratio is that of a forward plus backward of the action expert to its forward alone; with
``identity`` (the default) it adds a few element-wise operations per step: about 1. A policy built for training-time
RTC (``policy.rtc_training``) answers the same request by its clean prefix instead (no backward): about 1.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import torch
from observations import compose_every_camera_sent, observation

from slurmvla.engine.materialize import place
from slurmvla.inference.load import Loaded
from slurmvla.inference.optimize import fuse_projections, lower_weights
from slurmvla.inference.runner import PolicyRunner
from slurmvla.policy import build_policy
from slurmvla.policy.base import seeded_sample_actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--delay", type=int, default=3)
    parser.add_argument("--overlap", type=int, default=6, help="rows of prev_actions (k)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cfg, cameras = compose_every_camera_sent([*args.overrides, "data.root=unused"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    policy = place(build_policy(cfg.policy, on_meta=True), device).eval()
    if cuda and cfg.precision == "bf16":
        lower_weights(policy, torch.bfloat16)
    fuse_projections(policy)
    runner = PolicyRunner(Loaded(policy=policy, cfg=cfg, step=0, source="benchmark"))
    obs = observation(cameras)
    k = min(args.overlap, cfg.policy.action_horizon)
    prev = np.random.default_rng(1).normal(size=(k, cfg.policy.action_dim))
    rtc = runner.read_rtc({"prev_actions": prev, "delay": min(args.delay, k, cfg.policy.action_horizon - 1)})
    rtc = rtc.to(device)
    batch = runner.processor.batch(collections.deque([runner.processor.read(obs)]))
    batch = {key: v.to(device) if torch.is_tensor(v) else v for key, v in batch.items()}
    batch = policy.prepare_inference(batch) if policy.prepare_inference is not None else batch

    def call(guided: bool) -> float:
        ctx = torch.autocast("cuda", torch.bfloat16) if cuda and cfg.precision == "bf16" else torch.no_grad()
        t0 = time.perf_counter()
        with ctx:
            seeded_sample_actions(policy, runner.spec, batch, 0, rtc if guided else None)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000

    for guided in (False, True, False, True):  # warm-up
        call(guided)
    plain, guided, ratios = [], [], []
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        ms = {g: call(g) for g in order}
        plain.append(ms[False])
        guided.append(ms[True])
        ratios.append(ms[True] / ms[False])
    where = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    row = {"policy": f"{cfg.policy.name}/{getattr(cfg.policy, 'size', '')}", "device": where,
           "steps": cfg.policy.num_inference_steps, "horizon": cfg.policy.action_horizon, "delay": int(rtc.delay[0]),
           "overlap": k, "rtc_method": runner.rtc_metadata()["method"], "jacobian": runner.rtc_metadata().get("jacobian"),
           "plain_ms": float(np.median(plain)), "rtc_ms": float(np.median(guided)),
           "ratio": float(np.median(ratios)), "reps": args.reps}
    jac = f" ({row['jacobian']} Jacobian)" if row["jacobian"] else ""
    print(f"{row['policy']} on {where}, {row['steps']} steps, H={row['horizon']}, d={row['delay']}, k={k}: plain "
          f"{row['plain_ms']:.2f} ms, rtc by {row['rtc_method']}{jac} {row['rtc_ms']:.2f} ms per call (medians of {args.reps} "
          "pairs), "
          f"rtc / plain {row['ratio']:.2f} (median of the per-pair ratios)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()
