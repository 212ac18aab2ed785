"""``serve.fp8_prefix`` on a GPU: the actions against bf16's on many observations, and the latency of both.

    python benchmarks/fp8_prefix.py policy=pi05 precision=bf16 [--observations 100] [--iters 100]

The policy is built with random weights on the device (as benchmarks/sample_latency.py builds it), each moved by
noise of 0.02 (zero-initialised projections would otherwise leave the actions blind to the prefix), in bf16, then
copied: one copy as the server runs it by default, the other with its prefix quantized to float8
(slurmvla/inference/fp8.py) before its projections are fused. Both serve through ``serve.cuda_graph`` +
``serve.compile`` (the fastest mode) under bf16 autocast. For ``--observations`` requests (each its own random
frames, state and seed of benchmarks/observations.py; the same noise for both copies) it prints the largest and
mean absolute difference of the float8 actions from bf16's, against the spread of bf16's; then p50 / p99 of each
over ``--iters`` calls of one observation (batch 1), and their ratio. Needs a GPU with FP8 matrix units
(compute capability 8.9 or above) and torchao.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from observations import compose_every_camera_sent, observation, observation_as_batch
from sample_latency import timed  # noqa: I001 (sibling scripts)

from slurmvla.engine.materialize import place
from slurmvla.inference.fp8 import check_fp8, quantize_prefix
from slurmvla.inference.graphs import GraphedSampler
from slurmvla.inference.optimize import fuse_projections, lower_weights
from slurmvla.policy import build_policy
from slurmvla.policy.base import seeded_sample_actions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--observations", type=int, default=100)
    parser.add_argument("--iters", type=int, default=100, help="timed calls per copy (after warm-up)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this measures float8 matrix products on a GPU; tests/inference/test_fp8.py checks the numerics on "
                         "the CPU")
    cfg, cameras = compose_every_camera_sent(args.overrides)
    device = torch.device("cuda")
    torch.manual_seed(0)
    reference = place(build_policy(cfg.policy, on_meta=True), device).eval()
    with torch.no_grad():  # off the exact zeros of the initialisation, which would hide the prefix from the actions
        for p in reference.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)
    lower_weights(reference, torch.bfloat16)
    quantized = copy.deepcopy(reference)
    check_fp8(quantized, device)
    count = quantize_prefix(quantized)
    spec = type(reference).sample_spec(cfg.policy)
    print(f"policy={cfg.policy.name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M parameters, "
          f"{len(cameras)} cameras; {count} prefix linear layers in float8; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)

    samplers = {}
    for name, policy in (("bf16", reference), ("fp8 prefix", quantized)):
        fuse_projections(policy)
        samplers[name] = GraphedSampler(policy, compile=True)

    def call(name: str, batch: dict, seed: int) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            return seeded_sample_actions(samplers[name], spec, batch, seed)

    t0 = time.perf_counter()
    diffs, actions = [], []
    for i in range(args.observations):
        batch = observation_as_batch(observation(cameras, seed=i), cameras, spec, cfg, device)
        want, got = call("bf16", batch, i).float(), call("fp8 prefix", batch, i).float()
        diffs.append((got - want).abs().flatten())
        actions.append(want.flatten())
    diff, spread = torch.cat(diffs), torch.cat(actions).std()
    print(f"{args.observations} observations ({time.perf_counter() - t0:.0f} s with compilation): float8 prefix "
          f"against bf16: max |a - b| {diff.max():.4f}, mean {diff.mean():.5f}; bf16 actions' spread (std) "
          f"{spread:.4f}: max {diff.max() / spread:.2%} of it", flush=True)

    batch = observation_as_batch(observation(cameras), cameras, spec, cfg, device)
    rows = {name: timed(lambda n=name: call(n, batch, 0), args.iters, True) for name in samplers}
    for name, row in rows.items():
        print(f"{name:>11}: p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  min {row['min_ms']:7.2f} ms",
              flush=True)
    print(f"float8 prefix / bf16, p50: {rows['fp8 prefix']['p50_ms'] / rows['bf16']['p50_ms']:.3f}")


if __name__ == "__main__":
    main()
