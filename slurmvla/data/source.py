"""One LeRobot-format dataset (DROID or any other) as a sample source: metadata, filters, split, stats, samples.

A sample is a dict of tensors plus provenance (``dataset_index``, ``dataset_name``, ``control_mode``,
``episode_index``, ``frame_index``, ``mode``). State and actions are raw; the policy owns the
normalization (``normalization()`` gives it offset / scale buffers), so an exported policy
normalizes by itself.

Reading goes through episodes: :meth:`LeRobotSource.load_episode` reads one episode's frame columns
and decodes the frame range it needs of each camera in one forward pass; :meth:`LeRobotSource.sample`
cuts samples from that. The stream and the map-style datasets (``slurmvla.data.datasets``) only decide
which episodes to load and in which order.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slurmvla.config.data import JOINT_MODE, SAMPLE_MODES, DataConfig, KeepRangesConfig, check_delta_actions
from slurmvla.data.augment import Augmenter
from slurmvla.data.delta import chunk_action_stats, chunk_actions
from slurmvla.data.facts import cached_arrays, episode_values
from slurmvla.data.images import ImageReader, decode_images
from slurmvla.data.index import SampleIndex, build_index, keep_range_keys
from slurmvla.data.keep_ranges import load_keep_ranges, read_json
from slurmvla.data.lerobot_format import CAMERA_DTYPES, LeRobotMetadata
from slurmvla.data.processor import Processor
from slurmvla.data.spec import DataFeatures, SampleSpec
from slurmvla.data.video import FrameReader, decode_range, read_concurrently

log = logging.getLogger("slurmvla")
ID_TO_PATH = ('one JSON object {"<episode_id>": "<lab>/<success|failure>/<date>/<folder>"} (DROID\'s '
              'episode_id_to_path.json)')


@dataclass(frozen=True)
class DatasetSpec:
    """What differs between the datasets of one mixture; the rest of ``data`` is shared."""

    name: str
    root: Path
    weight: float
    control_mode: str
    success_only: bool
    keep_ranges: KeepRangesConfig


def dataset_specs(cfg: DataConfig) -> list[DatasetSpec]:
    first = DatasetSpec(cfg.name, cfg.resolved_root, cfg.weight, cfg.control_mode, cfg.success_only, cfg.keep_ranges)
    rest = [DatasetSpec(name, Path(m.root).expanduser() if m.root is not None else cfg.sample_root(), m.weight,
                        m.control_mode, m.success_only, m.keep_ranges) for name, m in cfg.mixture.items()]
    return [first, *rest]


def _existing(key: str, path: str) -> Path:
    """A configured file, checked where it is opened (a saved config must validate on any machine)."""
    resolved = Path(path).expanduser()
    if resolved.is_dir():
        raise ValueError(f"{key}={path!r} is a directory; give the file itself")
    if resolved.is_symlink() and not resolved.exists():
        raise ValueError(f"{key}={path!r} is a broken symbolic link (to {str(resolved.readlink())!r}, which does not exist)")
    if resolved.exists() and not resolved.is_file():
        raise ValueError(f"{key}={path!r} is not a regular file (a pipe, socket or device); give the file itself")
    if not resolved.is_file():
        raise ValueError(f"{key}={path!r} does not exist")
    return resolved


def seeded_int(*parts: object) -> int:
    """A 64-bit integer that depends only on ``parts`` (stable across processes and Python runs)."""
    return int.from_bytes(hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


@dataclass
class Episode:
    """One loaded episode: its columns and the decoded frames ``[first_frame, first_frame + len)``."""

    pos: int
    state: np.ndarray  # [T, state_dim] float32
    action: np.ndarray  # [T, action_dim] float32
    instructions: list[list[str]]  # per frame, the non-empty candidates
    frames: np.ndarray  # [n, num_cams, H, W, 3] uint8, frames first_frame .. first_frame + n
    first_frame: int
    present: np.ndarray  # [num_cams] bool: camera exists in the dataset
    labels: np.ndarray | None = None  # [T, label_dim] float32: data.label_keys, or None without them

    def images(self, frames: np.ndarray) -> np.ndarray:
        """``[len(frames), num_cams, H, W, 3]`` uint8: the cameras' images at these frame indices."""
        return self.frames[frames - self.first_frame]

    def close(self) -> None:
        pass


class EpisodeWindow(Episode):
    """An episode whose frames are decoded forward on demand, a block at a time (the cameras in
    parallel), and dropped as soon as no later request can need them. Requests must come in
    non-decreasing order of their earliest frame (a sample's history, then the next sample's):
    memory is the history window plus one block, whatever the episode's length."""

    # Frames decoded at a time (every camera in parallel). Each open piece holds up to two blocks, and a worker
    # interleaves data.interleave_episodes pieces: the smallest block that keeps the samples/s (docs/data.md).
    BLOCK = 4

    def __init__(self, pos: int, state: np.ndarray, action: np.ndarray, instructions: list[list[str]],
                 present: np.ndarray, readers: list, first_frame: int, num_frames: int, frame_shape: tuple,
                 labels: np.ndarray | None = None):
        super().__init__(pos, state, action, instructions, np.zeros((0,), np.uint8), first_frame, present, labels)
        self.frame_shape = (len(present), *frame_shape)  # [cams, H, W, 3] of one frame
        self.readers = readers  # per camera: a FrameReader or ImageReader, or None for an absent camera (black, masked)
        self.end = first_frame + num_frames
        # (first frame, frames, per camera its pictures [n, h, w, 3] without the padding, or None), oldest
        # first: a padded 16:9 frame is 44 % black, which the window need not hold (the samples' images pad).
        self.blocks: list[tuple[int, int, list[np.ndarray | None]]] = []
        self.decoded_to = first_frame  # frames below this were decoded
        self.dropped_to = first_frame  # frames below this are gone

    def images(self, frames: np.ndarray) -> np.ndarray:
        lo, hi = int(frames.min()), int(frames.max())
        if lo < self.dropped_to or hi >= self.end:
            raise RuntimeError(f"episode {self.pos}: frames {lo}..{hi} requested, but the window holds "
                               f"{self.dropped_to}..{self.end - 1} and moves forward only")
        while self.blocks and self.blocks[0][0] + self.blocks[0][1] <= lo:
            self.blocks.pop(0)
        self.dropped_to = lo
        while self.decoded_to <= hi:
            self._decode_block()
        out = np.zeros((len(frames), *self.frame_shape), np.uint8)
        for i, f in enumerate(frames.tolist()):
            for start, n, pictures in self.blocks:
                if start <= f < start + n:
                    for c, picture in enumerate(pictures):
                        if picture is not None:
                            top, left = self.readers[c].placement
                            out[i, c, top : top + picture.shape[1], left : left + picture.shape[2]] = picture[f - start]
                    break
        return out

    def _decode_block(self) -> None:
        n = min(self.BLOCK, self.end - self.decoded_to)
        live = [c for c, r in enumerate(self.readers) if r is not None]
        pictures: list[np.ndarray | None] = [None] * len(self.readers)
        for c, picture in zip(live, read_concurrently([self.readers[c] for c in live], n, picture_only=True)):
            pictures[c] = picture
        self.blocks.append((self.decoded_to, n, pictures))
        self.decoded_to += n

    @property
    def buffered_frames(self) -> int:
        return sum(n for _, n, _ in self.blocks)

    def close(self) -> None:
        for r in self.readers:
            if r is not None:
                r.close()
        self.blocks = []


class LeRobotSource:
    """One dataset of a mixture, read in LeRobot's format (v3.0 or v2.1): DROID's port or any other."""

    def __init__(self, spec: DatasetSpec, cfg: DataConfig, sample_spec: SampleSpec, seed: int, dataset_index: int = 0):
        """``spec``: which dataset; ``cfg``: what every dataset of the mixture shares; ``sample_spec``:
        what the policy needs its samples to look like."""
        self.spec, self.cfg, self.sample_spec = spec, cfg, sample_spec
        # What a recorded chunk and instruction become for the policy (the server's and evaluation's too).
        self.processor = Processor(cfg, sample_spec)
        self.seed, self.dataset_index = seed, dataset_index
        self.meta = meta = LeRobotMetadata(spec.root)
        meta.require_features([*cfg.state_keys, *cfg.action_keys], needed_by="the policy (data.state_keys, data.action_keys)")
        meta.require_features(cfg.label_keys, needed_by="data.label_keys, training labels; data.label_keys=[] if the "
                              "policy trains on none")
        self.cameras = [c for c in cfg.cameras if c in meta.features]
        missing = [c for c in cfg.cameras if c not in meta.features]
        if missing and cfg.missing_cameras == "fail":
            raise ValueError(
                f"dataset {str(meta.root)!r} has no camera {missing[0]!r} (data.cameras={list(cfg.cameras)}); its "
                f"cameras (video or image features): {meta.camera_keys}. Set data.cameras to those, or "
                "data.missing_cameras=pad to pad absent cameras with a masked black image"
            )
        if not self.cameras:
            raise ValueError(f"dataset {str(meta.root)!r} has none of data.cameras={list(cfg.cameras)}; its cameras "
                             f"(video or image features): {meta.camera_keys}")
        for cam in self.cameras:
            if meta.features[cam].get("dtype") not in CAMERA_DTYPES:
                raise ValueError(f"feature {cam!r} in {meta.root} is not a camera (dtype "
                                 f"{meta.features[cam].get('dtype')!r}, not one of {list(CAMERA_DTYPES)}); its cameras "
                                 f"(video or image features): {meta.camera_keys}")
        self.present = np.asarray([c in meta.features for c in cfg.cameras])
        self.frame_hw = self._frame_hw(sample_spec.image_size)
        # Frame offsets of the observation history, oldest first, the current frame last.
        self.history_offsets = -cfg.history_interval * np.arange(sample_spec.num_obs_history - 1, -1, -1)
        self.instruction_keys = [k for k in cfg.instruction_keys if k in meta.features]
        self.use_task = not self.instruction_keys and "task_index" in meta.features and bool(meta.tasks)
        if not self.instruction_keys and not self.use_task:
            raise ValueError(f"dataset {str(meta.root)!r} has none of the instruction features "
                             f"{list(cfg.instruction_keys)} and no task table; features it has: {sorted(meta.features)}")
        self.state_dim = sum(meta.feature_dim(k) for k in cfg.state_keys)
        self.action_dim = sum(meta.feature_dim(k) for k in cfg.action_keys)
        self.label_dim = sum(meta.feature_dim(k) for k in cfg.label_keys)
        check_delta_actions(cfg.delta_actions, self.action_dim, self.state_dim,
                            f"{list(cfg.action_keys)} of {str(meta.root)!r}", f"{list(cfg.state_keys)}")
        # Per camera where its frames are: a video's file and time range per episode, or (image cameras, LeRobot's
        # dtype "image") the data files' column, read through the episode's rows (slurmvla.data.images).
        self.videos = {cam: meta.video_location(cam) for cam in self.cameras if cam not in meta.image_keys}
        self.images = [cam for cam in self.cameras if cam in meta.image_keys]
        self.index = self._build_index()
        if self.index.num_samples == 0:
            raise ValueError(f"no samples left in {meta.root} after filtering (success_only={spec.success_only}, "
                             f"keep_ranges.path={spec.keep_ranges.path!r}); counts: {self.index.counts}")
        self.train_index, self.val_index = self._split()
        self.augmenter = None if cfg.augment == "none" else Augmenter(cfg.augment, cfg.cameras, cfg.augment_wrist_cameras)

    # -- index, filters, split --------------------------------------------------------------------

    def _build_index(self) -> SampleIndex:
        meta, spec = self.meta, self.spec
        mask = None
        if spec.success_only:
            meta.require_features(["is_episode_successful"], needed_by="success_only=true")
            mask = episode_values(meta, "is_episode_successful", self.cfg.cache_dir).astype(bool)
        lengths = meta.episodes["length"]
        kr = spec.keep_ranges
        if kr.path is None:
            return build_index(lengths, mask)
        ranges = load_keep_ranges(_existing("data.keep_ranges.path", kr.path))
        column = kr.relative_path_column or kr.episode_id_column
        values = meta.episode_strings(column)
        if values is None:
            raise ValueError(
                f"the keep-ranges filter needs each episode's DROID id or relative path, but {meta.root} has no "
                f"{column!r} column in its episode metadata; set keep_ranges.episode_id_column / relative_path_column "
                "to the column that has it, or unset keep_ranges.path (this dataset cannot be filtered)"
            )
        mapping = None
        if kr.relative_path_column is None:
            if kr.episode_id_to_path is None:
                raise ValueError("keep_ranges.episode_id_to_path is needed to turn episode ids into keep-ranges "
                                 "keys (or set keep_ranges.relative_path_column)")
            mapping = read_json(_existing("data.keep_ranges.episode_id_to_path", kr.episode_id_to_path), ID_TO_PATH)
            if not isinstance(mapping, dict):
                raise ValueError(f"{kr.episode_id_to_path}: expected {ID_TO_PATH}, got a JSON {type(mapping).__name__}")
        keys = keep_range_keys(values, mapping)
        index = build_index(lengths, mask, keys, ranges, self.sample_spec.action_horizon, kr.semantics)
        c = index.counts
        log.info("%s: keep-ranges (%s) kept %d of %d episodes and %d of %d frames; %d episodes absent from the file, "
                 "%d without a key", spec.name, kr.semantics, c["episodes_kept"], c["episodes_selected"],
                 c["frames_kept"], c["frames_selected"], c["episodes_absent"], c["episodes_unkeyed"])
        if c["episodes_selected"] and c["episodes_unkeyed"] == c["episodes_selected"]:
            raise ValueError(f"no episode of {meta.root} could be keyed into the keep-ranges file through "
                             f"{column!r}; the filter cannot be applied to this dataset")
        return index

    def _split(self) -> tuple[SampleIndex, SampleIndex]:
        episodes = self.index.episodes
        num_val = int(round(len(episodes) * self.cfg.val_fraction))
        if self.cfg.val_fraction > 0 and num_val == len(episodes):
            num_val -= 1  # never the whole dataset
        g = np.random.default_rng(seeded_int("split", self.cfg.split_seed, self.spec.name) % 2**63)
        val = np.sort(g.permutation(episodes)[:num_val])
        train = np.setdiff1d(episodes, val)
        return self.index.subset(train), self.index.subset(val)

    # -- statistics -------------------------------------------------------------------------------

    def raw_stats(self, keys: list[str]) -> dict[str, np.ndarray]:
        """Concatenated stats of ``keys`` (mean/std/min/max and q01/q99 where every key has them)."""
        parts = []
        for k in keys:
            s = self.meta.stats.get(k)
            if s is None:
                raise ValueError(f"dataset {str(self.meta.root)!r} has no stats for {k!r} (meta/stats.json or "
                                 f"meta/episodes_stats.jsonl); stats it has: {sorted(self.meta.stats)}")
            parts.append(s)
        out = {}
        for name in ("mean", "std", "min", "max", "q01", "q99"):
            if all(name in p for p in parts):
                out[name] = np.concatenate([np.asarray(p[name], np.float64).reshape(-1) for p in parts])
        out["count"] = np.asarray([float(np.asarray(parts[0].get("count", [self.meta.num_frames])).reshape(-1)[0])])
        return out

    def delta_action_stats(self) -> dict[str, np.ndarray]:
        """The action statistics under ``data.delta_actions``: of the actions training sees (deltas where
        flagged), every step inside the episode of the chunks starting at the training split's frames, up to
        ``data.delta_stats_frames`` of them (whole episodes in a seeded order). Read from the data files
        once and cached (:func:`slurmvla.data.facts.cached_arrays`)."""
        cfg, index = self.cfg, self.train_index
        horizon = self.sample_spec.action_horizon
        episodes = np.random.default_rng(seeded_int("delta_stats", self.spec.name) % 2**63).permutation(index.episodes)
        take = int(np.searchsorted(np.cumsum(index.ep_count[episodes]), cfg.delta_stats_frames, side="left")) + 1
        episodes = np.sort(episodes[:take])
        # What is read and how: the cache is another file when any of it changes.
        selection = hashlib.blake2b(b"".join(np.ascontiguousarray(a, np.int64).tobytes() for a in (
            index.seg_ep, index.seg_start, index.seg_len, episodes)), digest_size=12).hexdigest()
        key = (f"delta_action_stats:{list(cfg.state_keys)}:{list(cfg.action_keys)}:{list(cfg.delta_actions)}:"
               f"h{horizon}:{selection}")

        def compute() -> dict[str, np.ndarray]:
            parts = []
            for pos in episodes.tolist():
                length = int(self.meta.episodes["length"][pos])
                cols = self.meta.read_episode(pos, [*cfg.state_keys, *cfg.action_keys])
                state, action = (np.concatenate([cols[k].reshape(length, -1) for k in keys], axis=1).astype(np.float32)
                                 for keys in (cfg.state_keys, cfg.action_keys))
                segments = index.seg_ep == pos
                starts = np.concatenate([np.arange(s, s + n) for s, n in zip(index.seg_start[segments],
                                                                            index.seg_len[segments])])
                parts.append(chunk_actions(action, state, starts, horizon, cfg.delta_actions))
            return chunk_action_stats(np.concatenate(parts))

        return cached_arrays(self.meta, key, cfg.cache_dir, compute, f"the delta actions' statistics ({self.name})")

    # -- reading ----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    def features(self) -> DataFeatures:
        cfg = self.cfg
        return DataFeatures(str(self.meta.root), tuple(cfg.cameras), tuple(cfg.state_keys), self.state_dim,
                            tuple(cfg.action_keys), self.action_dim)

    def _columns(self, pos: int) -> tuple[np.ndarray, np.ndarray, list[list[str]], np.ndarray | None]:
        """State, action, per-frame instruction candidates and labels (``data.label_keys``; None without them)
        of episode ``pos``."""
        meta, cfg = self.meta, self.cfg
        length = int(meta.episodes["length"][pos])
        cols = meta.read_episode(pos, [*cfg.state_keys, *cfg.action_keys, *cfg.label_keys, *self.instruction_keys,
                                       *(["task_index"] if self.use_task else [])])
        state = np.concatenate([cols[k].reshape(length, -1) for k in cfg.state_keys], axis=1).astype(np.float32)
        action = np.concatenate([cols[k].reshape(length, -1) for k in cfg.action_keys], axis=1).astype(np.float32)
        labels = None
        if cfg.label_keys:
            labels = np.concatenate([cols[k].reshape(length, -1) for k in cfg.label_keys], axis=1).astype(np.float32)
        if self.use_task:
            instructions = [[meta.tasks.get(int(i), "")] for i in cols["task_index"].reshape(-1)]
        else:
            instructions = [[s for s in row if s] for row in zip(*(cols[k].reshape(-1) for k in self.instruction_keys))]
        return state, action, instructions, labels

    def _frame_hw(self, size: int | None) -> tuple[int, int]:
        """``(H, W)`` of the frames samples carry: ``size`` x ``size``, or the videos' own size when the
        policy resizes them itself (``SampleSpec.image_size=None``; every camera must share it)."""
        if size is not None:
            return size, size
        shapes = {cam: self.meta.frame_hw(cam) for cam in self.cameras}
        if len(set(shapes.values())) > 1:
            raise ValueError(f"dataset {str(self.meta.root)!r}: the cameras' frames differ in size ({shapes}); this "
                             "policy resizes frames itself from their recorded size, so a batch needs one size: choose "
                             "cameras (data.cameras) that share it")
        return next(iter(shapes.values()))

    def _frame_range(self, pos: int, first: int | None, last: int | None) -> tuple[int, int]:
        """Frames ``[lo, hi)`` that samples starting at ``first..last`` need, with their history."""
        length = int(self.meta.episodes["length"][pos])
        first = 0 if first is None else first
        last = length - 1 if last is None else last
        return max(0, first + int(self.history_offsets[0])), last + 1

    def load_episode(self, pos: int, first: int | None = None, last: int | None = None) -> Episode:
        """Columns of episode ``pos`` and its frames for sample start frames ``first..last`` (inclusive),
        with the history they need, decoded forward in one pass per camera."""
        meta, cfg = self.meta, self.cfg
        state, action, instructions, labels = self._columns(pos)
        lo, hi = self._frame_range(pos, first, last)
        size = self.sample_spec.image_size
        frames = np.empty((hi - lo, len(cfg.cameras), *self.frame_hw, 3), dtype=np.uint8)
        for c, cam in enumerate(cfg.cameras):
            if not self.present[c]:
                frames[:, c] = 0
                continue
            if cam in self.images:
                decode_images(meta, pos, cam, lo, hi - lo, size, out=frames[:, c], resize=cfg.image_resize)
                continue
            loc = self.videos[cam]
            t0 = float(loc.from_ts[pos]) + lo / meta.fps
            # Decoded straight into this camera's slot: no second copy of the frames.
            decode_range(loc.paths[pos], t0, t0 + (hi - lo) / meta.fps, meta.fps, size, out=frames[:, c],
                         resize=cfg.image_resize)
        return Episode(pos, state, action, instructions, frames, lo, self.present, labels)

    def open_episode(self, pos: int, first: int | None = None, last: int | None = None) -> EpisodeWindow:
        """Like :meth:`load_episode`, but frames are decoded on demand and dropped when passed (see
        :class:`EpisodeWindow`): for readers that visit an episode's samples in frame order."""
        meta, cfg = self.meta, self.cfg
        state, action, instructions, labels = self._columns(pos)
        lo, hi = self._frame_range(pos, first, last)
        size = self.sample_spec.image_size
        readers = []
        try:
            for c, cam in enumerate(cfg.cameras):
                if not self.present[c]:
                    readers.append(None)
                elif cam in self.images:
                    readers.append(ImageReader(meta, pos, cam, lo, hi - lo, size, cfg.image_resize, ImageReader.CHUNK))
                else:
                    loc = self.videos[cam]
                    readers.append(FrameReader(loc.paths[pos], float(loc.from_ts[pos]) + lo / meta.fps, hi - lo,
                                               meta.fps, size, cfg.image_resize))
        except Exception:
            for r in readers:
                if r is not None:
                    r.close()
            raise
        return EpisodeWindow(pos, state, action, instructions, self.present, readers, lo, hi - lo, (*self.frame_hw, 3),
                             labels)

    def _instruction(self, episode: Episode, t: int) -> str:
        options = episode.instructions[t]
        if not options:
            return ""
        # Seeded by (seed, dataset, episode, frame): the same on every worker, world size and resume.
        return options[seeded_int(self.seed, self.dataset_index, episode.pos, t) % len(options)]

    def history_frames(self, t: int) -> np.ndarray:
        """The frames the sample starting at ``t`` shows (its history, clipped at the episode start)."""
        return np.maximum(t + self.history_offsets, 0)

    def sample(self, episode: Episode, t: int, epoch: int, repeat: int = 0, train: bool = False) -> dict:
        """The sample starting at frame ``t``. Its training randomness (flow-matching noise and time,
        the mode under data.mode=joint, and with ``train`` the image augmentation, data.augment) is a
        pure function of (seed, epoch, sample, repeat). Only the training readers pass ``train``."""
        cfg, horizon = self.cfg, self.sample_spec.action_horizon
        length = len(episode.state)
        chunk = np.arange(t, t + horizon)
        valid = chunk < length
        # Past the episode end the last value repeats; the mask keeps it out of the loss.
        actions = episode.action[np.minimum(chunk, length - 1)]
        actions = self.processor.to_policy(actions, episode.state[t])  # relative to the current state, if deltas
        hist = t + self.history_offsets
        hist_ok = hist >= 0
        hist = self.history_frames(t)
        images = episode.images(hist)  # [n_hist, cams, H, W, 3]
        image_mask = hist_ok[:, None] & episode.present[None, :]
        state = episode.state[hist]
        instruction = self._instruction(episode, t)
        key = seeded_int(self.seed, epoch, self.dataset_index, episode.pos, t, repeat)
        g = torch.Generator().manual_seed(key % 2**63)
        out = {
            # Channels-last as decoded; the policy permutes on the device.
            "images": torch.from_numpy(images.reshape(-1, *images.shape[2:])),
            "image_mask": torch.from_numpy(image_mask.reshape(-1)),
            "state": torch.from_numpy(state[0] if len(state) == 1 else state),
            "actions": torch.from_numpy(actions),
            "action_mask": torch.from_numpy(valid),
            "instruction": instruction,
            # The policy's own randomness (e.g. flow-matching noise and time), drawn in its order.
            **self.sample_spec.draw(g),
            "dataset_index": torch.tensor(self.dataset_index),
            "episode_index": torch.tensor(int(self.meta.episodes["episode_index"][episode.pos])),
            "frame_index": torch.tensor(t),
            "dataset_name": self.name,
            "control_mode": self.spec.control_mode,
        }
        if episode.labels is not None:  # training-time labels, frame for frame with the state
            labels = episode.labels[hist]
            out["labels"] = torch.from_numpy(labels[0] if len(labels) == 1 else labels)
        out.update(self.processor.tokens(instruction))
        if cfg.mode != SAMPLE_MODES[0]:
            mode = cfg.mode if cfg.mode != JOINT_MODE else SAMPLE_MODES[int(torch.randint(len(SAMPLE_MODES), (), generator=g))]
            future = np.arange(t + 1, t + 1 + horizon)
            out["mode"] = torch.tensor(SAMPLE_MODES.index(mode))
            out["future_states"] = torch.from_numpy(episode.state[np.minimum(future, length - 1)])
            out["future_mask"] = torch.from_numpy(future < length)
        if train and self.augmenter is not None:
            # Drawn last: the policy's draws and the mode are the same with augmentation on or off.
            out["images"] = self.augmenter(out["images"], out["image_mask"], g)
        return out
