"""Damaged data files (``data.on_damaged``): a video that does not decode or a parquet that cannot be read
costs the episodes it holds, not the run.

Under ``skip`` a reader that meets a damaged episode warns once (naming the file and the episode) and
fills the episode's sample slots with samples of a **substitute**: a readable episode of the same dataset
and split, the first in an order seeded by where the slot is, never by timing:

- the stream (:class:`~slurmvla.data.datasets.EpisodeStream`): a piece found damaged when it is opened or
  mid-way (its frames decode forward, so samples of it may have gone out already) gives its remaining
  slots to the substitute of ``(seed, epoch, piece)``, whose sample for shard slot ``s`` is its
  ``s mod count``-th. A shard yields exactly its sample count, so every rank yields the same number of
  batches. A resumed stream opens the pieces it had begun over the same frames, so its decoders meet
  damage where the uninterrupted stream's did and it yields the same samples; it re-requests the frames
  of their samples before its position, so damage met there is not counted again;
- the map-style reader: the substitute of ``(seed, epoch, position)``;
- validation and ``python -m slurmvla.evaluate``: the substitute of ``(dataset, episode)``; its samples
  are marked and left out of the metrics, and the files are reported.

Every sample carries three fields: :data:`DAMAGED` (damaged episodes met at this slot, usually 0),
:data:`DAMAGED_FILES` (``path (episode N of dataset)`` of those, ``'; '``-joined) and :data:`SUBSTITUTE`
(this sample stands in for a damaged one). Data workers are other processes: the counts come back
through the batch, and :class:`DamageCount` (the trainer's) pops them, sums them over the ranks at each
log step and stops the run past ``data.max_damaged_share``. :func:`scan` checks every file up front
(``python -m slurmvla.inspect --scan``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import torch

from slurmvla.collectives import gather_objects
from slurmvla.config.data import DataConfig
from slurmvla.data import DataError
from slurmvla.data.checksums import verify
from slurmvla.data.images import decode_image
from slurmvla.data.index import SampleIndex
from slurmvla.data.lerobot_format import reading, to_numpy
from slurmvla.data.source import Episode, LeRobotSource
from slurmvla.errors import one_line

log = logging.getLogger("slurmvla")

DAMAGED, DAMAGED_FILES, SUBSTITUTE = "damaged_episodes", "damaged_files", "substitute"
FIELDS = (DAMAGED, DAMAGED_FILES, SUBSTITUTE)
SUBSTITUTE_TRIES = 32  # readable candidates looked for before giving up
FIRST_FILES = 5  # files the share error names


def describe(source: LeRobotSource, pos: int, error: DataError) -> str:
    episode = int(source.meta.episodes["episode_index"][pos])
    return f"{error.path or source.meta.root} (episode {episode} of {source.name})"


class Damaged:
    """One process's damaged episodes (a data worker's or the main process's), each warned about once."""

    def __init__(self, cfg: DataConfig):
        self.skip = cfg.on_damaged == "skip"
        self.known: dict[tuple[int, int], str] = {}

    def met(self, source: LeRobotSource, pos: int, error: DataError) -> tuple[str, bool]:
        """``(description, first time in this process)``; under ``data.on_damaged=error``, ``error`` itself."""
        if not self.skip:
            raise error
        key = (source.dataset_index, pos)
        if key in self.known:
            return self.known[key], False
        self.known[key] = what = describe(source, pos, error)
        log.warning("skipping %s: %s (data.on_damaged=skip: its samples are replaced by another episode's)", what,
                    one_line(error))
        return what, True


def mark(sample: dict, met: Sequence[str] = (), substitute: bool = False) -> dict:
    sample[DAMAGED] = torch.tensor(len(met))
    sample[DAMAGED_FILES] = "; ".join(met)
    sample[SUBSTITUTE] = torch.tensor(substitute)
    return sample


@dataclass
class StandIn:
    """A substitute episode, loaded whole, and the index its samples are taken from."""

    source: LeRobotSource
    index: SampleIndex
    pos: int
    episode: Episode

    def sample(self, k: int, epoch: int, repeat: int = 0, train: bool = False) -> dict:
        count = int(self.index.ep_count[self.pos])
        t = int(self.index.frames_of(np.asarray([self.pos]), np.asarray([k % count]))[0])
        return self.source.sample(self.episode, t, epoch, repeat, train=train)


def stand_in(source: LeRobotSource, index: SampleIndex, rng: np.random.Generator, damaged: Damaged, exclude: int,
             met: list[str] | None, load: Callable[[int], Episode] | None = None) -> StandIn:
    """The first readable episode of ``index`` in ``rng``'s order (not ``exclude``); damaged candidates are
    met (and appended to ``met``)."""
    load = load or source.load_episode
    episodes = index.episodes[index.episodes != exclude]
    tried = episodes[rng.permutation(len(episodes))[:SUBSTITUTE_TRIES]]
    for pos in tried.tolist():
        if (source.dataset_index, pos) in damaged.known:  # it would fail again: the same choice, sooner
            continue
        try:
            return StandIn(source, index, pos, load(pos))
        except DataError as e:
            what, _ = damaged.met(source, pos, e)
            if met is not None:
                met.append(what)
    raise DataError(f"{source.name}: none of {len(tried)} episodes tried could stand in for a damaged one (every one "
                    "is damaged too); the copy of the dataset is wrong: check it with python -m slurmvla.inspect --scan")


@dataclass
class DamageCount:
    """The trainer's count of damaged episodes: each batch's fields popped (:meth:`take`), summed over the
    ranks at each log step (:meth:`reduce`, a collective) and held against ``data.max_damaged_share`` of
    the episodes the run reads (``episodes_per_epoch`` per epoch begun)."""

    cfg: DataConfig
    episodes_per_epoch: int
    total: int = 0
    first: list[str] = field(default_factory=list)
    _window: int = 0
    _files: list[str] = field(default_factory=list)

    def take(self, batch: dict) -> dict:
        count, files = batch.pop(DAMAGED, None), batch.pop(DAMAGED_FILES, None)
        batch.pop(SUBSTITUTE, None)
        if count is not None:
            self._window += int(count.sum())
            self._files += [f for f in (files or []) if f][: FIRST_FILES]
        return batch

    def reduce(self, epoch: int) -> int:
        """Damaged episodes met by every rank since the last call; raises past the share limit."""
        everyone = gather_objects((self._window, self._files[:FIRST_FILES]))
        self._window, self._files = 0, []
        met = sum(n for n, _ in everyone)
        self.total += met
        for _, files in everyone:
            for f in files:
                for one in f.split("; "):
                    if one not in self.first and len(self.first) < FIRST_FILES:
                        self.first.append(one)
        read = max(1, self.episodes_per_epoch * (epoch + 1))
        if met and self.total > self.cfg.max_damaged_share * read:
            raise DataError(f"{self.total} damaged episodes met, {self.total / read:.2%} of the {read} episodes this run "
                            f"reads so far: more than data.max_damaged_share={self.cfg.max_damaged_share} (many damaged "
                            f"files mean the copy of the dataset is wrong); first: {', '.join(self.first)}; list them "
                            "all with python -m slurmvla.inspect --scan")
        return met

    def state_dict(self) -> dict:
        return {"total": self.total, "first": list(self.first)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.total, self.first = int(state["total"]), list(state["first"])


def pop_marks(batch: dict) -> tuple[torch.Tensor, list[str]]:
    """A batch's SUBSTITUTE flags and damaged files, popped (validation and evaluate: the policy never sees them)."""
    batch.pop(DAMAGED, None)
    files = [f for f in batch.pop(DAMAGED_FILES, None) or [] if f]
    return batch.pop(SUBSTITUTE, torch.zeros(0, dtype=torch.bool)), files


def leave_out(values: dict[str, torch.Tensor], substitute: torch.Tensor, num_real: int
              ) -> tuple[dict[str, torch.Tensor], int]:
    """Per-sample ``values`` reordered so the real samples that are no substitute come first, and their number
    (the rest stays as padding: every rank keeps its length for the gather)."""
    keep = (torch.arange(len(substitute)) < num_real) & ~substitute.bool()
    order = torch.cat([keep.nonzero().flatten(), (~keep).nonzero().flatten()])
    return {k: v[order.to(v.device)] for k, v in values.items()}, int(keep.sum())


def say_skipped(what: str, files: Sequence[str]) -> None:
    if files:
        log.warning("%s left out the samples of %d damaged episode(s) (data.on_damaged=skip): %s", what, len(files),
                    "; ".join(files))


# -- the scan: every file checked up front ----------------------------------------------------------


@dataclass
class Finding:
    path: Path
    reason: str
    dataset: str
    episodes: list[int]


def _check_video(path: Path, frames_needed: int) -> str | None:
    """None when every frame of ``path`` decodes (and there are at least ``frames_needed``), else why not.
    Frames are decoded, not converted: the check costs a fraction of reading them for training."""
    if not path.is_file():
        return "does not exist" if not path.exists() else "is not a file"
    try:
        verify(path)
    except DataError as e:
        return str(e).removeprefix(f"{path}").lstrip(": ")
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                return "has no video stream"
            stream = container.streams.video[0]
            if stream.codec_context is None:
                return "has a video stream whose codec cannot be opened"
            stream.thread_type = "AUTO"
            decoded = sum(1 for _ in container.decode(stream))
    except (OSError, av.error.FFmpegError) as e:
        return f"cannot be decoded ({getattr(e, 'strerror', None) or e})"
    if decoded < frames_needed:
        return f"decodes {decoded} frames, its episodes need {frames_needed}"
    return None


def _check_parquet(path: Path, image_keys: Sequence[str] = ()) -> tuple[str | None, list[int] | None]:
    """``(None, None)`` when the file reads whole and every frame of its image cameras (``image_keys``) decodes; else
    why not, and the episodes of the frames that do not (None: all the file's, when the file itself does not read)."""
    try:
        with reading(path):
            table = pq.read_table(path, use_threads=False)
    except DataError as e:
        return str(e).removeprefix(f"{path} "), None
    bad: dict[int, str] = {}  # episode -> its first damaged frame's reason
    present = [k for k in image_keys if k in table.column_names]
    if present:
        episodes, frames = (to_numpy(table[c]) if c in table.column_names else np.full(table.num_rows, -1)
                            for c in ("episode_index", "frame_index"))
        for key in present:
            for row, data in enumerate(to_numpy(table[key])):
                try:
                    decode_image(data)
                except ValueError as e:
                    bad.setdefault(int(episodes[row]), f"frame {int(frames[row])} of episode {int(episodes[row])}, "
                                                       f"camera {key!r}: {e}")
    if not bad:
        return None, None
    first = bad[min(bad)]
    return (first if len(bad) == 1 else f"{first} (and frames of {len(bad) - 1} more episodes)"), sorted(bad)


def scan(sources: Sequence[LeRobotSource], threads: int = 4) -> list[Finding]:
    """Every video (header and every frame decoded) and every data parquet (read whole, and every frame of an image
    camera decoded) of ``sources``, each file once; the damaged ones, with their reason and the episodes they hold
    (an image camera's: the episodes of its damaged frames)."""
    jobs: list[tuple[Callable[[], str | None | tuple], Path, str, list[int]]] = []
    for source in sources:
        meta = source.meta
        episode_ids = meta.episodes["episode_index"]
        held: dict[Path, list[int]] = {}
        for pos in range(meta.num_episodes):
            held.setdefault(meta.episode_data_path(pos), []).append(pos)
        for path, positions in held.items():
            jobs.append((lambda p=path, k=tuple(source.images): _check_parquet(p, k), path, source.name,
                         [int(episode_ids[i]) for i in positions]))
        for loc in source.videos.values():
            held = {}
            for pos, path in enumerate(loc.paths):
                held.setdefault(path, []).append(pos)
            for path, positions in held.items():
                needed = int(np.floor(float(np.max(loc.to_ts[positions])) * meta.fps + 1e-6))
                jobs.append((lambda p=path, n=needed: _check_video(p, n), path, source.name,
                             [int(episode_ids[i]) for i in positions]))
    with ThreadPoolExecutor(max_workers=threads) as pool:  # PyAV and pyarrow release the GIL
        results = list(pool.map(lambda job: job[0](), jobs))
    found = []
    for (_, path, name, episodes), result in zip(jobs, results):
        reason, which = result if isinstance(result, tuple) else (result, None)
        if reason is not None:
            found.append(Finding(path, reason, name, episodes if which is None else which))
    return found
