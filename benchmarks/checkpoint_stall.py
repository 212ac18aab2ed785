"""The training stall a checkpoint save causes, synchronous against asynchronous, as a ratio of the
median step time.

    python benchmarks/checkpoint_stall.py [--saves 2] [--after 4] [HYDRA_OVERRIDES ...]   # ~2.5 min on 2 CPU cores
    python benchmarks/checkpoint_stall.py --engine fsdp_full --nproc 2                    # launches torchrun itself
    python benchmarks/checkpoint_stall.py trainer.global_batch_size=32 precision=bf16      # on a GPU

One Trainer (per rank), the same steps for both modes, alternating sync and async saves. For each
save the stall is the time the steps from the save's step through ``--after`` steps later took beyond
the median step time measured between saves (so work a background writer steals from later steps
counts too). Reported (rank 0's clock; the ranks step together): median step time, and per mode the
median stall and its ratio to the step time, how long the save call itself blocked the training loop,
and the save's own wall time to its commit (``save_seconds`` in meta.json). Every checkpoint is
complete before the next save starts (``wait()``, outside the timing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from slurmvla.checkpoint import checkpoint_bytes
from slurmvla.compose import compose
from slurmvla.trainer import Trainer

# Set by the launching process for its ranks.
RUN_DIR_ENV, ARGS_ENV = "CHECKPOINT_STALL_RUN_DIR", "CHECKPOINT_STALL_ARGS"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(trainer: Trainer, save: bool) -> tuple[float, float]:
    _sync(trainer.device)
    t0 = time.perf_counter()
    trainer.run_step()
    _sync(trainer.device)
    t_save = 0.0
    if save:
        t1 = time.perf_counter()
        trainer.save()
        t_save = time.perf_counter() - t1
    return time.perf_counter() - t0, t_save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=2, help="saves per mode")
    parser.add_argument("--after", type=int, default=4, help="steps after a save counted in its stall")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--engine", default=None, help="engine=NAME (default: the config's, single)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks: > 1 runs this under torchrun --standalone")
    parser.add_argument("overrides", nargs="*")
    # The ranks get this command line through the environment (torchrun would read --nproc as its own).
    args = parser.parse_args(json.loads(os.environ[ARGS_ENV]) if ARGS_ENV in os.environ else None)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        # Start the ranks (each runs this script, in one run directory) and hand over their exit status.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               os.path.abspath(__file__)]
        with tempfile.TemporaryDirectory() as run_dir:
            env = {"OMP_NUM_THREADS": "1", **os.environ, RUN_DIR_ENV: run_dir, ARGS_ENV: json.dumps(sys.argv[1:])}
            sys.exit(subprocess.call(cmd, env=env))
    engine = [f"engine={args.engine}"] if args.engine else []
    cfg = compose(["policy=small", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
                   "checkpoint.resume=false", "checkpoint.every_steps=0", "checkpoint.keep=1", "data.num_workers=0",
                   "trainer.max_steps=100000", "trainer.global_batch_size=4", *engine, *args.overrides])
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(cfg, os.environ.get(RUN_DIR_ENV, scratch))
        for _ in range(args.warmup):
            timed_step(trainer, False)
        quiet: list[float] = []
        stalls: dict[str, list[list[float]]] = {"sync": [], "async": []}
        blocked: dict[str, list[float]] = {"sync": [], "async": []}
        committed: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.saves):
            for mode in ("sync", "async"):
                trainer.checkpoints.async_save = mode == "async"
                quiet += [timed_step(trainer, False)[0] for _ in range(args.after)]
                first, t_save = timed_step(trainer, True)
                if mode == "async":
                    background = trainer.checkpoints.background
                window = [first] + [timed_step(trainer, False)[0] for _ in range(args.after)]
                trainer.checkpoints.wait()
                stalls[mode].append(window)
                blocked[mode].append(t_save)
                committed[mode].append(trainer.checkpoints.last_save_seconds)
        median = statistics.median(quiet)
        size = checkpoint_bytes(trainer.checkpoints.latest()) / 2**20
        rank, world, device = trainer.env.rank, trainer.env.world_size, trainer.device
        trainer.close()
    if rank != 0:
        return
    print(f"engine={cfg.engine.name} world size {world} policy={cfg.policy.size} precision={cfg.precision} "
          f"device={device} checkpoint {size:.0f} MB, {args.saves} saves per mode, stall counted over the save step "
          f"+ {args.after} steps{'' if background else ' (this engine cannot save in the background)'}")
    print(f"median step time (no save): {median * 1e3:.1f} ms")
    print(f"{'mode':6} {'stall ms':>10} {'stall / step':>13} {'save call blocks ms':>20} {'save to commit ms':>18}")
    ratios = {}
    for mode in ("sync", "async"):
        stall = statistics.median(sum(t - median for t in w) for w in stalls[mode])
        ratios[mode] = stall / median
        print(f"{mode:6} {stall * 1e3:10.1f} {ratios[mode]:13.2f} {statistics.median(blocked[mode]) * 1e3:20.1f} "
              f"{statistics.median(committed[mode]) * 1e3:18.1f}")
    print(f"async / sync stall: {ratios['async'] / ratios['sync']:.2f}; async / sync save call blocks: "
          f"{statistics.median(blocked['async']) / statistics.median(blocked['sync']):.2f} (the stall counts the steps "
          "around a save, so on a busy or small machine their spread can outweigh it; the save call is the part the "
          "training thread waits for)")


if __name__ == "__main__":
    main()
