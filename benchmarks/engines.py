"""Step time and peak memory of every strategy at world size 2, as ratios to ddp.

    python benchmarks/engines.py [--nproc 2] [--steps 10] [--engines ddp,fsdp_full,...] [HYDRA_OVERRIDES ...]
    python benchmarks/engines.py policy=small trainer.global_batch_size=4      # a mid-size policy

Each strategy runs as its own torchrun job on one fixed micro-batch (data loading is left out):
warmup steps, then measured optimizer steps. The slowest rank's mean step time gates the figure;
peak memory is the worst rank's peak resident set on CPU (max allocated on CUDA).
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

from slurmvla.registry import ENGINES

ALL = [e for e in ENGINES if e != "single"]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from slurmvla.compose import compose
    from slurmvla.trainer import Trainer

    cfg = compose(["logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false",
                   "data.num_workers=0", f"engine={args.engine}", *args.overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        batches = [trainer._next_batch() for _ in range(cfg.trainer.grad_accum_steps)]
        cuda = trainer.device.type == "cuda"

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        for _ in range(args.warmup):
            trainer.train_step(batches)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(batches)
        sync()
        step_s = (time.perf_counter() - t0) / args.steps
        peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"step_s": step_s, "peak_bytes": peak})
        if trainer.env.is_main:
            with open(args.out, "w") as f:
                json.dump({"ranks": everyone, "micro_batch": trainer.micro_batch_size}, f)
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ALL))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = {}
    for engine in args.engines.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--worker", "--engine", engine, "--out", out.name, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), *args.overrides]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{engine}: failed\n{res.stdout[-2000:]}{res.stderr[-2000:]}", file=sys.stderr)
                continue
            rows[engine] = json.load(open(out.name))
    if not rows:
        sys.exit("no strategy ran")
    ref = rows.get("ddp") or next(iter(rows.values()))
    ref_t = max(r["step_s"] for r in ref["ranks"])
    ref_m = max(r["peak_bytes"] for r in ref["ranks"])
    print(f"world size {args.nproc}, overrides {args.overrides or '(defaults)'}, {args.steps} measured steps")
    print(f"{'engine':14s} {'step ms':>9s} {'x ddp':>7s} {'peak MiB':>9s} {'x ddp':>7s}   per-rank step ms")
    for engine, r in rows.items():
        t = max(x["step_s"] for x in r["ranks"])
        m = max(x["peak_bytes"] for x in r["ranks"])
        per_rank = " ".join(f"{x['step_s'] * 1e3:.1f}" for x in r["ranks"])
        print(f"{engine:14s} {t * 1e3:9.1f} {t / ref_t:7.2f} {m / 2**20:9.0f} {m / ref_m:7.2f}   {per_rank}")


if __name__ == "__main__":
    main()
