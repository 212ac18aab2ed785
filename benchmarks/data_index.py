"""Index building at DROID's size: time and memory, no video needed.

    python benchmarks/data_index.py [--episodes 95600 --frames 27600000]

Builds a synthetic keep-ranges file (``keep_ranges_1_0_1.json``'s format: ~92% of the episodes,
one to three ranges each, ~80% of the frames kept) and an ``episode_id_to_path.json`` mapping for that many episodes, then
times each stage a training start goes through: reading both files, turning episode ids into
keys, building the sample index, planning an epoch, and computing one stream shard's order
(64 ranks x 8 workers). Memory is the peak traced Python allocation of each stage and the size
of the index arrays kept.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from slurmvla.data.index import build_index, keep_range_keys
from slurmvla.data.keep_ranges import episode_key, load_keep_ranges


def synthetic_droid(num_episodes: int, num_frames: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=np.log(num_frames / num_episodes) - 0.08, sigma=0.4, size=num_episodes)
    lengths = np.maximum(8, np.round(lengths * num_frames / lengths.sum())).astype(np.int64)
    ids = [f"LAB{e % 13}+{e:08x}+2023-10-{1 + e % 28:02d}-{e % 24:02d}h-{e % 60:02d}m-00s" for e in range(num_episodes)]
    rel = {i: f"LAB{e % 13}/success/2023-10-{1 + e % 28:02d}/run{e:06d}" for e, i in enumerate(ids)}
    keep = {}
    for e, n in enumerate(lengths.tolist()):
        if rng.random() < 0.08:
            continue
        # Idle start and end cut, and up to two idle gaps inside: about 80% of the frames kept.
        k = int(rng.integers(1, 4))
        edges = np.linspace(int(0.05 * n), int(0.95 * n), k + 1).astype(int)
        gap = max(1, int(0.03 * n))
        keep[episode_key(rel[ids[e]])] = [[int(a), int(b) - (gap if i < k - 1 else 0)]
                                          for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])) if b - a > gap]
    return lengths, ids, rel, keep


def stage(name: str, fn, results: dict):
    """Seconds of one plain run, then the peak traced allocation of a second (tracing slows Python down)."""
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    del out
    tracemalloc.start()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    results[name] = (seconds, peak / 2**20)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=95_600)
    parser.add_argument("--frames", type=int, default=27_600_000)
    parser.add_argument("--horizon", type=int, default=16)
    args = parser.parse_args()

    from slurmvla.config.data import DataConfig
    from slurmvla.data.datasets import EpisodeStream
    from slurmvla.data.mixture import Mixture

    lengths, ids, rel, keep = synthetic_droid(args.episodes, args.frames)
    with tempfile.TemporaryDirectory() as tmp:
        keep_path, map_path = Path(tmp) / "keep_ranges_1_0_1.json", Path(tmp) / "episode_id_to_path.json"
        keep_path.write_text(json.dumps(keep))
        map_path.write_text(json.dumps(rel))
        sizes = keep_path.stat().st_size / 2**20, map_path.stat().st_size / 2**20
        del keep, rel
        results: dict[str, tuple[float, float]] = {}
        ranges = stage("read keep-ranges file", lambda: load_keep_ranges(keep_path), results)
        mapping = stage("read id->path mapping", lambda: json.loads(map_path.read_text()), results)
        keys = stage("episode ids -> keys", lambda: keep_range_keys(ids, mapping), results)
        index = stage("build sample index", lambda: build_index(lengths, None, keys, ranges, args.horizon, "frame"), results)

        # The plan and a shard's order, through the real Mixture / EpisodeStream code on this index
        # (a Mixture without its reader: only the index, the weights and the quota are used).
        mixture = Mixture.__new__(Mixture)
        mixture.cfg, mixture.seed = DataConfig(interleave_episodes=8), 0
        mixture.sources = [SimpleNamespace(train_index=index, name="droid")]
        mixture.weights, mixture.quota = np.ones(1), np.asarray([index.num_samples])
        plan = stage("plan one epoch", lambda: mixture.plan(0), results)
        stream = EpisodeStream(mixture, batch_size=32, rank=17, world_size=64, num_workers=8)
        stage("one shard's order (64 ranks x 8 workers)", lambda: stream.shard_order(0, 17 * 8 + 3), results)

    print(f"synthetic DROID: {args.episodes} episodes, {int(lengths.sum())} frames; keep-ranges file {sizes[0]:.1f} MiB, "
          f"mapping {sizes[1]:.1f} MiB")
    print(f"kept: {index.counts['episodes_kept']} episodes, {index.num_samples} samples in {len(index.seg_ep)} segments; "
          f"plan: {len(plan.count)} pieces")
    print(f"{'stage':45s} {'seconds':>8s} {'peak MiB':>9s}")
    for name, (seconds, peak) in results.items():
        print(f"{name:45s} {seconds:8.2f} {peak:9.1f}")
    total = sum(s for s, _ in results.values())
    print(f"{'total':45s} {total:8.2f}")
    print(f"index arrays kept: {index.nbytes() / 2**20:.1f} MiB ({index.nbytes() / index.num_samples:.2f} bytes per sample)")


if __name__ == "__main__":
    main()
