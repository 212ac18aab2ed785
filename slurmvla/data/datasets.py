"""The torch datasets over a :class:`~slurmvla.data.mixture.Mixture`'s epoch plan.

- :class:`EpisodeStream` (the fast path): the plan's sample sequence is cut into equal contiguous
  shards, one per (rank, dataloader worker). A worker opens each of its episode pieces once and
  interleaves ``interleave_episodes`` pieces at a time; a piece's samples come in frame order, so
  its frames are decoded forward, a block at a time, and dropped once passed (worker memory is
  bounded by the open pieces' history windows, not by episode length). Every shard has
  the same number of whole batches, so every rank yields the same number per epoch; what does not
  fit (fewer than ``num_shards * (batch + 1)`` samples per epoch) is left out. The position is one
  number, batches consumed on this rank in this epoch, and a resumed stream yields exactly what
  the uninterrupted one would have yielded next.
- :class:`MapDataset` over the plan with :class:`EpochSampler`: random access in a global order
  that does not depend on the world size (for debugging and engine parity checks; slower).
- :class:`ValidationDataset`: every validation sample of every dataset in a fixed order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from slurmvla.data import DataError
from slurmvla.data.damaged import Damaged, StandIn, mark, stand_in
from slurmvla.data.index import SampleIndex
from slurmvla.data.mixture import Mixture, Plan, seeded_rng
from slurmvla.data.source import Episode, LeRobotSource


class _EpisodeCache:
    """Whole decoded episodes of one worker, least recently used first out."""

    def __init__(self, sources: list[LeRobotSource], size: int):
        self.sources, self.size = sources, size
        self.items: OrderedDict[tuple, Episode] = OrderedDict()

    def get(self, dataset: int, episode: int) -> Episode:
        key = (dataset, episode)
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        ep = self.sources[dataset].load_episode(episode)
        self.items[key] = ep
        while len(self.items) > self.size:
            self.items.popitem(last=False)
        return ep


class EpisodeStream(IterableDataset):
    """The episode-shuffle stream of one rank (see the module docstring)."""

    def __init__(self, mixture: Mixture, batch_size: int, rank: int, world_size: int, num_workers: int):
        self.mixture, self.batch_size = mixture, batch_size
        self.rank, self.world_size = rank, world_size
        self.num_workers = max(1, num_workers)
        self.num_shards = world_size * self.num_workers
        per_shard = mixture.samples_per_epoch // self.num_shards
        self.batches_per_shard = per_shard // batch_size
        if self.batches_per_shard == 0:
            raise ValueError(
                f"the training data has {mixture.samples_per_epoch} samples per epoch: fewer than one micro-batch of "
                f"{batch_size} for each of {world_size} ranks x {self.num_workers} dataloader workers; lower "
                "trainer.global_batch_size or data.num_workers"
            )
        # (epoch, position) in shared memory: persistent workers read it at the start of every
        # epoch, so they can keep decoded episodes (data.stream_cache_episodes) across epochs.
        self._where = torch.zeros(2, dtype=torch.int64).share_memory_()
        self._kept = _EpisodeCache(mixture.sources, mixture.cfg.stream_cache_episodes)
        self._damaged = Damaged(mixture.cfg)

    @property
    def epoch(self) -> int:
        return int(self._where[0])

    @property
    def position(self) -> int:
        return int(self._where[1])

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank yields per epoch (the same on every rank)."""
        return self.batches_per_shard * self.num_workers

    @property
    def samples_left_out(self) -> int:
        return self.mixture.samples_per_epoch - self.batches_per_epoch * self.batch_size * self.world_size

    def set_position(self, epoch: int, batches: int) -> None:
        if not 0 <= batches <= self.batches_per_epoch:
            raise ValueError(f"stream position {batches} is outside the epoch's {self.batches_per_epoch} batches")
        self._where[0], self._where[1] = epoch, batches

    def shard_order(self, epoch: int, shard: int) -> tuple[np.ndarray, ...]:
        """``(dataset, episode, frame, repeat, piece)`` of every sample of one shard, in yield order.

        The shard is a contiguous slice of the plan's sample sequence; its pieces are interleaved by
        sorting on ``local piece + interleave * u``: at any point about ``interleave`` pieces are open.
        """
        plan = self.mixture.plan(epoch)
        n = self.batches_per_shard * self.batch_size
        start = shard * (plan.num_samples // self.num_shards)
        piece, k = plan.locate(np.arange(start, start + n))
        local = piece - piece[0]
        u = seeded_rng("interleave", self.mixture.seed, epoch, shard).random(n)
        order = np.argsort(local + self.mixture.cfg.interleave_episodes * u, kind="stable")
        piece, k = piece[order], k[order]
        # Within each piece, its samples take its positions in frame order: a worker decodes forward
        # and keeps only a window of frames (EpisodeWindow). Positions grouped by piece, in order;
        # samples grouped by piece, in frame order; the one fills the other.
        in_order = np.empty_like(k)
        in_order[np.argsort(piece, kind="stable")] = k[np.lexsort((k, piece))]
        k = in_order
        d, e = plan.dataset[piece], plan.episode[piece]
        t = np.empty(n, dtype=np.int32)
        for ds in np.unique(d):
            m = d == ds
            t[m] = self.mixture.sources[ds].train_index.frames_of(e[m], k[m])
        # int32: a shard of all of DROID on one worker stays at ~20 bytes per sample.
        return d.astype(np.int32), e.astype(np.int32), t, plan.repeat[piece].astype(np.int32), piece

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        num_workers = info.num_workers if info is not None else 1
        if num_workers != self.num_workers:
            raise RuntimeError(f"the stream was built for {self.num_workers} workers, the loader runs {num_workers}")
        # The loader takes batch b of this rank from worker b % W. After resuming at batch p, loader
        # worker w first serves batch p + w: logical worker (p + w) % W, from its batch (p + w) // W.
        epoch, position = self.epoch, self.position
        logical = (position + worker) % self.num_workers
        first_batch = (position + worker) // self.num_workers
        shard = self.rank * self.num_workers + logical
        d, e, t, rep, piece = self.shard_order(epoch, shard)
        skip = first_batch * self.batch_size
        if skip >= len(piece):
            return
        # A piece is opened once, as a window that decodes its frames forward and holds only those
        # a later sample of it can still need, and closed after its last sample. Its window spans
        # all its samples in the shard: a resumed stream opens a piece it had begun over the same
        # frames, so its decoder meets damage (data.on_damaged) in the same block as the uninterrupted
        # one, and it re-requests the frames of the piece's samples before the position (frames it
        # decodes anyway), so damage met there is known as counted already. Per-piece bookkeeping is
        # vectorised; per-sample values are walked in chunks (never a Python object per sample).
        local = piece - piece.min()
        remaining = np.bincount(local[skip:], minlength=int(local.max()) + 1)
        begun = np.bincount(local[:skip], minlength=len(remaining)) > 0
        first = np.full(len(remaining), np.iinfo(np.int64).max)
        last = np.full(len(remaining), -1)
        np.minimum.at(first, local, t)
        np.maximum.at(last, local, t)
        open_pieces: dict[int, Episode] = {}
        stand_ins: dict[int, StandIn] = {}  # pieces found damaged: their substitutes
        try:
            for lo in range(skip, len(piece), 4096):
                chunk = zip(range(lo, lo + 4096), d[lo : lo + 4096].tolist(), e[lo : lo + 4096].tolist(),
                            t[lo : lo + 4096].tolist(), rep[lo : lo + 4096].tolist(), local[lo : lo + 4096].tolist())
                for slot, ds, ep, frame, r, p in chunk:
                    source = self.mixture.sources[ds]
                    met: list[str] = []
                    if p not in stand_ins:
                        before = False  # damage met before the position was counted then
                        try:
                            loaded = open_pieces.get(p)
                            if loaded is None:
                                before = bool(begun[p])
                                loaded = open_pieces[p] = self._open(ds, ep, int(first[p]), int(last[p]))
                                for earlier in t[:skip][local[:skip] == p].tolist() if before else ():
                                    loaded.images(source.history_frames(earlier))
                                before = False
                            sample = source.sample(loaded, frame, epoch, r, train=True)
                        except DataError as err:
                            what, _ = self._damaged.met(source, ep, err)
                            if not before:
                                met.append(what)
                            if p in open_pieces:
                                open_pieces.pop(p).close()
                            rng = seeded_rng("substitute", self.mixture.seed, epoch, int(piece[slot]))
                            # A damaged candidate is not counted here: its own slots count it.
                            stand_ins[p] = stand_in(source, source.train_index, rng, self._damaged, ep, None)
                    if p in stand_ins:
                        sample = stand_ins[p].sample(slot, epoch, r, train=True)
                    yield mark(sample, met, p in stand_ins)
                    remaining[p] -= 1
                    if remaining[p] == 0:
                        stand_ins.pop(p, None)
                        if p in open_pieces:
                            open_pieces.pop(p).close()
        finally:
            for loaded in open_pieces.values():
                loaded.close()

    def _open(self, dataset: int, episode: int, first: int, last: int) -> Episode:
        """A piece: a window over its frames, decoded forward as its samples (in frame order) need
        them; or the whole episode, decoded once and kept across epochs (data.stream_cache_episodes)."""
        if self._kept.size > 0:
            return self._kept.get(dataset, episode)
        return self.mixture.sources[dataset].open_episode(episode, first, last)


class MapDataset(Dataset):
    """Random access to the plan's samples by ``(global position, epoch)`` keys."""

    def __init__(self, mixture: Mixture, cache_size: int):
        self.mixture = mixture
        self.cache_size = cache_size
        self._plans: dict[int, Plan] = {}
        self._cache: _EpisodeCache | None = None
        self._damaged = Damaged(mixture.cfg)

    def __len__(self) -> int:
        return self.mixture.samples_per_epoch

    def _plan(self, epoch: int) -> Plan:
        if epoch not in self._plans:
            self._plans = {epoch: self.mixture.plan(epoch)}
        return self._plans[epoch]

    def __getitem__(self, key: tuple[int, int]) -> dict:
        g, epoch = key
        plan = self._plan(epoch)
        piece, k = plan.locate(np.asarray([g]))
        d, e = int(plan.dataset[piece[0]]), int(plan.episode[piece[0]])
        source = self.mixture.sources[d]
        t = int(source.train_index.frames_of(np.asarray([e]), k)[0])
        if self._cache is None:
            self._cache = _EpisodeCache(self.mixture.sources, self.cache_size)
        repeat = int(plan.repeat[piece[0]])
        met: list[str] = []
        # An episode found damaged is not read again; it is counted once per worker process (a sample of it
        # is met at every position it holds).
        if (d, e) not in self._damaged.known:
            try:
                return mark(source.sample(self._cache.get(d, e), t, epoch, repeat, train=True))
            except DataError as err:
                met.append(self._damaged.met(source, e, err)[0])
        rng = seeded_rng("substitute", self.mixture.seed, epoch, g)
        sub = stand_in(source, source.train_index, rng, self._damaged, e, met if met else None,
                       lambda pos: self._cache.get(d, pos))
        return mark(sub.sample(g, epoch, repeat, train=True), met, True)


SPLITS = ("val", "all")


class ValidationDataset(Dataset):
    """Every validation sample of every dataset (``split="all"``: every sample the filters keep), in
    (dataset, episode, frame) order; fixed randomness.

    Read in that order (as the validation loader does), an episode is decoded forward through one
    window (:class:`~slurmvla.data.source.EpisodeWindow`) and never held whole; an index out of
    order opens a new window, so random access still works, only slower."""

    EPOCH = -1

    def __init__(self, mixture: Mixture, split: str = "val"):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not valid; choose one of {list(SPLITS)}")
        self.mixture = mixture
        rows = []
        for d, s in enumerate(mixture.sources):
            index: SampleIndex = s.val_index if split == "val" else s.index
            counts = index.ep_count[index.episodes]
            eps = np.repeat(index.episodes, counts)
            k = np.arange(len(eps)) - np.repeat(np.cumsum(counts) - counts, counts)
            rows.append(np.stack([np.full(len(eps), d), eps, index.frames_of(eps, k)], axis=1))
        self.rows = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
        # Each row's episode's last validation frame (an episode's rows are contiguous, frames rising).
        self._episode_last = np.zeros(0, np.int64)
        if len(self.rows):
            starts = np.flatnonzero(np.any(np.diff(self.rows[:, :2], axis=0) != 0, axis=1)) + 1
            ends = np.append(starts, len(self.rows)) - 1
            self._episode_last = np.repeat(self.rows[ends, 2], np.diff(np.concatenate([[0], ends + 1])))
        self._window: tuple[int, int, int, Episode] | None = None  # (dataset, episode, last frame served, window)
        self._damaged = Damaged(mixture.cfg)
        self._stand_in: tuple[int, int, StandIn] | None = None  # (dataset, damaged episode, its substitute)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        d, e, t = (int(v) for v in self.rows[i])
        source = self.mixture.sources[d]
        if self._stand_in is not None and self._stand_in[:2] == (d, e):
            return mark(self._stand_in[2].sample(i, self.EPOCH), (), True)
        try:
            if self._window is None or self._window[:2] != (d, e) or t < self._window[2]:
                if self._window is not None:
                    self._window[3].close()
                    self._window = None
                self._window = (d, e, t, source.open_episode(e, t, int(self._episode_last[i])))
            window = self._window[3]
            self._window = (d, e, t, window)
            return mark(source.sample(window, t, self.EPOCH))
        except DataError as err:
            if self._window is not None:
                self._window[3].close()
                self._window = None
            what, _ = self._damaged.met(source, e, err)  # an episode's rows are contiguous: met once a pass
            met = [what]
            val = source.val_index
            index = val if val.ep_count[e] > 0 and len(val.episodes) > 1 else source.index
            sub = stand_in(source, index, seeded_rng("substitute", "validation", d, e), self._damaged, e, None)
            self._stand_in = (d, e, sub)
            return mark(sub.sample(i, self.EPOCH), met, True)


class EpochSampler(Sampler[tuple[int, int]]):
    """Shuffled ``(index, epoch)`` keys for one rank; the order is a pure function of ``(seed, epoch, rank)``.

    Every rank gets the same number of samples (the tail that does not divide evenly is left out
    for the epoch), and ``set_position`` starts an epoch part-way.
    """

    def __init__(self, num_samples: int, seed: int, rank: int = 0, world_size: int = 1):
        if num_samples < world_size:
            raise ValueError(f"dataset has {num_samples} samples, fewer than world size {world_size}")
        self.num_samples, self.seed, self.rank, self.world_size = num_samples, seed, rank, world_size
        self.epoch = 0
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.num_samples // self.world_size - self.start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_samples, generator=g)
        per_rank = self.num_samples // self.world_size
        mine = order[self.rank :: self.world_size][:per_rank]
        return iter([(i, self.epoch) for i in mine[self.start :].tolist()])
