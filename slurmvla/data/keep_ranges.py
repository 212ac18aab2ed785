"""The DROID keep-ranges idle filter (``keep_ranges_1_0_1.json``).

The file is one flat JSON object ``{"<recording_folderpath>--<file_path>": [[start, end], ...]}``
with 0-based, half-open step ranges. Episodes absent from it are dropped. A LeRobot copy stores
neither path, so the key is built from the episode's DROID id (``{lab}+{hash8}+{date-time}``)
through ``episode_id_to_path.json`` (id -> ``{lab}/{success|failure}/{date}/{folder}``), or from a
relative-path column where a dataset has one.

Semantics: ``frame`` (default; a sample's start frame lies in a range, its action chunk may run
past the range end, as DROID's original per-step filter does) or ``window`` (the whole chunk lies
inside one range).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from slurmvla.data import DataError
from slurmvla.data.checksums import verify

GCS_ROOT = "gs://xembodiment_data/r2d2/r2d2-data-full"


def episode_key(relative_path: str) -> str:
    base = f"{GCS_ROOT}/{relative_path.strip('/')}"
    return f"{base}/recordings/MP4--{base}/trajectory.h5"


class KeepRanges:
    """All ranges of a keep-ranges file in one ``[n, 2]`` int64 array, found by key: a dict of
    ~95k small arrays would cost more memory and time than the data it holds."""

    def __init__(self, keys: list[str], offsets: np.ndarray, ranges: np.ndarray):
        self.position = {k: i for i, k in enumerate(keys)}
        self.offsets = offsets  # [num_keys + 1]
        self.ranges = ranges

    def __len__(self) -> int:
        return len(self.position)

    def __contains__(self, key: str) -> bool:
        return key in self.position

    def get(self, key: str, default=None) -> np.ndarray | None:
        i = self.position.get(key)
        return default if i is None else self.ranges[self.offsets[i] : self.offsets[i + 1]]

    def __getitem__(self, key: str) -> np.ndarray:
        out = self.get(key)
        if out is None:
            raise KeyError(key)
        return out


LAYOUT = ('one JSON object {"<recording_folderpath>--<file_path>": [[start, end], ...]} (DROID\'s keep-ranges layout, '
          'keep_ranges_1_0_1.json)')


def read_json(path: str | Path, what: str) -> object:
    """A JSON file's content; a file that is not JSON fails naming it, where, and ``what`` it should hold."""
    path = Path(path)
    try:
        verify(path)  # a dataset's metadata: as written, where the dataset has checksums
        return json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not JSON ({e.msg} at line {e.lineno} column {e.colno}); expected {what}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not JSON (not UTF-8 text); expected {what}") from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); expected {what}") from None


def load_keep_ranges(path: str | Path) -> KeepRanges:
    """Read and validate: one object of lists of disjoint ``[start, end)`` integer ranges (sorted here)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"keep-ranges file {str(path)!r} does not exist")
    raw = read_json(path, LAYOUT)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected {LAYOUT}, got a JSON {type(raw).__name__}")
    keys = list(raw)
    counts = np.zeros(len(keys) + 1, dtype=np.int64)
    flat: list = []
    for i, key in enumerate(keys):
        ranges = raw[key]
        if not isinstance(ranges, list):
            raise ValueError(f"{path}: {key!r}: expected a list of [start, end] ranges, got {ranges!r}")
        for r in ranges:
            # type() is int: rejects floats and bools, which json would otherwise let through.
            if not (type(r) is list and len(r) == 2 and type(r[0]) is int and type(r[1]) is int and 0 <= r[0] < r[1]):
                raise ValueError(f"{path}: {key!r}: range {r!r} is not [start, end) with 0 <= start < end integers")
        counts[i + 1] = len(ranges)
        flat.extend(ranges)
    offsets = np.cumsum(counts)
    arr = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    # Sort ranges within each key (by key position, then start), then check neighbours for overlap.
    owner = np.repeat(np.arange(len(keys)), counts[1:])
    order = np.lexsort((arr[:, 0], owner))
    arr, owner = arr[order], owner[order]
    bad = np.flatnonzero((owner[1:] == owner[:-1]) & (arr[1:, 0] < arr[:-1, 1]))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{path}: {keys[owner[i]]!r}: ranges {arr[i].tolist()} and {arr[i + 1].tolist()} overlap")
    return KeepRanges(keys, offsets, arr)
