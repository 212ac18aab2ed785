"""Is resuming bound by the disk? A checkpoint's load (weights, optimizer state, trainer and RNG state, as
``--resume`` loads it) against reading the same files' bytes, from the disk and from the page cache.

    python benchmarks/checkpoint_load.py [--repeats 3] [HYDRA_OVERRIDES ...]        # policy=small on the CPU
    python benchmarks/checkpoint_load.py policy=pi05 precision=bf16                  # on a GPU

One Trainer takes a step and saves; then, ``--repeats`` times each: the checkpoint's files are dropped
from the page cache (``posix_fadvise(DONTNEED)``: the next read comes from the disk), and either read
whole (16 MiB reads) or loaded by the trainer's own resume path (``CheckpointManager.load`` into the
live engine; on a GPU synchronised at the end); then both again from the page cache. Printed: the
checkpoint's size, the median seconds and GB/s of each, and load / read: 1.0 is a load bound by the
disk, more is time spent beyond reading (deserialising, copying, moving to the device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slurmvla.compose import compose
from slurmvla.trainer import Trainer

CHUNK = 16 * 2**20


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def drop_cache(files: list[Path]) -> None:
    """The files' pages out of the page cache (written back first), so the next read goes to the disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(files: list[Path]) -> int:
    n = 0
    buf = bytearray(CHUNK)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while got := fh.readinto(buf):
                n += got
    return n


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["policy=small", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
                   "checkpoint.resume=false", "checkpoint.every_steps=0", "checkpoint.keep=1", "data.num_workers=0",
                   "trainer.global_batch_size=4", *args.overrides])
    # Beside the working directory (a disk), not in a tmpfs /tmp whose pages cannot leave memory.
    with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".checkpoint_load-") as run_dir:
        trainer = Trainer(cfg, run_dir)
        trainer.run_step()
        path = trainer.save()
        trainer.checkpoints.wait()
        files = files_of(path)
        size = sum(f.stat().st_size for f in files)
        cuda = trainer.device.type == "cuda"

        def load() -> None:
            trainer.checkpoints.load(path)
            if cuda:
                torch.cuda.synchronize(trainer.device)

        times: dict[str, list[float]] = {"read, disk": [], "load, disk": [], "read, cached": [], "load, cached": []}
        for _ in range(args.repeats):
            for what, fn in (("read", lambda: read_all(files)), ("load", load)):
                drop_cache(files)
                times[f"{what}, disk"].append(timed(fn))
                times[f"{what}, cached"].append(timed(fn))
        trainer.close()
    print(f"policy={cfg.policy.size} engine={cfg.engine.name} precision={cfg.precision} device={trainer.device}: "
          f"checkpoint {size / 2**20:.0f} MiB in {len(files)} files; median of {args.repeats}")
    med = {k: statistics.median(v) for k, v in times.items()}
    print("  every run (s): " + "; ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in times.items()))
    for k, s in med.items():
        print(f"  {k:13s} {s:8.3f} s  {size / s / 1e9:6.2f} GB/s")
    print(f"load / read: from the disk {med['load, disk'] / med['read, disk']:.2f}, from the page cache "
          f"{med['load, cached'] / med['read, cached']:.2f} (1.0: the load is bound by reading its bytes)")


if __name__ == "__main__":
    main()
