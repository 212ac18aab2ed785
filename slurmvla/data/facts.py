"""Per-episode facts that need the frame data (e.g. ``is_episode_successful`` for
``data.success_only``), read once per dataset and shared by every rank and every later run.

At DROID's scale the read is what costs: v2.1 keeps one parquet file per episode (95.6k opens),
v3.0 a column over all 27.6M frames. :func:`episode_values` answers, in order of cost:

1. from per-episode statistics when the dataset has them for the key (LeRobot's writers store
   min / max per episode: v3.0 in ``meta/episodes`` as ``stats/<key>/min|max``, v2.1 in
   ``meta/episodes_stats.jsonl``) and they are constant within every episode;
2. from a small cache file (``<data.cache_dir>/episode_facts/<digest>.npy``) keyed by the dataset's
   path, its metadata files' sizes and times, and the key;
3. from the data files, read by one process while the others wait on a file lock, then cached.

So a job of any number of ranks reads the data files at most once, and later jobs never.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from pathlib import Path

import numpy as np

from slurmvla.data.lerobot_format import LeRobotMetadata

log = logging.getLogger("slurmvla")


def _digest(meta: LeRobotMetadata, key: str) -> str:
    """A name for what is read from ``meta``'s data files for ``key`` (any string saying what was read, how)."""
    parts = [str(meta.root.resolve()), meta.version, key, str(meta.num_episodes), str(meta.num_frames)]
    for path in sorted((meta.root / "meta").glob("*")):
        st = path.stat()
        parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


def episode_values(meta: LeRobotMetadata, key: str, cache_dir: str | Path) -> np.ndarray:
    """One frame column's value at each episode's first frame, in episode order (see the module
    docstring for where it comes from)."""
    values = meta.episode_constant_from_stats(key)
    if values is not None:
        return values
    folder = Path(cache_dir).expanduser() / "episode_facts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_digest(meta, key)}.npy"
    if path.is_file():
        return np.load(path)
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process reads; the others wait here, then load
        try:
            if path.is_file():
                return np.load(path)
            start = time.perf_counter()
            values = meta.episode_first_values(key)
            tmp = folder / f".{path.stem}.{os.getpid()}.npy"
            np.save(tmp, values)
            os.replace(tmp, path)
            log.info("read %r of %d episodes of %s from its data files in %.1f s; cached in %s", key,
                     meta.num_episodes, meta.root, time.perf_counter() - start, path)
            return values
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_arrays(meta: LeRobotMetadata, key: str, cache_dir: str | Path, compute, what: str) -> dict[str, np.ndarray]:
    """``compute()`` (a dict of arrays read from ``meta``'s data files; ``key`` says exactly what and how),
    cached in ``<cache_dir>/episode_facts/<digest>.npz`` as :func:`episode_values` caches: one process reads
    while the others wait on the lock, later runs load the file. ``what``: for the log line."""
    folder = Path(cache_dir).expanduser() / "episode_facts"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_digest(meta, key)}.npz"
    if path.is_file():
        return dict(np.load(path))
    with open(folder / f"{path.stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if path.is_file():
                return dict(np.load(path))
            start = time.perf_counter()
            arrays = compute()
            tmp = folder / f".{path.stem}.{os.getpid()}.npz"
            np.savez(tmp, **arrays)
            os.replace(tmp, path)
            log.info("computed %s of %s from its data files in %.1f s; cached in %s", what, meta.root,
                     time.perf_counter() - start, path)
            return arrays
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
