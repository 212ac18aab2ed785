"""Weighted mixtures of DROID-format datasets, the epoch plan, and the three readers built on it.

The **epoch plan** is a pure function of ``(seed, epoch)``: every dataset contributes a quota of
samples proportional to its weight (the quotas sum to the mixture's train samples; a dataset whose
quota exceeds its size repeats with a fresh episode order), its episodes are shuffled, and the
pieces of all datasets are shuffled together into one sequence of episode pieces.

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

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from slurmvla.config import DataConfig
from slurmvla.data.droid import DroidSource, Episode, dataset_specs, seeded_int
from slurmvla.data.index import SampleIndex
from slurmvla.data.spec import DataFeatures, SampleSpec

log = logging.getLogger("slurmvla")


def _rng(*parts: object) -> np.random.Generator:
    return np.random.default_rng(seeded_int(*parts) % 2**63)


@dataclass
class Plan:
    """One epoch's sequence of episode pieces; piece i holds the first ``count`` samples of its episode
    (whole episodes, except where a dataset's quota ends)."""

    dataset: np.ndarray
    episode: np.ndarray
    repeat: np.ndarray
    count: np.ndarray

    def __post_init__(self) -> None:
        self.cum = np.concatenate([[0], np.cumsum(self.count)]).astype(np.int64)

    @property
    def num_samples(self) -> int:
        return int(self.cum[-1])

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Piece of each global sample position, and the sample's rank within its episode."""
        piece = np.searchsorted(self.cum, g, side="right") - 1
        return piece, g - self.cum[piece]


class Mixture:
    """The datasets of ``data`` (the first plus ``data.mixture``), their weights and their plan."""

    def __init__(self, cfg: DataConfig, sample_spec: SampleSpec, seed: int):
        """``sample_spec``: what the policy needs its samples to look like (``Policy.sample_spec``)."""
        self.cfg, self.sample_spec, self.seed = cfg, sample_spec, seed
        self.sources = [DroidSource(spec, cfg, sample_spec, seed, i) for i, spec in enumerate(dataset_specs(cfg))]
        sizes = {s.name: s.frame_hw for s in self.sources}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the datasets of one mixture record frames of different sizes ({sizes}) and this policy "
                             "resizes frames itself from their recorded size, so a batch needs one size; mix datasets "
                             "recorded at one size")
        dims = {(s.state_dim, s.action_dim) for s in self.sources}
        if len(dims) > 1:
            raise ValueError("the datasets of one mixture must share state and action dims (one policy reads them); "
                             + ", ".join(f"{s.name}: state {s.state_dim}, action {s.action_dim}" for s in self.sources))
        w = np.asarray([s.spec.weight for s in self.sources], dtype=np.float64)
        self.weights = w / w.sum()
        sizes = np.asarray([s.train_index.num_samples for s in self.sources])
        # Quotas sum to the mixture's train samples; rounding leftovers go to the largest remainders.
        exact = self.weights * sizes.sum()
        quota = np.floor(exact).astype(np.int64)
        quota[np.argsort(-(exact - quota), kind="stable")[: int(sizes.sum() - quota.sum())]] += 1
        for s, q in zip(self.sources, quota):
            if q > 0 and s.train_index.num_samples == 0:
                raise ValueError(f"dataset {s.name!r} has weight {s.spec.weight} but no training samples "
                                 f"(val_fraction={cfg.val_fraction}); counts: {s.index.counts}")
        self.quota = quota

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def features(self) -> DataFeatures:
        """What the mixture yields, for the policy's checks (every dataset shares the first's dims)."""
        return self.sources[0].features()

    @property
    def control_modes(self) -> list[str]:
        """The mixture's distinct control modes, sorted: validation's group order."""
        return sorted({s.spec.control_mode for s in self.sources})

    @property
    def samples_per_epoch(self) -> int:
        return int(self.quota.sum())

    def plan(self, epoch: int) -> Plan:
        parts = []
        for d, (source, quota) in enumerate(zip(self.sources, self.quota)):
            index = source.train_index
            episodes, counts = index.episodes, index.ep_count[index.episodes]
            taken, repeat = 0, 0
            while taken < quota:
                order = _rng("episodes", self.seed, epoch, d, repeat).permutation(len(episodes))
                c = counts[order]
                # Whole episodes while the quota lasts; the last one is cut.
                n = min(len(c), int(np.searchsorted(np.cumsum(c), quota - taken, side="left")) + 1)
                c = c[:n].copy()
                c[-1] -= max(0, int(c.sum()) - (quota - taken))
                parts.append((np.full(n, d), episodes[order[:n]], np.full(n, repeat), c))
                taken += int(c.sum())
                repeat += 1
        if not parts:
            return Plan(*(np.zeros(0, np.int64) for _ in range(4)))
        cols = [np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(4)]
        order = _rng("pieces", self.seed, epoch).permutation(len(cols[0]))
        return Plan(*(c[order] for c in cols))

    def normalization(self, state_mode: str, action_mode: str, knobs: tuple[str | None, str | None] = (None, None)
                      ) -> dict[str, torch.Tensor]:
        """Offset / scale per state and action dim from the datasets' stats, pooled across the mixture:
        ``normalized = (x - offset) / scale``."""
        out = {}
        for (prefix, keys, mode), knob in zip((("state", self.cfg.state_keys, state_mode),
                                               ("action", self.cfg.action_keys, action_mode)), knobs):
            dim = self.sources[0].state_dim if prefix == "state" else self.sources[0].action_dim
            stats = {} if mode == "identity" else pool_stats([s.raw_stats(keys) for s in self.sources])
            out.update(offset_scale(stats, mode, dim, prefix, f"{keys}, which {self.names} do not all have", knob))
        return out

    def summary(self) -> dict:
        """Counts per dataset, for logs and ``python -m slurmvla.data.inspect``."""
        out = {}
        for s, w, q in zip(self.sources, self.weights, self.quota):
            c = dict(s.index.counts)
            out[s.name] = {
                "root": str(s.meta.root), "format": s.meta.version, "weight": float(w), "samples_per_epoch": int(q),
                **c, "train_episodes": int(len(s.train_index.episodes)), "val_episodes": int(len(s.val_index.episodes)),
                "train_samples": s.train_index.num_samples, "val_samples": s.val_index.num_samples,
            }
        return out


def offset_scale(stats: dict[str, np.ndarray], mode: str, dim: int, prefix: str, where: str,
                 knob: str | None = None) -> dict[str, torch.Tensor]:
    """``{prefix}_offset`` / ``{prefix}_scale`` for ``normalized = (x - offset) / scale`` from raw stats
    (mean / std / min / max / q01 / q99): mean_std, min_max and quantile (to [-1, 1] between q01 and
    q99, as LeRobot's and openpi's quantile normalization) or identity. ``knob``: the setting that
    chose ``mode``, named in the error (default ``data.{prefix}_normalization``)."""
    if mode == "identity":
        offset, scale = np.zeros(dim), np.ones(dim)
    else:
        need = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantile": ("q01", "q99")}[mode]
        if not all(n in stats for n in need):
            raise ValueError(f"{knob or f'data.{prefix}_normalization'}={mode!r} needs {list(need)} stats for {where}; "
                             f"stats there: {sorted(stats)}; choose mean_std, min_max or identity")
        a, b = (np.asarray(stats[n], dtype=np.float64).reshape(-1) for n in need)
        if len(a) < dim:
            raise ValueError(f"{prefix} statistics of {where} have {len(a)} dims, the data has {dim}")
        a, b = a[:dim], b[:dim]
        offset, scale = (a, b) if mode == "mean_std" else ((a + b) / 2, (b - a) / 2)
    return {f"{prefix}_offset": torch.as_tensor(offset, dtype=torch.float32),
            f"{prefix}_scale": torch.as_tensor(np.maximum(scale, 1e-4), dtype=torch.float32)}


def pool_stats(stats: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Pool stats of several datasets: count-weighted mean / variance, elementwise min / max, and
    the outermost q01 / q99 (a conservative range)."""
    if len(stats) == 1:
        return stats[0]
    out = {}
    counts = np.asarray([float(s["count"][0]) for s in stats])
    w = counts / counts.sum()
    if all("mean" in s and "std" in s for s in stats):
        mean = sum(wi * s["mean"] for wi, s in zip(w, stats))
        var = sum(wi * (s["std"] ** 2 + s["mean"] ** 2) for wi, s in zip(w, stats)) - mean**2
        out.update(mean=mean, std=np.sqrt(np.maximum(var, 0.0)))
    for name, fn in (("min", np.minimum), ("max", np.maximum), ("q01", np.minimum), ("q99", np.maximum)):
        if all(name in s for s in stats):
            out[name] = fn.reduce([s[name] for s in stats])
    return out


class _EpisodeCache:
    """Whole decoded episodes of one worker, least recently used first out."""

    def __init__(self, sources: list[DroidSource], size: int):
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
        u = _rng("interleave", self.mixture.seed, epoch, shard).random(n)
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
        d, e, t, rep, piece = d[skip:], e[skip:], t[skip:], rep[skip:], piece[skip:]
        if len(piece) == 0:
            return
        # A piece is opened once, as a window that decodes its frames forward and holds only those
        # a later sample of it can still need, and closed after its last sample. Per-piece
        # bookkeeping is vectorised; per-sample values are walked in chunks (never a Python object
        # per sample of the whole shard).
        local = piece - piece.min()
        remaining = np.bincount(local)
        first = np.full(len(remaining), np.iinfo(np.int64).max)
        last = np.full(len(remaining), -1)
        np.minimum.at(first, local, t)
        np.maximum.at(last, local, t)
        open_pieces: dict[int, Episode] = {}
        try:
            for lo in range(0, len(piece), 4096):
                chunk = zip(d[lo : lo + 4096].tolist(), e[lo : lo + 4096].tolist(), t[lo : lo + 4096].tolist(),
                            rep[lo : lo + 4096].tolist(), local[lo : lo + 4096].tolist())
                for ds, ep, frame, r, p in chunk:
                    loaded = open_pieces.get(p)
                    if loaded is None:
                        loaded = open_pieces[p] = self._open(ds, ep, int(first[p]), int(last[p]))
                    yield self.mixture.sources[ds].sample(loaded, frame, epoch, r)
                    remaining[p] -= 1
                    if remaining[p] == 0:
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
        return source.sample(self._cache.get(d, e), t, epoch, int(plan.repeat[piece[0]]))


SPLITS = ("val", "all")


class ValidationDataset(Dataset):
    """Every validation sample of every dataset (``split="all"``: every sample the filters keep), in
    (dataset, episode, frame) order; fixed randomness.

    Read in that order (as the validation loader does), an episode is decoded forward through one
    window (:class:`~slurmvla.data.droid.EpisodeWindow`) and never held whole; an index out of
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

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        d, e, t = (int(v) for v in self.rows[i])
        if self._window is None or self._window[:2] != (d, e) or t < self._window[2]:
            if self._window is not None:
                self._window[3].close()
            self._window = (d, e, t, self.mixture.sources[d].open_episode(e, t, int(self._episode_last[i])))
        window = self._window[3]
        self._window = (d, e, t, window)
        return self.mixture.sources[d].sample(window, t, self.EPOCH)


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

