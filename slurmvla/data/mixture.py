"""Weighted mixtures of LeRobot-format datasets and their epoch plan.

The **epoch plan** is a pure function of ``(seed, epoch)``: every dataset contributes a quota of
samples proportional to its weight (the quotas sum to the mixture's train samples; a dataset whose
quota exceeds its size repeats with a fresh episode order), its episodes are shuffled, and the
pieces of all datasets are shuffled together into one sequence of episode pieces. The datasets that
walk the plan are in :mod:`slurmvla.data.datasets`; the normalization statistics in
:mod:`slurmvla.data.normalization`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slurmvla.config.data import DataConfig
from slurmvla.data.normalization import offset_scale, pool_stats
from slurmvla.data.source import LeRobotSource, dataset_specs, seeded_int
from slurmvla.data.spec import DataFeatures, SampleSpec


def seeded_rng(*parts: object) -> np.random.Generator:
    """A generator that is a pure function of ``parts``: the plan's and the stream's orders depend on nothing else."""
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
        self.sources = [LeRobotSource(spec, cfg, sample_spec, seed, i) for i, spec in enumerate(dataset_specs(cfg))]
        sizes = {s.name: s.frame_hw for s in self.sources}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the datasets of one mixture record frames of different sizes ({sizes}) and this policy "
                             "resizes frames itself from their recorded size, so a batch needs one size; mix datasets "
                             "recorded at one size")
        dims = {(s.state_dim, s.action_dim, s.label_dim) for s in self.sources}
        if len(dims) > 1:
            raise ValueError("the datasets of one mixture must share state, action and label dims (one policy reads "
                             "them); " + ", ".join(f"{s.name}: state {s.state_dim}, action {s.action_dim}, label "
                                                   f"{s.label_dim}" for s in self.sources))
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
    def episodes_per_epoch(self) -> int:
        """Training episodes the datasets with a quota hold (an epoch reads each about once)."""
        return int(sum(len(s.train_index.episodes) for s, q in zip(self.sources, self.quota) if q > 0))

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
                order = seeded_rng("episodes", self.seed, epoch, d, repeat).permutation(len(episodes))
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
        order = seeded_rng("pieces", self.seed, epoch).permutation(len(cols[0]))
        return Plan(*(c[order] for c in cols))

    def normalization(self, state_mode: str, action_mode: str, knobs: tuple[str | None, str | None] = (None, None)
                      ) -> dict[str, torch.Tensor]:
        """Offset / scale per state and action dim from the datasets' stats, pooled across the mixture:
        ``normalized = (x - offset) / scale``. Under ``data.delta_actions`` the actions' are those of the
        actions training sees, deltas included (:meth:`LeRobotSource.delta_action_stats`)."""
        out = {}
        for (prefix, keys, mode), knob in zip((("state", self.cfg.state_keys, state_mode),
                                               ("action", self.cfg.action_keys, action_mode)), knobs):
            dim = self.sources[0].state_dim if prefix == "state" else self.sources[0].action_dim
            if mode == "identity":
                stats = {}
            elif prefix == "action" and self.cfg.delta_actions:
                stats = pool_stats([s.delta_action_stats() for s in self.sources])
            else:
                stats = pool_stats([s.raw_stats(keys) for s in self.sources])
            out.update(offset_scale(stats, mode, dim, prefix, f"{keys}, which {self.names} do not all have", knob))
        return out

    def summary(self) -> dict:
        """Counts per dataset, for logs and ``python -m slurmvla.inspect``."""
        out = {}
        for s, w, q in zip(self.sources, self.weights, self.quota):
            c = dict(s.index.counts)
            out[s.name] = {
                "root": str(s.meta.root), "format": s.meta.version, "weight": float(w), "samples_per_epoch": int(q),
                **c, "train_episodes": int(len(s.train_index.episodes)), "val_episodes": int(len(s.val_index.episodes)),
                "train_samples": s.train_index.num_samples, "val_samples": s.val_index.num_samples,
            }
        return out
