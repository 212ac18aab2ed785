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

GCS_ROOT = "gs://xembodiment_data/r2d2/r2d2-data-full"
SEMANTICS = ("frame", "window")


def episode_key(relative_path: str) -> str:
    base = f"{GCS_ROOT}/{relative_path.strip('/')}"
    return f"{base}/recordings/MP4--{base}/trajectory.h5"


def load_keep_ranges(path: str | Path) -> dict[str, np.ndarray]:
    """Key -> int64 ``[n, 2]`` ranges, validated: an object of lists of sorted, disjoint [start, end)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"keep-ranges file {str(path)!r} does not exist")
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected one JSON object {{key: [[start, end], ...]}}, got {type(raw).__name__}")
    out = {}
    for key, ranges in raw.items():
        if not isinstance(ranges, list):
            raise ValueError(f"{path}: {key!r}: expected a list of [start, end] ranges, got {ranges!r}")
        for r in ranges:
            ok = isinstance(r, list) and len(r) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
            if not ok or r[0] < 0 or r[0] >= r[1]:
                raise ValueError(f"{path}: {key!r}: range {r!r} is not [start, end) with 0 <= start < end integers")
        arr = np.asarray(sorted(ranges), dtype=np.int64).reshape(-1, 2)
        if len(arr) > 1 and (arr[1:, 0] < arr[:-1, 1]).any():
            i = int(np.flatnonzero(arr[1:, 0] < arr[:-1, 1])[0])
            raise ValueError(f"{path}: {key!r}: ranges {arr[i].tolist()} and {arr[i + 1].tolist()} overlap")
        out[key] = arr
    return out


def keep_segments(ranges: np.ndarray, length: int, horizon: int, semantics: str) -> np.ndarray:
    """Start-frame segments ``[s, e)`` of one episode that the filter keeps."""
    if semantics not in SEMANTICS:
        raise ValueError(f"keep-ranges semantics {semantics!r} is not valid; choose one of {list(SEMANTICS)}")
    segs = np.clip(ranges, 0, length)
    if semantics == "window":
        segs = segs.copy()
        segs[:, 1] -= horizon - 1
    return segs[segs[:, 1] > segs[:, 0]]
