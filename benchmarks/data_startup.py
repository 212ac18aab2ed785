"""Start-up of the data layer at DROID's size, in both LeRobot layouts, with and without filters.

    python benchmarks/data_startup.py [--episodes 95600 --frames 27600000]

Generates metadata and parquet (no video: start-up opens none) for a copy of DROID's size in the
v3.0 layout (many episodes per file) and the v2.1 layout (one parquet per episode), plus a
keep-ranges file and its episode-id mapping, then times what every rank does before its first
batch: reading the metadata, the filters, the index, the split and one epoch's plan (``Mixture``).

``success_only`` needs a per-episode flag that lives in the frame data. Three cases are timed:
per-episode stats present (LeRobot's writers keep min / max per episode; no data read), no stats
and a cold cache (the first process of the first job reads the data files once), and no stats
with the cache warm (every other rank, and every later job).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from data_index import synthetic_droid  # noqa: E402

from slurmvla.config.data import DataConfig, KeepRangesConfig  # noqa: E402
from slurmvla.data.mixture import Mixture  # noqa: E402
from slurmvla.droid_features import DROID_CAMERAS  # noqa: E402
from slurmvla.policy import sample_spec  # noqa: E402
from slurmvla.policy.flow_vla.config import FlowVLAConfig  # noqa: E402

FPS = 15


def features() -> dict:
    vec = {"dtype": "float32", "shape": [8], "names": None}
    out = {cam: {"dtype": "video", "shape": [180, 320, 3]} for cam in DROID_CAMERAS}
    out.update({"observation.state": vec, "action": vec, "language_instruction": {"dtype": "string", "shape": [1]},
                "is_episode_successful": {"dtype": "bool", "shape": [1]}, "index": {"dtype": "int64", "shape": [1]},
                "episode_index": {"dtype": "int64", "shape": [1]}, "frame_index": {"dtype": "int64", "shape": [1]}})
    return out


def write_v3(root: Path, lengths: np.ndarray, ids: list[str], success: np.ndarray, per_file: int = 1000) -> None:
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    n = len(lengths)
    file_of = np.arange(n) // per_file
    cols = {"episode_index": np.arange(n), "length": lengths, "dataset_from_index": starts, "dataset_to_index": ends,
            "data/chunk_index": file_of // 1000, "data/file_index": file_of % 1000, "episode_id": ids,
            "meta/episodes/chunk_index": np.zeros(n, np.int64), "meta/episodes/file_index": np.zeros(n, np.int64)}
    for cam in DROID_CAMERAS:
        local = starts - starts[file_of * per_file]
        cols.update({f"videos/{cam}/chunk_index": file_of // 1000, f"videos/{cam}/file_index": file_of % 1000,
                     f"videos/{cam}/from_timestamp": local / FPS, f"videos/{cam}/to_timestamp": (local + lengths) / FPS})
    table = pa.table(cols)
    pq.write_table(table, root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    flag = pa.array([[float(s)] for s in success])
    with_flag = table.append_column("stats/is_episode_successful/min", flag).append_column(
        "stats/is_episode_successful/max", flag)
    pq.write_table(with_flag, root / "stats_episodes.parquet")
    for f in range(int(file_of.max()) + 1):
        eps = np.arange(f * per_file, min(n, (f + 1) * per_file))
        lo, hi = int(starts[eps[0]]), int(ends[eps[-1]])
        path = root / f"data/chunk-{f // 1000:03d}/file-{f % 1000:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"index": np.arange(lo, hi), "episode_index": np.repeat(eps, lengths[eps]),
                                 "is_episode_successful": np.repeat(success[eps], lengths[eps])}), path)
    info = {"codebase_version": "v3.0", "fps": FPS, "total_episodes": n, "total_frames": int(ends[-1]),
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", "features": features()}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    write_common(root)


def write_v2(root: Path, lengths: np.ndarray, ids: list[str], success: np.ndarray) -> None:
    (root / "meta").mkdir(parents=True)
    n = len(lengths)
    with open(root / "meta" / "episodes.jsonl", "w") as f:
        for e in range(n):
            f.write(json.dumps({"episode_index": e, "length": int(lengths[e]), "episode_id": ids[e]}) + "\n")
    start = 0
    for e in range(n):
        path = root / f"data/chunk-{e // 1000:03d}/episode_{e:06d}.parquet"
        if e % 1000 == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        m = int(lengths[e])
        pq.write_table(pa.table({"index": np.arange(start, start + m), "frame_index": np.arange(m),
                                 "is_episode_successful": np.full(m, bool(success[e]))}), path)
        start += m
    info = {"codebase_version": "v2.1", "fps": FPS, "chunks_size": 1000, "total_episodes": n, "total_frames": start,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": features()}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    with open(root / "stats_lines.jsonl", "w") as f:
        for e in range(n):
            f.write(json.dumps({"episode_index": e, "stats": {"is_episode_successful": {
                "min": [float(success[e])], "max": [float(success[e])], "mean": [float(success[e])], "std": [0.0],
                "count": [int(lengths[e])]}}}) + "\n")
    write_common(root)


def write_common(root: Path) -> None:
    stat = {"mean": [0.0] * 8, "std": [1.0] * 8, "min": [-1.0] * 8, "max": [1.0] * 8, "count": [1]}
    (root / "meta" / "stats.json").write_text(json.dumps({"observation.state": stat, "action": stat}))
    (root / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "do it"}) + "\n")


def with_stats(root: Path, version: str, on: bool) -> None:
    """Put the per-episode stats of is_episode_successful in (or take them out of) the metadata."""
    if version == "v3.0":
        dst = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
        table = pq.read_table(root / "stats_episodes.parquet")
        if not on:
            table = table.drop(["stats/is_episode_successful/min", "stats/is_episode_successful/max"])
        pq.write_table(table, dst)
    else:
        dst = root / "meta" / "episodes_stats.jsonl"
        if on:
            shutil.copy(root / "stats_lines.jsonl", dst)
        else:
            dst.unlink(missing_ok=True)


def start(root: Path, cache: Path, success_only: bool, keep: tuple[Path, Path] | None) -> tuple[float, Mixture]:
    kr = KeepRangesConfig(path=str(keep[0]), episode_id_to_path=str(keep[1])) if keep else KeepRangesConfig()
    cfg = DataConfig(root=str(root), cache_dir=str(cache), success_only=success_only, keep_ranges=kr,
                     val_fraction=0.01, missing_cameras="fail")
    t0 = time.perf_counter()
    mixture = Mixture(cfg, sample_spec(FlowVLAConfig(action_horizon=16)), seed=0)
    mixture.plan(0)
    return time.perf_counter() - t0, mixture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=95_600)
    parser.add_argument("--frames", type=int, default=27_600_000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the copies (default: a temporary folder)")
    args = parser.parse_args()
    lengths, ids, rel, keep = synthetic_droid(args.episodes, args.frames)
    success = np.random.default_rng(1).random(len(lengths)) < 0.8
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        keep_files = (tmp / "keep_ranges_1_0_1.json", tmp / "episode_id_to_path.json")
        keep_files[0].write_text(json.dumps(keep))
        keep_files[1].write_text(json.dumps(rel))
        print(f"DROID-size copy: {len(lengths)} episodes, {int(lengths.sum())} frames")
        print(f"{'layout':7s} {'filters':28s} {'per-episode stats':18s} {'cache':6s} {'seconds':>8s} {'samples':>10s}")
        for version, writer in (("v3.0", write_v3), ("v2.1", write_v2)):
            root = tmp / version
            t0 = time.perf_counter()
            writer(root, lengths, ids, success)
            print(f"(wrote {version} in {time.perf_counter() - t0:.0f} s)")
            cases = [("none", False, None, False, "-"), ("keep-ranges", False, keep_files, False, "-"),
                     ("success_only", True, None, True, "-"), ("success_only", True, None, False, "cold"),
                     ("success_only", True, None, False, "warm"), ("success_only + keep-ranges", True, keep_files, False, "warm")]
            cache = tmp / f"cache-{version}"
            for name, success_only, kr, stats, state in cases:
                with_stats(root, version, stats)
                if state == "cold":
                    shutil.rmtree(cache, ignore_errors=True)
                seconds, mixture = start(root, cache, success_only, kr)
                print(f"{version:7s} {name:28s} {'yes' if stats else 'no':18s} {state:6s} {seconds:8.2f} "
                      f"{mixture.sources[0].index.num_samples:10d}")


if __name__ == "__main__":
    main()
