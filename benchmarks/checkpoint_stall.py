"""The training stall a checkpoint save causes, synchronous against asynchronous, as a ratio of the
median step time.

    python benchmarks/checkpoint_stall.py [--saves 2] [--after 4] [HYDRA_OVERRIDES ...]   # ~2.5 min on 2 CPU cores
    python benchmarks/checkpoint_stall.py trainer.global_batch_size=32 precision=bf16      # on a GPU

One Trainer, the same steps for both modes, alternating sync and async saves. For each save the
stall is the time the steps from the save's step through ``--after`` steps later took beyond the
median step time measured between saves (so work a background writer steals from later steps
counts too). Reported: median step time, and per mode the median stall and its ratio to the step
time, plus how long the save call itself blocked the training loop. Every checkpoint is complete
before the next save starts (``wait()``, outside the timing).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from slurmvla.checkpoint import checkpoint_bytes
from slurmvla.compose import compose
from slurmvla.trainer import Trainer


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
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["policy=small", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
                   "checkpoint.resume=false", "checkpoint.every_steps=0", "checkpoint.keep=1", "data.num_workers=0",
                   "trainer.max_steps=100000", "trainer.global_batch_size=4", *args.overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        for _ in range(args.warmup):
            timed_step(trainer, False)
        quiet: list[float] = []
        stalls: dict[str, list[float]] = {"sync": [], "async": []}
        blocked: dict[str, list[float]] = {"sync": [], "async": []}
        for _ in range(args.saves):
            for mode in ("sync", "async"):
                trainer.checkpoints.async_save = mode == "async"
                quiet += [timed_step(trainer, False)[0] for _ in range(args.after)]
                first, t_save = timed_step(trainer, True)
                window = [first] + [timed_step(trainer, False)[0] for _ in range(args.after)]
                trainer.checkpoints.wait()
                stalls[mode].append(window)
                blocked[mode].append(t_save)
        median = statistics.median(quiet)
        size = checkpoint_bytes(trainer.checkpoints.latest()) / 2**20
        trainer.close()
    print(f"policy={cfg.policy.size} precision={cfg.precision} device={trainer.device} checkpoint {size:.0f} MB, "
          f"{args.saves} saves per mode, stall counted over the save step + {args.after} steps")
    print(f"median step time (no save): {median * 1e3:.1f} ms")
    print(f"{'mode':6} {'stall ms':>10} {'stall / step':>13} {'save call blocks ms':>20}")
    ratios = {}
    for mode in ("sync", "async"):
        stall = statistics.median(sum(t - median for t in w) for w in stalls[mode])
        ratios[mode] = stall / median
        print(f"{mode:6} {stall * 1e3:10.1f} {ratios[mode]:13.2f} {statistics.median(blocked[mode]) * 1e3:20.1f}")
    print(f"async / sync stall: {ratios['async'] / ratios['sync']:.2f}")


if __name__ == "__main__":
    main()
