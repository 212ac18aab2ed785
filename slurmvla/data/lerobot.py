"""LeRobot-format metadata and columns (v3.0: many episodes per parquet and per mp4 file).

Episode boundaries come from ``meta/episodes/**.parquet`` (``dataset_from_index`` /
``dataset_to_index``, and per camera ``videos/<key>/from_timestamp`` / ``to_timestamp``); nothing is
inferred from file names. Everything a caller can get wrong raises ``ValueError`` naming the path,
the value and what would have been valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SUPPORTED_VERSIONS = ("v3.0",)


@dataclass(frozen=True)
class VideoLocation:
    """Where each episode's frames of one camera live: file path and time range."""

    paths: list[Path]  # one per episode
    from_ts: np.ndarray  # float64 [num_episodes]
    to_ts: np.ndarray


class LeRobotDataset:
    """Metadata of one LeRobot dataset plus column access. Holds arrays per episode, not per frame."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        info_path = self.root / "meta" / "info.json"
        if not self.root.is_dir():
            raise ValueError(f"data root {str(self.root)!r} does not exist or is not a directory")
        if not info_path.is_file():
            raise ValueError(
                f"data root {str(self.root)!r} is not a LeRobot dataset: it has no meta/info.json "
                "(expected meta/info.json, meta/episodes/, data/ and videos/)"
            )
        self.info = json.loads(info_path.read_text())
        version = self.info.get("codebase_version")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"{info_path}: codebase_version={version!r} is not supported; supported: {list(SUPPORTED_VERSIONS)}"
            )
        self.version: str = version
        self.fps: float = float(self.info["fps"])
        self.features: dict[str, dict] = self.info["features"]
        self.episodes = self._read_episodes()
        stats_path = self.root / "meta" / "stats.json"
        self.stats: dict[str, dict[str, np.ndarray]] = {}
        if stats_path.is_file():
            raw = json.loads(stats_path.read_text())
            self.stats = {k: {s: np.asarray(v, dtype=np.float64) for s, v in d.items()} for k, d in raw.items()}

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

    def require_features(self, keys: list[str], needed_by: str) -> None:
        missing = [k for k in keys if k not in self.features]
        if missing:
            raise ValueError(
                f"dataset {str(self.root)!r} has no feature {missing[0]!r} (needed by {needed_by}); "
                f"features it has: {sorted(self.features)}"
            )

    def feature_dim(self, key: str) -> int:
        return int(np.prod(self.features[key]["shape"]))

    def _read_episodes(self) -> dict[str, np.ndarray]:
        files = sorted((self.root / "meta" / "episodes").glob("**/*.parquet"))
        if not files:
            raise ValueError(f"{self.root}: no episode metadata under meta/episodes/ (LeRobot v3.0 layout)")
        table = pa.concat_tables([pq.read_table(f) for f in files], promote_options="default")
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

    def episode_strings(self, column: str) -> list[str] | None:
        """A string column of meta/episodes (e.g. a DROID ``episode_id``), in episode order; None if absent."""
        files = sorted((self.root / "meta" / "episodes").glob("**/*.parquet"))
        tables = [pq.read_table(f) for f in files]
        if not all(column in t.column_names for t in tables):
            return None
        table = pa.concat_tables([t.select(["episode_index", column]) for t in tables])
        order = np.argsort(np.asarray(table["episode_index"]), kind="stable")
        values = table[column].to_pylist()
        return [values[i] for i in order]

    def video_location(self, key: str) -> VideoLocation:
        template = self.info["video_path"]
        ep = self.episodes
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

    def data_files(self) -> list[Path]:
        template = self.info["data_path"]
        pairs = sorted({(int(c), int(f)) for c, f in zip(self.episodes["data/chunk_index"], self.episodes["data/file_index"])})
        return [self.root / template.format(chunk_index=c, file_index=f) for c, f in pairs]

    def read_columns(self, keys: list[str]) -> dict[str, np.ndarray]:
        """Read frame columns for the whole dataset, ordered by the global frame ``index``.

        Numeric features come back as ``[num_frames, dim]`` float32 / int64 arrays; strings as an
        object array.
        """
        keys = list(dict.fromkeys(["index", *keys]))
        tables = [pq.read_table(f, columns=keys) for f in self.data_files()]
        table = pa.concat_tables(tables)
        out: dict[str, np.ndarray] = {}
        for key in keys:
            col = table[key].combine_chunks()
            if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type) or pa.types.is_large_list(col.type):
                flat = np.asarray(col.flatten())
                out[key] = flat.reshape(len(col), -1).astype(np.float32 if flat.dtype.kind == "f" else flat.dtype)
            elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                out[key] = np.asarray(col.to_pylist(), dtype=object)
            else:
                out[key] = np.asarray(col)
        index = out.pop("index")
        if not np.array_equal(index, np.arange(len(index))):
            order = np.argsort(index, kind="stable")
            out = {k: v[order] for k, v in out.items()}
            if not np.array_equal(index[order], np.arange(len(index))):
                raise ValueError(f"{self.root}: the frame 'index' column is not 0..N-1")
        if len(index) != self.num_frames:
            raise ValueError(f"{self.root}: data has {len(index)} frames, meta/episodes says {self.num_frames}")
        return out
