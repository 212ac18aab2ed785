"""What ``data.augment=openpi`` costs a data worker per sample, against what one GPU consumes.

    python benchmarks/augment_cost.py [--reps 200] [--threads 1] [--loader-samples 240] [--json OUT]

The augmentation runs where the sample is built (:meth:`slurmvla.data.source.LeRobotSource.sample`), in a
dataloader worker, on one thread (torch's workers run with one). Timed per sample, with the parameters
drawn from a sample generator as the source draws them:

- 3 cameras at 224 x 224 (two exterior: crop, resize, rotate, jitter; one wrist: jitter only), the size of a
  policy whose frames the data layer resizes (``policy.image_size``);
- 3 cameras at 180 x 320, DROID's recorded size, which pi0 / pi0.5 receive (they resize on the device).

- (with ``--loader-samples`` > 0) the stream's whole per-sample work in one process, decoding included, with
  ``data.augment`` none and openpi: DROID's encoding (AV1, 180 x 320, 3 cameras) written to a temporary folder,
  frames resized with padding to 224 (a FlowVLA spec), CPU time of the process (decoding runs on a thread per
  camera) per sample.

Printed: the median CPU time per sample (the thread's own time: on a shared machine the wall time also
holds the waits for a core, printed beside it) and the samples/s one worker's augmentation alone allows, beside pi0.5's
~36 samples/s per GPU in training (docs/benchmarks.md); the worker also decodes, so the share of a worker's
time the augmentation takes at that rate is what decides whether it may stay in the workers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slurmvla.config.data import DataConfig
from slurmvla.data.augment import Augmenter
from slurmvla.data.datasets import EpisodeStream
from slurmvla.data.mixture import Mixture
from slurmvla.data.synthetic import write_droid_sample
from slurmvla.policy import sample_spec
from slurmvla.policy.flow_vla.config import FlowVLAConfig

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


def loader_cost(samples: int) -> dict:
    """CPU ms per sample of the stream (decode, resize, cut, and the augmentation when on), one process."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = write_droid_sample(Path(tmp) / "droid", num_episodes=4, seed=0, episodes_per_file=4, length=samples // 4 + 8)
        spec = sample_spec(FlowVLAConfig(image_size=224, patch_size=16, action_horizon=16, max_text_len=48))
        for augment in ("none", "openpi"):
            cfg = DataConfig(root=str(root), num_workers=0, stream_cache_episodes=0, augment=augment)
            stream = EpisodeStream(Mixture(cfg, spec, seed=0), 1, 0, 1, 0)
            stream.set_position(0, 0)
            it = iter(stream)
            for _ in range(8):
                next(it)
            c0, n = time.process_time(), 0
            for _ in range(samples):
                next(it)
                n += 1
            out[augment] = round(1e3 * (time.process_time() - c0) / n, 3)
    return {"ms_per_sample": out, "samples": samples,
            "samples_per_s_per_worker": {k: round(1e3 / v, 1) for k, v in out.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a dataloader worker runs one)")
    parser.add_argument("--loader-samples", type=int, default=240, help="samples the stream is timed over (0: skip)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [time_one(224, 224, args.reps), time_one(180, 320, args.reps)]
    for r in rows:
        print(f"{r['cameras']} cameras {r['height']}x{r['width']}: {r['ms_per_sample']:.2f} ms CPU per sample "
              f"({r['wall_ms_per_sample']:.2f} ms wall), "
              f"{r['samples_per_s_per_worker']:.0f} samples/s per worker; at pi0.5's {PI05_SAMPLES_PER_S:.0f} "
              f"samples/s per GPU: {100 * r['worker_share_at_pi05_rate']:.0f} % of one worker")
    loader = loader_cost(args.loader_samples) if args.loader_samples > 0 else None
    if loader:
        ms, rate = loader["ms_per_sample"], loader["samples_per_s_per_worker"]
        print(f"the stream, one process, 3 cameras decoded and padded to 224: {ms['none']:.2f} ms CPU per sample "
              f"({rate['none']:.0f} samples/s) without augmentation, {ms['openpi']:.2f} ms ({rate['openpi']:.0f} "
              f"samples/s) with data.augment=openpi")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows, "loader": loader}, f, indent=1)


if __name__ == "__main__":
    main()
