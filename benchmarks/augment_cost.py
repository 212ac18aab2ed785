"""What ``data.augment=openpi`` costs a data worker per sample, against what one GPU consumes.

    python benchmarks/augment_cost.py [--reps 200] [--threads 1] [--json OUT]

The augmentation runs where the sample is built (:meth:`slurmvla.data.source.LeRobotSource.sample`), in a
dataloader worker, on one thread (torch's workers run with one). Timed per sample, with the parameters
drawn from a sample generator as the source draws them:

- 3 cameras at 224 x 224 (two exterior: crop, resize, rotate, jitter; one wrist: jitter only), the size of a
  policy whose frames the data layer resizes (``policy.image_size``);
- 3 cameras at 180 x 320, DROID's recorded size, which pi0 / pi0.5 receive (they resize on the device).

Printed: the median CPU time per sample (the thread's own time: on a shared machine the wall time also
holds the waits for a core, printed beside it) and the samples/s one worker's augmentation alone allows, beside pi0.5's
~36 samples/s per GPU in training (docs/benchmarks.md); the worker also decodes, so the share of a worker's
time the augmentation takes at that rate is what decides whether it may stay in the workers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from slurmvla.data.augment import Augmenter

CAMERAS = ["observation.images.exterior_1_left", "observation.images.exterior_2_left",
           "observation.images.wrist_left"]
PI05_SAMPLES_PER_S = 36.0  # per GPU, pi0.5 training (docs/benchmarks.md)


def time_one(height: int, width: int, reps: int) -> dict:
    augmenter = Augmenter("openpi", CAMERAS, None)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (len(CAMERAS), height, width, 3), dtype=torch.uint8, generator=g)
    mask = torch.ones(len(CAMERAS), dtype=torch.bool)
    for _ in range(5):
        augmenter(images, mask, g)
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        augmenter(images, mask, g)
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    ms = 1e3 * statistics.median(cpu)
    return {"cameras": len(CAMERAS), "height": height, "width": width, "ms_per_sample": round(ms, 3),
            "wall_ms_per_sample": round(1e3 * statistics.median(times), 3),
            "samples_per_s_per_worker": round(1e3 / ms, 1),
            "worker_share_at_pi05_rate": round(PI05_SAMPLES_PER_S * ms / 1e3, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a dataloader worker runs one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [time_one(224, 224, args.reps), time_one(180, 320, args.reps)]
    for r in rows:
        print(f"{r['cameras']} cameras {r['height']}x{r['width']}: {r['ms_per_sample']:.2f} ms CPU per sample "
              f"({r['wall_ms_per_sample']:.2f} ms wall), "
              f"{r['samples_per_s_per_worker']:.0f} samples/s per worker; at pi0.5's {PI05_SAMPLES_PER_S:.0f} "
              f"samples/s per GPU: {100 * r['worker_share_at_pi05_rate']:.0f} % of one worker")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
