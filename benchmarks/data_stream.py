"""Loader throughput and worker memory on DROID-format data in DROID's encoding and resolution.

    python benchmarks/data_stream.py [--episodes 12 --length 290 --workers 2 --image-size 224]
    python benchmarks/data_stream.py --codec h264 --gop 15        # the older H.264 sample encoding

The data is written as LeRobot's DROID port stores it (AV1 through SVT-AV1, GOP 2, CRF 30, 180x320,
several episodes per video file), every episode ``--length`` frames (DROID's mean is ~290: 27.6M
frames over 95.6k episodes); images are resized with padding to ``--image-size`` (data.image_resize=pad).
Readers of the same videos, each in a DataLoader with the same number of worker processes (except
the ceiling, which is one process):

- (a) the episode-shuffle stream (``data.loader=stream``), one epoch: windowed pieces (frames decoded
  forward a block at a time, the three cameras in parallel threads, dropped once passed);
- the same stream holding whole decoded pieces (how it worked before the window), for memory only;
- (b) per-sample random access, as a map-style LeRobot loader with a random sampler does it: each
  sample opens the shared video file, seeks to the keyframe before its timestamp and decodes forward
  to its frame, per camera;
- (c) the ceiling: every video decoded sequentially by PyAV alone (same resize), one process.

Frames are camera images (3 per sample). Prints frames/s per worker and in total, the ratios
stream / random and stream / ceiling (per worker), peak resident memory per worker at ``--length``
and at ``--long`` (10x) frames per episode, samples/s per CPU core, and the dataloader workers one
GPU would need at an assumed training step (``--gpu-step-s``, ``--gpu-micro-batch``).
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

from slurmvla.config.data import DataConfig
from slurmvla.data.datasets import EpisodeStream
from slurmvla.data.mixture import Mixture
from slurmvla.data.prepare import resize_frame
from slurmvla.data.synthetic import CODECS, write_droid_sample
from slurmvla.data.video import decode_range
from slurmvla.policy import sample_spec
from slurmvla.policy.flow_vla.config import FlowVLAConfig


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
            images.append(decode_range(loc.paths[e], ts, ts + 1 / s.meta.fps, s.meta.fps, s.sample_spec.image_size,
                                       resize=s.cfg.image_resize)[0])
        return {"images": torch.from_numpy(np.stack(images)), "state": torch.from_numpy(self.state[e][t])}


class WorkerMemory:
    """Peak RSS of the loader's worker processes, sampled every 50 ms."""

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
            time.sleep(0.05)

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
                resize_frame(frame, image_size, "pad")
                n += 1
    return n, time.perf_counter() - t0


class WholePieces(EpisodeStream):
    """The stream as it was before windows: each open piece decoded whole, up front."""

    def _open(self, dataset: int, episode: int, first: int, last: int):
        return self.mixture.sources[dataset].load_episode(episode, first, last)


def stream_loader(stream_cls, mixture: Mixture, batch_size: int, workers: int) -> DataLoader:
    stream = stream_cls(mixture, batch_size, 0, 1, workers)
    stream.set_position(0, 0)
    return DataLoader(stream, batch_size=batch_size, num_workers=workers, prefetch_factor=4 if workers else None)


def build(root: Path, args, workers: int) -> Mixture:
    cfg = DataConfig(root=str(root), num_workers=workers, interleave_episodes=args.interleave, stream_cache_episodes=0)
    spec = sample_spec(FlowVLAConfig(image_size=args.image_size, patch_size=16, action_horizon=16, max_text_len=48))
    return Mixture(cfg, spec, seed=0)


def write(tmp: Path, name: str, args, length: int) -> Path:
    return write_droid_sample(tmp / name, args.episodes, seed=0, episodes_per_file=4, codec=args.codec, gop=args.gop,
                              length=length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=12)
    parser.add_argument("--length", type=int, default=290, help="frames per episode (DROID's mean: ~290)")
    parser.add_argument("--long", type=int, default=None, help="the long-episode memory run (default 10x --length; 0 skips)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--interleave", type=int, default=8, help="data.interleave_episodes")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--random-samples", type=int, default=300, help="samples timed for random access (it is slow)")
    parser.add_argument("--codec", choices=CODECS, default="av1")
    parser.add_argument("--gop", type=int, default=None, help="keyframe interval (default: 2 for av1, 15 for h264)")
    parser.add_argument("--gpu-step-s", type=float, default=0.5,
                        help="ASSUMED seconds per training step of one GPU (not measured here)")
    parser.add_argument("--gpu-micro-batch", type=int, default=32, help="ASSUMED samples per GPU per step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = max(1, args.workers)
    long = args.length * 10 if args.long is None else args.long

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        mixture = build(write(tmp, "droid", args, args.length), args, args.workers)
        cams = len(mixture.sources[0].cameras)
        s_n, s_t, s_mem = timed(stream_loader(EpisodeStream, mixture, args.batch_size, args.workers))
        random_loader = DataLoader(RandomAccess(mixture), batch_size=args.batch_size, num_workers=args.workers,
                                   sampler=RandomSampler(range(mixture.samples_per_epoch),
                                                         generator=torch.Generator().manual_seed(0)))
        r_n, r_t, r_mem = timed(random_loader, limit=args.random_samples)
        c_n, c_t = ceiling(mixture, args.image_size)
        # Memory at DROID's mean episode length and at 10x: 4 episodes, 2 open pieces per worker.
        memory = {}
        for length in [args.length] + ([long] if long else []):
            mem_args = argparse.Namespace(**{**vars(args), "episodes": 4, "interleave": 2})
            m = build(write(tmp, f"droid_{length}", mem_args, length), mem_args, args.workers)
            memory[length] = [timed(stream_loader(cls, m, args.batch_size, args.workers), limit=length)[2]
                              for cls in (EpisodeStream, WholePieces)]
    stream_total, random_total, ceiling_rate = s_n * cams / s_t, r_n * cams / r_t, c_n / c_t
    gop = args.gop or {"av1": 2, "h264": 15}[args.codec]
    print(f"data: {args.episodes} episodes of {args.length} frames, {mixture.samples_per_epoch} samples, {cams} cameras "
          f"at 180x320 ({args.codec}, GOP {gop}) -> {args.image_size}x{args.image_size} (pad); {args.workers} workers, "
          f"batch {args.batch_size}, interleave {args.interleave}")
    print(f"{'reader':34s} {'frames/s total':>15s} {'per worker':>11s} {'peak RSS/worker MiB':>20s}")
    print(f"{'(a) stream, windowed pieces':34s} {stream_total:15.0f} {stream_total / w:11.0f} {s_mem:20.0f}")
    print(f"{'(b) random access':34s} {random_total:15.0f} {random_total / w:11.0f} {r_mem:20.0f}")
    print(f"{'(c) decoder alone (ceiling)':34s} {ceiling_rate:15.0f} {ceiling_rate:11.0f} {'-':>20s}")
    print(f"stream / random access, per worker: {stream_total / random_total:.1f}x")
    print(f"stream / ceiling, per worker: {stream_total / w / ceiling_rate:.2f}   (goal >= 0.8)")
    print("peak RSS per worker (MiB), 4 episodes, 2 open pieces per worker:")
    for length, (windowed, whole) in memory.items():
        print(f"  episodes of {length:5d} frames: windowed pieces {windowed:7.0f}   whole pieces (before) {whole:7.0f}")
    cores = min(w, psutil.cpu_count() or 1)
    per_core = s_n / s_t / cores
    need = args.gpu_micro_batch / args.gpu_step_s
    print(f"samples/s per CPU core (stream, {cores} cores busy): {per_core:.0f}")
    print(f"workers per GPU at an ASSUMED {args.gpu_step_s} s step of {args.gpu_micro_batch} samples ({need:.0f} samples/s): "
          f"{need / (s_n / s_t / w):.1f}")


if __name__ == "__main__":
    main()
