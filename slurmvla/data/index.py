"""The sample index of one dataset: which start frames of which episodes are samples.

Samples live in segments ``(episode, [start, end))`` of start frames, so the index costs memory per
segment and per episode, never per frame: DROID's 27.6M frames in ~95k episodes index in
megabytes. Every lookup is vectorised (``frames_of`` maps many ``(episode, k-th sample)`` pairs at once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from slurmvla.data.keep_ranges import KeepRanges, episode_key

log = logging.getLogger("slurmvla")


@dataclass
class SampleIndex:
    num_episodes: int  # episodes in the dataset (positions 0..n-1), kept or not
    seg_ep: np.ndarray  # int64 [num_segments], sorted by episode
    seg_start: np.ndarray  # int64 [num_segments]
    seg_len: np.ndarray  # int64 [num_segments]
    counts: dict = field(default_factory=dict)  # what the filters kept and dropped, for logs and inspect

    def __post_init__(self) -> None:
        self.seg_cum = np.concatenate([[0], np.cumsum(self.seg_len)]).astype(np.int64)
        self.ep_count = np.bincount(self.seg_ep, weights=self.seg_len, minlength=self.num_episodes).astype(np.int64)
        first = np.full(self.num_episodes, -1, dtype=np.int64)
        # Reversed so the first segment of each episode wins.
        first[self.seg_ep[::-1]] = np.arange(len(self.seg_ep))[::-1]
        self.ep_offset = np.where(first >= 0, self.seg_cum[np.maximum(first, 0)], -1)

    @property
    def num_samples(self) -> int:
        return int(self.seg_cum[-1])

    @property
    def episodes(self) -> np.ndarray:
        """Positions of the episodes that hold at least one sample."""
        return np.flatnonzero(self.ep_count > 0)

    def frames_of(self, episodes: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Start frame of the ``k``-th sample of each episode (vectorised)."""
        g = self.ep_offset[episodes] + k
        seg = np.searchsorted(self.seg_cum, g, side="right") - 1
        return self.seg_start[seg] + g - self.seg_cum[seg]

    def subset(self, keep_episodes: np.ndarray) -> SampleIndex:
        """The same index restricted to some episode positions (a train or validation split)."""
        mask = np.isin(self.seg_ep, keep_episodes)
        return SampleIndex(self.num_episodes, self.seg_ep[mask], self.seg_start[mask], self.seg_len[mask],
                           dict(self.counts))

    def nbytes(self) -> int:
        arrays = (self.seg_ep, self.seg_start, self.seg_len, self.seg_cum, self.ep_count, self.ep_offset)
        return int(sum(a.nbytes for a in arrays))


def build_index(lengths: np.ndarray, episode_mask: np.ndarray | None = None,
                keys: list[str | None] | None = None, ranges: KeepRanges | None = None,
                horizon: int = 1, semantics: str = "frame") -> SampleIndex:
    """Index the episodes with ``episode_mask`` set; with ``ranges``, keep only the keep-ranges.

    ``keys`` holds each episode's keep-ranges key (None where it could not be built). Such
    episodes are counted as ``unkeyed``; episodes whose key is absent from the file as ``absent``;
    both are dropped, as DROID's own filter drops what it has no ranges for.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    mask = np.ones(n, dtype=bool) if episode_mask is None else np.asarray(episode_mask, dtype=bool)
    candidates = np.flatnonzero(mask)
    counts = {"episodes": n, "frames": int(lengths.sum()), "episodes_selected": int(len(candidates)),
              "frames_selected": int(lengths[candidates].sum())}
    if ranges is None:
        nonempty = candidates[lengths[candidates] > 0]
        counts.update(episodes_kept=int(len(nonempty)), samples=int(lengths[nonempty].sum()))
        return SampleIndex(n, nonempty, np.zeros(len(nonempty), np.int64), lengths[nonempty], counts)
    assert keys is not None and len(keys) == n
    # Vectorised over all ranges of all candidate episodes: one Python step per episode (a dict
    # lookup), none per range or frame.
    pos = np.asarray([-2 if keys[e] is None else ranges.position.get(keys[e], -1) for e in candidates.tolist()],
                     dtype=np.int64).reshape(-1)
    unkeyed, absent = int((pos == -2).sum()), int((pos == -1).sum())
    found = pos >= 0
    eps, pos = candidates[found], pos[found]
    per_ep = ranges.offsets[pos + 1] - ranges.offsets[pos]
    rows = np.repeat(ranges.offsets[pos] - np.cumsum(per_ep) + per_ep, per_ep) + np.arange(int(per_ep.sum()))
    seg_ep = np.repeat(eps, per_ep)
    length = lengths[seg_ep]
    start = np.minimum(ranges.ranges[rows, 0], length)
    end = np.minimum(ranges.ranges[rows, 1], length)
    kept_frames = int((end - start).sum())
    if semantics == "window":
        end = end - (horizon - 1)
    elif semantics != "frame":
        raise ValueError(f"keep-ranges semantics {semantics!r} is not valid; choose one of ['frame', 'window']")
    ok = end > start
    seg_ep, seg_start, seg_len = seg_ep[ok], start[ok], (end - start)[ok]
    kept = int(len(np.unique(seg_ep)))
    counts.update(episodes_kept=kept, frames_kept=kept_frames, episodes_absent=absent, episodes_unkeyed=unkeyed,
                  episodes_without_samples=int(found.sum()) - kept, semantics=semantics, samples=int(seg_len.sum()))
    return SampleIndex(n, seg_ep, seg_start, seg_len, counts)


def keep_range_keys(episode_values: list[str | None], mapping: dict[str, str] | None) -> list[str | None]:
    """Keep-ranges keys from each episode's DROID id (through ``mapping``) or relative path (no mapping)."""
    out: list[str | None] = []
    for value in episode_values:
        rel = value if mapping is None else mapping.get(value) if value else None
        out.append(episode_key(rel) if rel else None)
    return out
