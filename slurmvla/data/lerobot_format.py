"""LeRobot-format metadata and per-episode reads, for codebase versions v3.0 and v2.1.

- v3.0: many episodes per parquet and per mp4 file. Episode boundaries come from
  ``meta/episodes/**.parquet`` (``dataset_from_index`` / ``dataset_to_index``, and per camera
  ``videos/<key>/from_timestamp`` / ``to_timestamp``); stats from ``meta/stats.json``.
- v2.1: one parquet and one mp4 per episode, ``meta/episodes.jsonl``, ``meta/tasks.jsonl``, stats
  from ``meta/stats.json`` or aggregated from ``meta/episodes_stats.jsonl``.

Both are read into one in-memory shape: arrays per episode (never per frame), so the metadata of
DROID's ~95k episodes costs megabytes. Frame columns are read one episode at a time. Everything a
caller can get wrong raises ``ValueError`` naming the path, the value and what would have been valid.
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from slurmvla.data import DataError
from slurmvla.data.checksums import require_listed, verify
from slurmvla.data.keep_ranges import read_json

SUPPORTED_VERSIONS = ("v2.1", "v3.0")
IMAGE_DTYPES = ("image",)  # a camera whose frames are encoded images in the data files' column
CAMERA_DTYPES = ("video", *IMAGE_DTYPES)


def _system_pool_in_child() -> None:
    """In a forked child (a data-loader worker), Arrow allocates through the C library's malloc instead of
    its default pool (mimalloc). The child's mimalloc carries on in the segments it inherited from the
    parent, and its first episode read copied about 1.7 MiB more of the parent's pages into the worker's
    private memory (docs/benchmarks.md, the loader's memory); a worker's reads (one episode's columns) are small."""
    pa.set_memory_pool(pa.system_memory_pool())


os.register_at_fork(after_in_child=_system_pool_in_child)


@dataclass(frozen=True)
class VideoLocation:
    """Where each episode's frames of one camera live: file path and time range."""

    paths: list[Path]  # one per episode
    from_ts: np.ndarray  # float64 [num_episodes]
    to_ts: np.ndarray


def to_numpy(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Vectors as ``[n, dim]`` float32 (or their integer dtype), strings as object arrays, scalars as-is;
    an image column (``datasets``' ``Image()``: ``struct<bytes, path>``, or plain binary) as an object array
    of each frame's encoded bytes (None where a frame has none)."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if pa.types.is_struct(col.type) and col.type.get_field_index("bytes") >= 0:
        col = col.field("bytes")
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        return np.asarray(col.to_pylist(), dtype=object)
    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
        flat = np.asarray(col.flatten())
        return flat.reshape(len(col), -1).astype(np.float32 if flat.dtype.kind == "f" else flat.dtype)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return np.asarray(col.to_pylist(), dtype=object)
    return np.asarray(col)


def _read_jsonl(path: Path) -> list[dict]:
    """One JSON object per line (v2.1's meta/*.jsonl); a line that is not one fails naming the file and line."""
    with reading(path, "a JSON-lines file"):
        text = path.read_bytes().decode("utf-8", errors="replace")
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {number} is not JSON ({e.msg} at column {e.colno}); expected one JSON "
                            "object per line (LeRobot v2.1's meta/*.jsonl)") from None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


@contextlib.contextmanager
def reading(path: Path, what: str = "parquet"):
    """A file the dataset names that is missing or cannot be read fails as a DataError naming it (pyarrow's and
    the OS's own errors say neither the file nor, often, which dataset). A file of a dataset with checksums is
    checked against them first (:func:`slurmvla.data.checksums.verify`)."""
    try:
        verify(path)
        yield
    except FileNotFoundError:
        raise DataError(f"{path} does not exist, but the dataset's metadata names it (an incomplete copy?)",
                        path) from None
    except IsADirectoryError:
        raise DataError(f"{path} is a directory, but the dataset needs it to be a file ({what})", path) from None
    except (OSError, pa.ArrowException) as e:
        reason = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        reason = reason.replace(f"Could not open Parquet input source '{path}': ", "")  # the path, said once
        raise DataError(f"{path} cannot be read as {what} ({reason}); the file is damaged or incomplete",
                        path) from None


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    with reading(path):
        return pq.read_table(path, columns=columns)


def read_schema(path: Path) -> pa.Schema:
    with reading(path):
        return pq.read_schema(path)



def read_rows(path: Path, keys: list[str], where: tuple[str, int, int] | None = None) -> dict[str, np.ndarray]:
    """Columns ``keys`` of a parquet file as numpy arrays; with ``where=(column, lo, hi)`` only the rows
    with ``lo <= column < hi``, reading only the row groups whose statistics overlap that range.

    Read through ``ParquetFile`` on the calling thread (``use_threads=False``), never through Arrow's
    dataset scanner: data-loader workers are forked from a process that has used Arrow's thread
    pools, and a scanner in the child can wait forever on a pool that did not survive the fork."""
    with reading(path):
        return _read_rows(pq.ParquetFile(path), keys, where)


def _read_rows(f: pq.ParquetFile, keys: list[str], where: tuple[str, int, int] | None) -> dict[str, np.ndarray]:
    keys = list(dict.fromkeys(keys))
    groups = list(range(f.num_row_groups))
    if where is not None:
        name, lo, hi = where
        # The statistics are per leaf column: an image column (struct<bytes, path>) before it holds two.
        col = next(i for i in range(len(f.schema)) if f.schema.column(i).path == name)

        def overlaps(g: int) -> bool:
            stats = f.metadata.row_group(g).column(col).statistics
            return stats is None or not stats.has_min_max or (stats.max >= lo and stats.min < hi)

        groups = [g for g in groups if overlaps(g)]
    table = f.read_row_groups(groups, columns=keys, use_threads=False)
    out = {k: to_numpy(table[k]) for k in keys}
    if where is not None:
        keep = (out[name] >= lo) & (out[name] < hi)
        out = {k: v[keep] for k, v in out.items()}
    return out


class LeRobotMetadata:
    """Metadata of one LeRobot dataset plus per-episode column access."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        info_path = self.root / "meta" / "info.json"
        if not self.root.is_dir():
            raise ValueError(f"data root {str(self.root)!r} does not exist or is not a directory")
        require_listed(self.root)  # metadata files are globbed: one missing would lose its episodes unsaid
        if not info_path.is_file():
            raise ValueError(
                f"data root {str(self.root)!r} is not a LeRobot dataset: it has no meta/info.json "
                "(expected meta/info.json, meta/episodes/ or meta/episodes.jsonl, data/ and videos/)"
            )
        self.info = read_json(info_path, "LeRobot's dataset description (codebase_version, fps, features, ...)")
        if not isinstance(self.info, dict):
            raise DataError(f"{info_path}: expected one JSON object (codebase_version, fps, features, ...), got a JSON "
                            f"{type(self.info).__name__}")
        version = self.info.get("codebase_version")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"{info_path}: codebase_version={version!r} is not supported; supported: {list(SUPPORTED_VERSIONS)}"
            )
        features = self.info.get("features")
        videos = isinstance(features, dict) and any(isinstance(f, dict) and f.get("dtype") == "video"
                                                    for f in features.values())
        needed = ["fps", "features", "data_path", *(["video_path"] if videos else [])]
        missing = [k for k in needed if k not in self.info] or ([] if isinstance(features, dict) else ["features"])
        if missing:
            raise DataError(f"{info_path} has no {missing[0]!r} (an object); a LeRobot {version} info.json has {needed}"
                            if missing[0] == "features" else
                            f"{info_path} has no {missing[0]!r}; a LeRobot {version} info.json has {needed}")
        self.version: str = version
        self.fps: float = float(self.info["fps"])
        self.features: dict[str, dict] = self.info["features"]
        self._episode_rows: list[dict] | None = None  # v2.1: episodes.jsonl as read
        self.episodes = self._read_episodes_v3() if version == "v3.0" else self._read_episodes_v2()
        self.tasks = self._read_tasks()
        self.stats = self._read_stats()

    # -- metadata ---------------------------------------------------------------------------------

    @property
    def num_episodes(self) -> int:
        return len(self.episodes["episode_index"])

    @property
    def num_frames(self) -> int:
        return int(self.episodes["length"].sum())

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f.get("dtype") == "video"]

    @property
    def image_keys(self) -> list[str]:
        """Cameras stored as images inside the data files (LeRobot's ``dtype: image``, e.g. lerobot/metaworld_mt50)."""
        return [k for k, f in self.features.items() if f.get("dtype") in IMAGE_DTYPES]

    @property
    def camera_keys(self) -> list[str]:
        """Every camera: stored as video or as images."""
        return [k for k, f in self.features.items() if f.get("dtype") in CAMERA_DTYPES]

    def frame_hw(self, key: str) -> tuple[int, int]:
        """``(height, width)`` of camera ``key``'s frames from its info.json shape: channels last (``[H, W, 3]``,
        LeRobot's videos and older image datasets) or first (``[3, H, W]``, e.g. lerobot/metaworld_mt50), as its
        ``names`` say (or, without them, wherever the 3 channels are)."""
        shape, names = self.features[key].get("shape"), self.features[key].get("names")
        where = f"{self.root / 'meta' / 'info.json'}: feature {key!r}"
        if not (isinstance(shape, list) and len(shape) == 3 and all(isinstance(x, int) and x > 0 for x in shape)):
            raise DataError(f"{where} has shape {shape!r}; a camera's is [height, width, channels] or "
                            "[channels, height, width]")
        names = [str(n).lower() for n in names] if isinstance(names, list) and len(names) == 3 else None
        if names is not None and names[0].startswith("channel"):
            return shape[1], shape[2]
        if names is not None and names[2].startswith("channel"):
            return shape[0], shape[1]
        if shape[0] in (1, 3, 4) and shape[2] not in (1, 3, 4):
            return shape[1], shape[2]
        return shape[0], shape[1]

    def require_features(self, keys: list[str], needed_by: str) -> None:
        missing = [k for k in keys if k not in self.features]
        if missing:
            raise ValueError(
                f"dataset {str(self.root)!r} has no feature {missing[0]!r} (needed by {needed_by}); "
                f"features it has: {sorted(self.features)}"
            )

    def feature_dim(self, key: str) -> int:
        return int(np.prod(self.features[key]["shape"]))

    def _read_episodes_v3(self) -> dict[str, np.ndarray]:
        files = sorted((self.root / "meta" / "episodes").glob("**/*.parquet"))
        if not files:
            raise ValueError(f"{self.root}: no episode metadata under meta/episodes/ (LeRobot v3.0 layout)")
        # Only numeric columns: v3.0 also stores per-episode stats and task lists there.
        table = pa.concat_tables([read_table(f) for f in files], promote_options="default")
        required = ["episode_index", "length", "dataset_from_index", "dataset_to_index",
                    "data/chunk_index", "data/file_index"]
        missing = [c for c in required if c not in table.column_names]
        if missing:
            raise ValueError(f"{self.root}: meta/episodes is missing columns {missing}; it has {table.column_names}")
        order = np.argsort(np.asarray(table["episode_index"]), kind="stable")
        episodes = {}
        for name in table.column_names:
            col = table[name]
            if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
                episodes[name] = np.asarray(col)[order]
        lengths = episodes["dataset_to_index"] - episodes["dataset_from_index"]
        if not np.array_equal(lengths, episodes["length"]):
            raise ValueError(f"{self.root}: meta/episodes length disagrees with dataset_to_index - dataset_from_index")
        return episodes

    def _read_episodes_v2(self) -> dict[str, np.ndarray]:
        path = self.root / "meta" / "episodes.jsonl"
        if not path.is_file():
            raise ValueError(f"{self.root}: no meta/episodes.jsonl (LeRobot v2.1 layout)")
        rows = _read_jsonl(path)
        for r in rows:
            if "episode_index" not in r or "length" not in r:
                raise ValueError(f"{path}: every line needs 'episode_index' and 'length'; got keys {sorted(r)}")
        rows = sorted(rows, key=lambda r: r["episode_index"])
        self._episode_rows = rows
        index = np.asarray([r["episode_index"] for r in rows], dtype=np.int64)
        lengths = np.asarray([r["length"] for r in rows], dtype=np.int64)
        # v2.1's global frame index runs through the episodes in order.
        ends = np.cumsum(lengths)
        return {"episode_index": index, "length": lengths, "dataset_from_index": ends - lengths,
                "dataset_to_index": ends, "episode_chunk": index // int(self.info.get("chunks_size", 1000))}

    def _read_tasks(self) -> dict[int, str]:
        v3, v2 = self.root / "meta" / "tasks.parquet", self.root / "meta" / "tasks.jsonl"
        if v3.is_file():
            t = read_table(v3).to_pydict()
            names = t.get("task", t.get("__index_level_0__", []))
            return {int(i): str(s) for i, s in zip(t["task_index"], names)}
        if v2.is_file():
            return {int(r["task_index"]): str(r["task"]) for r in _read_jsonl(v2)}
        return {}

    def _read_stats(self) -> dict[str, dict[str, np.ndarray]]:
        path = self.root / "meta" / "stats.json"
        if path.is_file():
            raw = read_json(path, "LeRobot's statistics: one object {feature: {mean, std, min, max, ...}}")
            return {k: {s: np.asarray(v, dtype=np.float64) for s, v in d.items()} for k, d in raw.items()}
        per_episode = self.root / "meta" / "episodes_stats.jsonl"
        if per_episode.is_file():
            lengths = dict(zip(self.episodes["episode_index"].tolist(), self.episodes["length"].tolist()))
            return aggregate_stats([(r["stats"], lengths.get(r["episode_index"])) for r in _read_jsonl(per_episode)])
        return {}

    def episode_strings(self, column: str) -> list[str] | None:
        """A string column of the episode metadata (e.g. a DROID ``episode_id``), in episode order; None if absent."""
        if self._episode_rows is not None:
            if not all(column in r for r in self._episode_rows):
                return None
            return [r[column] for r in self._episode_rows]
        files = sorted((self.root / "meta" / "episodes").glob("**/*.parquet"))
        tables = [read_table(f, columns=["episode_index", column]) if column in read_schema(f).names else None
                  for f in files]
        if any(t is None for t in tables):
            return None
        table = pa.concat_tables(tables)
        order = np.argsort(np.asarray(table["episode_index"]), kind="stable")
        values = table[column].to_pylist()
        return [values[i] for i in order]

    def video_location(self, key: str) -> VideoLocation:
        template = self.info["video_path"]
        ep = self.episodes
        if self.version == "v2.1":
            paths = [self.root / template.format(episode_chunk=int(c), video_key=key, episode_index=int(e))
                     for c, e in zip(ep["episode_chunk"], ep["episode_index"])]
            # One file per episode, starting at time 0.
            return VideoLocation(paths, np.zeros(len(paths)), ep["length"] / self.fps)
        for col in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            if f"videos/{key}/{col}" not in ep:
                raise ValueError(f"{self.root}: meta/episodes has no 'videos/{key}/{col}' column for camera {key!r}")
        paths = [
            self.root / template.format(video_key=key, chunk_index=int(c), file_index=int(f))
            for c, f in zip(ep[f"videos/{key}/chunk_index"], ep[f"videos/{key}/file_index"])
        ]
        return VideoLocation(paths, ep[f"videos/{key}/from_timestamp"].astype(np.float64),
                             ep[f"videos/{key}/to_timestamp"].astype(np.float64))

    # -- frame columns ----------------------------------------------------------------------------

    def episode_data_path(self, pos: int) -> Path:
        ep = self.episodes
        if self.version == "v2.1":
            return self.root / self.info["data_path"].format(episode_chunk=int(ep["episode_chunk"][pos]),
                                                               episode_index=int(ep["episode_index"][pos]))
        return self.root / self.info["data_path"].format(chunk_index=int(ep["data/chunk_index"][pos]),
                                                           file_index=int(ep["data/file_index"][pos]))

    def read_episode(self, pos: int, keys: list[str]) -> dict[str, np.ndarray]:
        """Frame columns of the episode at position ``pos`` (in episode order), in frame order."""
        return self.read_frames(pos, keys)

    def read_frames(self, pos: int, keys: list[str], first: int = 0, end: int | None = None) -> dict[str, np.ndarray]:
        """Frame columns of frames ``[first, end)`` of the episode at position ``pos`` (the whole episode by
        default), in frame order; only the row groups that hold them are read (an image camera's bytes)."""
        start, stop = int(self.episodes["dataset_from_index"][pos]), int(self.episodes["dataset_to_index"][pos])
        whole = first == 0 and (end is None or end >= stop - start)
        end = stop - start if end is None else min(end, stop - start)
        path = self.episode_data_path(pos)
        if self.version == "v2.1":
            columns = read_rows(path, ["frame_index", *keys], None if whole else ("frame_index", first, end))
            order = np.argsort(columns["frame_index"], kind="stable")
        else:
            columns = read_rows(path, ["index", *keys], ("index", start + first, start + end))
            order = np.argsort(columns["index"], kind="stable")
        if len(order) != end - first:
            episode = int(self.episodes["episode_index"][pos])
            raise DataError(f"{path}: episode {episode} has {len(order)} rows, its metadata says {stop - start}"
                            if whole else f"{path}: episode {episode} has {len(order)} rows for its frames "
                            f"{first}..{end - 1}, its metadata says {end - first}", path)
        return {k: columns[k][order] for k in keys}

    def episode_constant_from_stats(self, key: str) -> np.ndarray | None:
        """Each episode's value of ``key`` from per-episode stats, where every episode has min == max
        for it (v3.0: ``stats/<key>/min|max`` columns of meta/episodes; v2.1: episodes_stats.jsonl);
        None where the stats do not say."""
        if self.version == "v3.0":
            files = sorted((self.root / "meta" / "episodes").glob("**/*.parquet"))
            names = [f"stats/{key}/min", f"stats/{key}/max"]
            if not files or not all(n in read_schema(files[0]).names for n in names):
                return None
            table = pa.concat_tables([read_table(f, columns=["episode_index", *names]) for f in files])
            order = np.argsort(np.asarray(table["episode_index"]), kind="stable")
            lo, hi = (to_numpy(table[n]).reshape(table.num_rows, -1)[order, 0] for n in names)
        else:
            path = self.root / "meta" / "episodes_stats.jsonl"
            if not path.is_file():
                return None
            by_episode = {}
            for row in _read_jsonl(path):
                stats = row.get("stats", {}).get(key)
                if stats is None or "min" not in stats or "max" not in stats:
                    return None
                by_episode[row["episode_index"]] = (np.ravel(stats["min"])[0], np.ravel(stats["max"])[0])
            if set(by_episode) != set(self.episodes["episode_index"].tolist()):
                return None
            lo, hi = (np.asarray([by_episode[e][i] for e in self.episodes["episode_index"].tolist()]) for i in (0, 1))
        if not np.array_equal(lo, hi):
            return None
        return lo

    def episode_first_values(self, key: str) -> np.ndarray:
        """One frame column's value at each episode's first frame (e.g. ``is_episode_successful``),
        read from the data files (v2.1: the first row group of each episode's file, many at once)."""
        if self.version == "v2.1":
            def first(pos: int) -> np.ndarray:
                path = self.episode_data_path(pos)
                with reading(path):
                    return to_numpy(pq.ParquetFile(path).read_row_group(0, columns=[key])[key])[:1]

            # Opening many small files is latency-bound: threads overlap it (pyarrow releases the GIL).
            with ThreadPoolExecutor(max_workers=16) as pool:
                out = list(pool.map(first, range(self.num_episodes), chunksize=256))
            return np.concatenate(out).reshape(self.num_episodes, -1)[:, 0]
        paths = sorted({self.episode_data_path(p) for p in range(self.num_episodes)})
        table = pa.concat_tables([read_table(p, columns=["index", key]) for p in paths])
        index, values = np.asarray(table["index"]), to_numpy(table[key]).reshape(table.num_rows, -1)[:, 0]
        where = np.full(self.num_frames, -1, dtype=np.int64)
        where[index] = np.arange(len(index))
        return values[where[self.episodes["dataset_from_index"]]]


def aggregate_stats(per_episode: list[tuple[dict, int | None]]) -> dict[str, dict[str, np.ndarray]]:
    """Pool per-episode stats (v2.1's episodes_stats.jsonl): count-weighted mean and variance,
    elementwise min / max. A missing ``count`` falls back to the episode length."""
    pooled: dict[str, dict[str, np.ndarray]] = {}
    features = {k for stats, _ in per_episode for k in stats}
    for key in sorted(features):
        parts = [(s[key], n) for s, n in per_episode if key in s]
        if not all(all(f in p for f in ("mean", "std", "min", "max")) for p, _ in parts):
            continue
        counts = np.asarray([float(np.asarray(p.get("count", [n or 1])).reshape(-1)[0]) for p, n in parts])
        means = np.stack([np.asarray(p["mean"], np.float64).reshape(-1) for p, _ in parts])
        stds = np.stack([np.asarray(p["std"], np.float64).reshape(-1) for p, _ in parts])
        w = counts[:, None] / counts.sum()
        mean = (w * means).sum(0)
        var = (w * (stds**2 + means**2)).sum(0) - mean**2
        pooled[key] = {
            "mean": mean, "std": np.sqrt(np.maximum(var, 0.0)),
            "min": np.min([np.asarray(p["min"], np.float64).reshape(-1) for p, _ in parts], axis=0),
            "max": np.max([np.asarray(p["max"], np.float64).reshape(-1) for p, _ in parts], axis=0),
            "count": np.asarray([counts.sum()]),
        }
    return pooled
