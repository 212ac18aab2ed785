"""Peak host memory per rank while a full-size pi0-family policy is built and sharded (fsdp_full, CPU).

    python benchmarks/startup_memory.py [--policy pi05] [--nproc 2] [--modes deferred,whole]

deferred: what the trainer does under an FSDP engine -- parameters on the meta device, fully_shard,
then each rank materialises and initialises its own shard (slurmvla/engine/materialize.py).
whole: the policy built whole (random initialisation) on every rank, then sharded.

Each mode is one torchrun job (gloo); the figure is each rank's peak resident set (ru_maxrss) after
the sharded model is ready, and the ratio whole / deferred. A mode whose ranks together need more
memory than the machine has can be run at a smaller world size (--whole-nproc; its per-rank peak does
not depend on the world size: every rank holds the whole model) or as a build alone (--build-only: a
lower bound of that peak).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from slurmvla.compose import compose
    from slurmvla.engine.fsdp import FSDPEngine
    from slurmvla.engine.materialize import parameters_on_meta
    from slurmvla.launch import DistEnv
    from slurmvla.policy import build_policy

    dist.init_process_group("gloo")
    env = DistEnv.from_environ()
    cfg = compose([f"policy={args.policy}", "engine=fsdp_full", "data.num_workers=0", "logging.wandb.mode=disabled"])
    torch.manual_seed(0)
    start = time.perf_counter()
    if args.mode == "deferred":
        with parameters_on_meta():
            policy = build_policy(cfg.policy)
    else:
        policy = build_policy(cfg.policy)
    built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if not (args.build_only and args.mode == "whole"):
        FSDPEngine(cfg.engine, env, "fp32", torch.device("cpu"), settings=None).shard(policy)
    dist.barrier()
    seconds = time.perf_counter() - start
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in policy.parameters())
    out = {"rank": env.rank, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "rss_after_build_mib": built_rss, "local_params": local,
           "total_params": sum(p.numel() for p in policy.parameters()), "seconds": seconds}
    with open(f"{args.out}.{env.rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run(mode: str, policy: str, nproc: int, build_only: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               "--worker", "--mode", mode, "--policy", policy, "--out", out, *(["--build-only"] if build_only else [])]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{mode}: torchrun exited {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
            return []
        return [json.load(open(f"{out}.{r}.json")) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="pi05")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--whole-nproc", type=int, default=None,
                        help="world size for the whole-model baseline (default --nproc)")
    parser.add_argument("--modes", default="deferred,whole")
    parser.add_argument("--build-only", action="store_true",
                        help="whole: build the policy and stop (a lower bound of its peak, for a machine where the "
                             "whole model on every rank plus its shard does not fit)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    peaks = {}
    for mode in args.modes.split(","):
        nproc = args.whole_nproc or args.nproc if mode == "whole" else args.nproc
        ranks = run(mode, args.policy, nproc, args.build_only)
        if not ranks:
            continue
        peaks[mode] = max(r["peak_rss_mib"] for r in ranks)
        for r in ranks:
            label = f"{mode} (build only)" if mode == "whole" and args.build_only else mode
            print(f"{label:9s} world {nproc} rank {r['rank']}: peak RSS {r['peak_rss_mib']:8.0f} MiB (after build "
                  f"{r['rss_after_build_mib']:7.0f}), {r['local_params'] / 1e6:7.1f}M of {r['total_params'] / 1e6:.1f}M "
                  f"parameters local, {r['seconds']:.1f} s")
    if len(peaks) == 2:
        print(f"peak RSS per rank, whole / deferred: {peaks['whole'] / peaks['deferred']:.2f}x")


if __name__ == "__main__":
    main()
