"""The DROID dataset, map-style: one sample per frame, with its action chunk and provenance.

A sample is a dict of tensors plus provenance (``dataset_index``, ``dataset_name``,
``control_mode``, ``episode_index``, ``frame_index``). State and actions are raw; the policy owns the
normalization statistics (``stats``) as buffers, so an exported policy normalizes by itself.

Video is decoded one whole episode at a time and kept in a per-worker LRU cache: random access
never seeks per sample. The episode-shuffle stream replaces this reader for full-size DROID behind
the same sample contract.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from slurmvla.config import DataConfig
from slurmvla.data.keep_ranges import episode_key, keep_segments, load_keep_ranges
from slurmvla.data.lerobot import LeRobotDataset
from slurmvla.data.tokenizer import tokenize
from slurmvla.data.video import decode_range

log = logging.getLogger("slurmvla")


class DroidDataset(Dataset):
    def __init__(self, cfg: DataConfig, image_size: int, action_horizon: int, max_text_len: int,
                 seed: int = 0, dataset_index: int = 0):
        self.cfg = cfg
        self.image_size = image_size
        self.action_horizon = action_horizon
        self.max_text_len = max_text_len
        self.seed = seed
        self.dataset_index = dataset_index
        self.meta = LeRobotDataset(cfg.resolved_root)
        self.meta.require_features([*cfg.cameras, cfg.state_key, cfg.action_key], needed_by="the policy (data.cameras, "
                                   "data.state_key, data.action_key)")
        for cam in cfg.cameras:
            if self.meta.features[cam].get("dtype") != "video":
                raise ValueError(f"feature {cam!r} in {self.meta.root} is not a video feature; video features: "
                                 f"{self.meta.video_keys}")
        self.instruction_keys = [k for k in cfg.instruction_keys if k in self.meta.features]
        if not self.instruction_keys and "task_index" not in self.meta.features:
            raise ValueError(f"dataset {str(self.meta.root)!r} has none of the instruction features "
                             f"{list(cfg.instruction_keys)}; features it has: {sorted(self.meta.features)}")
        keys = [cfg.state_key, cfg.action_key, *self.instruction_keys]
        if cfg.success_only:
            self.meta.require_features(["is_episode_successful"], needed_by="data.success_only=true")
            keys.append("is_episode_successful")
        columns = self.meta.read_columns(keys)
        self.state = columns[cfg.state_key].astype(np.float32)
        self.action = columns[cfg.action_key].astype(np.float32)
        self.instructions = np.stack([columns[k] for k in self.instruction_keys], axis=1) if self.instruction_keys else None

        ep = self.meta.episodes
        self.ep_from = ep["dataset_from_index"].astype(np.int64)
        self.ep_to = ep["dataset_to_index"].astype(np.int64)
        self.ep_index = ep["episode_index"].astype(np.int64)
        keep = np.ones(len(self.ep_from), dtype=bool)
        if cfg.success_only:
            keep = columns["is_episode_successful"][self.ep_from].astype(bool).reshape(-1)
        lengths = self.ep_to - self.ep_from
        # Samples live in segments (episode, first start frame, end): memory per segment, never per frame.
        seg_ep, seg_start, seg_end = np.flatnonzero(keep), np.zeros(int(keep.sum()), np.int64), lengths[keep]
        if cfg.keep_ranges.path is not None:
            seg_ep, seg_start, seg_end = self._apply_keep_ranges(keep, lengths)
        if len(seg_ep) == 0:
            raise ValueError(f"no samples left in {self.meta.root} after filtering (data.success_only="
                             f"{cfg.success_only}, data.keep_ranges.path={cfg.keep_ranges.path!r})")
        self.seg_ep, self.seg_start = seg_ep, seg_start
        self.cum_lengths = np.concatenate([[0], np.cumsum(seg_end - seg_start)])
        self.kept_episodes = np.unique(seg_ep)
        self.videos = {cam: self.meta.video_location(cam) for cam in cfg.cameras}
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def _apply_keep_ranges(self, keep: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        kr = self.cfg.keep_ranges
        ranges = load_keep_ranges(kr.path)
        column = kr.relative_path_column or kr.episode_id_column
        values = self.meta.episode_strings(column)
        if values is None:
            raise ValueError(
                f"the keep-ranges filter needs each episode's DROID id or relative path, but {self.meta.root} has no "
                f"{column!r} column in meta/episodes; set data.keep_ranges.episode_id_column / relative_path_column "
                "to the column that has it, or unset data.keep_ranges.path (this dataset cannot be filtered)"
            )
        mapping = None
        if kr.relative_path_column is None:
            if kr.episode_id_to_path is None:
                raise ValueError("data.keep_ranges.episode_id_to_path is needed to turn episode ids into keep-ranges "
                                 "keys (or set data.keep_ranges.relative_path_column)")
            mapping = json.loads(Path(kr.episode_id_to_path).expanduser().read_text())
        eps, starts, ends = [], [], []
        counts = {"kept": 0, "absent": 0, "unkeyed": 0}
        for e in np.flatnonzero(keep):
            rel = values[e] if mapping is None else mapping.get(values[e])
            if not rel:
                counts["unkeyed"] += 1
                continue
            r = ranges.get(episode_key(rel))
            if r is None:
                counts["absent"] += 1
                continue
            counts["kept"] += 1
            for s, t in keep_segments(r, int(lengths[e]), self.action_horizon, kr.semantics):
                eps.append(e)
                starts.append(s)
                ends.append(t)
        total = int(lengths[keep].sum())
        kept_frames = int(sum(t - s for s, t in zip(starts, ends)))
        log.info("keep-ranges (%s): kept %d of %d episodes and %d of %d frames; %d episodes absent from the file, "
                 "%d without a key", kr.semantics, counts["kept"], int(keep.sum()), kept_frames, total,
                 counts["absent"], counts["unkeyed"])
        if counts["unkeyed"] == int(keep.sum()):
            raise ValueError(f"no episode of {self.meta.root} could be keyed into the keep-ranges file through "
                             f"{column!r}; the filter cannot be applied to this dataset")
        self.keep_ranges_counts = {**counts, "kept_frames": kept_frames, "total_frames": total}
        return np.asarray(eps, np.int64), np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Mean / std of state and action, from the dataset's stats (or computed when absent)."""
        out = {}
        for prefix, key, values in (("state", self.cfg.state_key, self.state), ("action", self.cfg.action_key, self.action)):
            s = self.meta.stats.get(key)
            mean = s["mean"] if s is not None and "mean" in s else values.mean(0)
            std = s["std"] if s is not None and "std" in s else values.std(0)
            out[f"{prefix}_mean"] = torch.as_tensor(np.asarray(mean, dtype=np.float32).reshape(-1))
            out[f"{prefix}_std"] = torch.as_tensor(np.asarray(std, dtype=np.float32).reshape(-1))
        return out

    def __len__(self) -> int:
        return int(self.cum_lengths[-1])

    def _frames(self, episode_pos: int) -> np.ndarray:
        """All cameras of one episode, ``[T, num_cams, H, W, 3]`` uint8, through the LRU cache."""
        if episode_pos in self._cache:
            self._cache.move_to_end(episode_pos)
            return self._cache[episode_pos]
        per_cam = []
        for cam in self.cfg.cameras:
            loc = self.videos[cam]
            per_cam.append(decode_range(loc.paths[episode_pos], loc.from_ts[episode_pos], loc.to_ts[episode_pos],
                                        self.meta.fps, self.image_size))
        frames = np.stack(per_cam, axis=1)
        length = self.ep_to[episode_pos] - self.ep_from[episode_pos]
        if len(frames) != length:
            raise ValueError(f"episode {self.ep_index[episode_pos]}: {len(frames)} video frames for {length} data frames")
        self._cache[episode_pos] = frames
        while len(self._cache) > self.cfg.episode_cache_size:
            self._cache.popitem(last=False)
        return frames

    def _instruction(self, row: int) -> str:
        if self.instructions is None:
            return ""
        options = [s for s in self.instructions[row] if s]
        if not options:
            return ""
        # A seeded choice that depends only on (seed, frame): the same on every worker and resume.
        digest = hashlib.blake2b(f"{self.seed}:{row}".encode(), digest_size=8).digest()
        return options[int.from_bytes(digest, "little") % len(options)]

    def sample_randomness(self, i: int, epoch: int) -> dict[str, torch.Tensor]:
        """Per-sample training randomness (flow-matching noise and time), a pure function of
        ``(seed, epoch, sample)``: the same sample gets the same draw whichever rank, worker or
        resumed run reads it, so results do not depend on the world size."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1_000_000_007 + i)
        return {"noise": torch.randn(self.action_horizon, self.action.shape[1], generator=g),
                "time_u": torch.rand((), generator=g)}

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        """``key`` is a sample index, or ``(index, epoch)`` as the EpochSampler yields them."""
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self.cum_lengths, i, side="right") - 1)
        episode_pos = int(self.seg_ep[k])
        start, end = int(self.ep_from[episode_pos]), int(self.ep_to[episode_pos])
        t = int(self.seg_start[k] + i - self.cum_lengths[k])
        row = start + t
        chunk_rows = np.arange(row, row + self.action_horizon)
        valid = chunk_rows < end
        # Past the episode end the last action repeats; the mask keeps it out of the loss.
        actions = self.action[np.minimum(chunk_rows, end - 1)]
        images = self._frames(episode_pos)[t]
        text, text_mask = tokenize(self._instruction(row), self.max_text_len)
        return {
            "images": torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))),  # [cams, 3, H, W] uint8
            "image_mask": torch.ones(len(self.cfg.cameras), dtype=torch.bool),
            "state": torch.from_numpy(self.state[row]),
            "actions": torch.from_numpy(actions),
            "action_mask": torch.from_numpy(valid),
            "text": text,
            "text_mask": text_mask,
            **self.sample_randomness(i, epoch),
            "dataset_index": torch.tensor(self.dataset_index),
            "episode_index": torch.tensor(int(self.ep_index[episode_pos])),
            "frame_index": torch.tensor(t),
            "dataset_name": self.name,
            "control_mode": self.cfg.control_mode,
        }


class EpochSampler(Sampler[tuple[int, int]]):
    """Shuffled ``(index, epoch)`` keys for one rank; the order is a pure function of ``(seed, epoch, rank)``.

    Every rank gets the same number of samples (the tail that does not divide evenly is dropped
    for the epoch), and ``set_position`` starts an epoch part-way, which is how a resumed run picks
    up the exact sample the interrupted one would have read next.
    """

    def __init__(self, num_samples: int, seed: int, rank: int = 0, world_size: int = 1):
        if num_samples < world_size:
            raise ValueError(f"dataset has {num_samples} samples, fewer than world size {world_size}")
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
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
