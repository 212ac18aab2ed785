"""Loader throughput on DROID-format data with real video at DROID's 180x320.

    python benchmarks/data_stream.py [--episodes 32 --workers 2 --image-size 224 --random-samples 400]

Three readers of the same videos, each in a DataLoader with the same number of worker processes
(except the ceiling, which is one process):

- (a) the episode-shuffle stream (``data.loader=stream``), one epoch;
- (b) per-sample random access, as a map-style LeRobot loader with a random sampler does it: each
  sample seeks to the keyframe before its timestamp and decodes forward to its frame, per camera;
- (c) the ceiling: every video decoded sequentially by PyAV alone (same resize), one process.

Frames are camera images (3 per sample). Prints frames/s per worker and in total, the ratios
stream / random and stream / ceiling (per worker), and the peak resident memory per worker.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import av
import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from slurmvla.config import DataConfig, PolicyConfig
from slurmvla.data.loader import TrainData
from slurmvla.data.mixture import Mixture
from slurmvla.data.synthetic import write_droid_sample
from slurmvla.data.video import decode_range
from slurmvla.policy import sample_spec


class RandomAccess(Dataset):
    """One sample = one seek + forward decode per camera, with no episode cache. Columns are read
    up front (as a memory-mapped Arrow table would serve them), so only video access is timed."""

    def __init__(self, mixture: Mixture):
        self.source = mixture.sources[0]
        self.state = [self.source.meta.read_episode(e, ["observation.state"])["observation.state"]
                      for e in range(self.source.meta.num_episodes)]
        index = self.source.train_index
        eps = np.repeat(index.episodes, index.ep_count[index.episodes])
        k = np.arange(len(eps)) - np.repeat(np.cumsum(index.ep_count[index.episodes]) - index.ep_count[index.episodes],
                                            index.ep_count[index.episodes])
        self.rows = np.stack([eps, index.frames_of(eps, k)], axis=1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        e, t = (int(v) for v in self.rows[i])
        s = self.source
        images = []
        for cam in s.cameras:
            loc = s.videos[cam]
            ts = float(loc.from_ts[e]) + t / s.meta.fps
            images.append(decode_range(loc.paths[e], ts, ts + 1 / s.meta.fps, s.meta.fps, s.image_size)[0])
        return {"images": torch.from_numpy(np.stack(images)), "state": torch.from_numpy(self.state[e][t])}


class WorkerMemory:
    """Peak RSS of the loader's worker processes, sampled every 200 ms."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        me = psutil.Process()
        while not self._stop.is_set():
            for child in me.children(recursive=True):
                try:
                    self.peak[child.pid] = max(self.peak.get(child.pid, 0), child.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def worst_mib(self) -> float:
        return max(self.peak.values(), default=0) / 2**20


def timed(loader, limit: int | None = None) -> tuple[int, float, float]:
    with WorkerMemory() as mem:
        it = iter(loader)
        first = next(it)  # worker start-up is not throughput
        t0 = time.perf_counter()
        n = 0
        for batch in it:
            n += len(batch["images"])
            if limit is not None and n >= limit:
                break
        seconds = time.perf_counter() - t0
    del first
    return n, seconds, mem.worst_mib()


def ceiling(mixture: Mixture, image_size: int) -> tuple[int, float]:
    source = mixture.sources[0]
    paths = sorted({p for cam in source.cameras for p in source.videos[cam].paths})
    t0 = time.perf_counter()
    n = 0
    for path in paths:
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            stream.thread_type = "AUTO"
            for frame in c.decode(stream):
                frame.to_ndarray(format="rgb24", width=image_size, height=image_size)
                n += 1
    return n, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--random-samples", type=int, default=400, help="samples timed for random access (it is slow)")
    parser.add_argument("--gop", type=int, default=15, help="keyframe interval of the written videos (frames)")
    parser.add_argument("--data", type=Path, default=None, help="an existing DROID-format dataset to read instead")
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or write_droid_sample(Path(tmp) / "droid", args.episodes, seed=0, episodes_per_file=8,
                                               max_length=120, gop=args.gop)
        cfg = DataConfig(root=str(root), num_workers=args.workers, interleave_episodes=8)
        spec = sample_spec(PolicyConfig(image_size=args.image_size, action_horizon=16, max_text_len=48))
        mixture = Mixture(cfg, spec, seed=0)
        cams = len(mixture.sources[0].cameras)
        w = max(1, args.workers)

        data = TrainData(mixture, cfg, args.batch_size, 0, 1, seed=0)
        s_n, s_t, s_mem = timed(data.iterate(0, 0))
        random_loader = DataLoader(RandomAccess(mixture), batch_size=args.batch_size, num_workers=args.workers,
                                   sampler=RandomSampler(range(mixture.samples_per_epoch),
                                                         generator=torch.Generator().manual_seed(0)))
        r_n, r_t, r_mem = timed(random_loader, limit=args.random_samples)
        c_n, c_t = ceiling(mixture, args.image_size)

    stream_total, random_total, ceiling_rate = s_n * cams / s_t, r_n * cams / r_t, c_n / c_t
    print(f"data: {mixture.sources[0].meta.num_episodes} episodes, {mixture.samples_per_epoch} samples, {cams} cameras "
          f"at 180x320 (h264, GOP {args.gop}) -> {args.image_size}x{args.image_size}; {args.workers} workers, "
          f"batch {args.batch_size}")
    print(f"{'reader':28s} {'frames/s total':>15s} {'per worker':>11s} {'peak RSS/worker MiB':>20s}")
    print(f"{'(a) stream':28s} {stream_total:15.0f} {stream_total / w:11.0f} {s_mem:20.0f}")
    print(f"{'(b) random access':28s} {random_total:15.0f} {random_total / w:11.0f} {r_mem:20.0f}")
    print(f"{'(c) decoder alone (ceiling)':28s} {ceiling_rate:15.0f} {ceiling_rate:11.0f} {'-':>20s}")
    print(f"stream / random access: {stream_total / random_total:.1f}x   (goal >= 10x)")
    print(f"stream / ceiling, per worker: {stream_total / w / ceiling_rate:.2f}   (goal >= 0.8)")


if __name__ == "__main__":
    main()
