"""The data's options (``data.*``; read by ``slurmvla.data``'s sources, mixture and loaders) and the data's choice
lists. A schema module of ``slurmvla.config``: it imports no torch and nothing of ``slurmvla`` above the
configuration (layer 1; docs/architecture.md), so composing a config never loads the data layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from slurmvla.droid_features import DROID_CAMERAS, DROID_INSTRUCTION_KEYS
from slurmvla.validators import check_choice, check_positive

# What one sample is; a sample's "mode" field is its index here.
SAMPLE_MODES = ("policy", "forward_dynamics", "inverse_dynamics")
# data.mode: every sample in one sample mode, or joint: a sample mode drawn per sample.
JOINT_MODE = "joint"
DATA_MODES = (SAMPLE_MODES[0], JOINT_MODE, *SAMPLE_MODES[1:])
# data.image_resize: camera frames to the policy's square input. pad keeps the aspect ratio and
# pads with black (openpi's resize-with-pad, what pretrained SigLIP backbones expect); squash stretches.
IMAGE_RESIZE_MODES = ("pad", "squash")
# data.keep_ranges.semantics: frame (the start frame lies in a kept range) or window (the whole action chunk does).
KEEP_RANGE_SEMANTICS = ("frame", "window")
ON_DAMAGED = ("skip", "error")
DATA_LOADERS = ("stream", "map")
# The sample dataset's generator revision (part of its cache folder's name): a changed generator
# writes a new copy instead of reusing an older one.
SAMPLE_REVISION = "v3.0_av1_r2"
NORMALIZATIONS = ("mean_std", "min_max", "quantile", "identity")
MISSING_CAMERA_CHOICES = ("fail", "pad")
# Training image augmentation (slurmvla.data.augment): none, or openpi's preprocess_observation(train=True).
IMAGE_AUGMENTATIONS = ("none", "openpi")


@dataclass
class KeepRangesConfig:
    # The DROID keep-ranges JSON (keep_ranges_1_0_1.json); null turns the filter off.
    path: str | None = None
    # episode_id -> relative path mapping (episode_id_to_path.json), read with episode_id_column.
    episode_id_to_path: str | None = None
    episode_id_column: str = "episode_id"
    # Or a column that already holds the relative path (used when set).
    relative_path_column: str | None = None
    # frame: the start frame lies in a range; window: the whole action chunk does.
    semantics: str = "frame"

    def __post_init__(self) -> None:
        check_choice("data.keep_ranges.semantics", self.semantics, KEEP_RANGE_SEMANTICS)


def check_delta_actions(flags: list[bool] | None, action_dim: int, state_dim: int, action_where: str = "action dims",
                        state_where: str = "state dims") -> None:
    """``data.delta_actions`` fits the actions and the state: a flag per action dim from the first, each
    true one naming the state dim at the same index (openpi's DeltaActions reads ``state[..., :len(mask)]``)."""
    if not flags:
        return
    if len(flags) > min(action_dim, state_dim):
        raise ValueError(f"data.delta_actions={list(flags)} has {len(flags)} flags, but the actions have {action_dim} "
                         f"dims ({action_where}) and the state {state_dim} ({state_where}); give at most "
                         f"{min(action_dim, state_dim)} flags, one per action dim from the first (a true one subtracts "
                         "the state's dim at the same index), or null for absolute actions")


@dataclass
class MixtureMember:
    """One more dataset of a weighted mixture (the top-level ``data`` fields describe the first)."""

    # null: the embedded DROID-format sample dataset.
    root: str | None = None
    weight: float = 1.0
    control_mode: str = "joint_position"
    success_only: bool = False
    keep_ranges: KeepRangesConfig = field(default_factory=KeepRangesConfig)


@dataclass
class DataConfig:
    name: str = "droid"
    # A LeRobot-format dataset (v3.0 or v2.1). null means the small DROID-format sample dataset,
    # written on first use into cache_dir (python -m slurmvla.data.synthetic writes it by hand).
    root: str | None = None
    cache_dir: str = "${oc.env:SLURMVLA_CACHE,${oc.env:HOME}/.cache/slurmvla}"
    sample_episodes: int = 48
    cameras: list[str] = field(default_factory=lambda: list(DROID_CAMERAS))
    # A camera the dataset lacks: fail, or pad with a black image whose image_mask entry is false.
    missing_cameras: str = "fail"
    # Camera frames to the policy's square image_size: pad (keep the aspect ratio, pad with black,
    # as openpi's resize-with-pad; what pretrained backbones expect) or squash (stretch). Training,
    # validation, evaluate and the policy server all resize through one function.
    image_resize: str = "pad"
    # Training image augmentation, applied to training samples only (never validation, evaluation or the
    # server), drawn from each sample's generator: none, or openpi (its preprocess_observation(train=True):
    # non-wrist cameras cropped to 95 %, resized back, rotated up to 5 degrees; every camera colour-jittered).
    augment: str = "none"
    # Which of data.cameras are wrist cameras (jittered, never cropped or rotated); null: openpi's rule, a
    # camera whose key contains "wrist".
    augment_wrist_cameras: list[str] | None = None
    # Concatenated in order: e.g. [observation.state] or its sub-keys
    # [observation.state.joint_position, observation.state.gripper_position].
    state_keys: list[str] = field(default_factory=lambda: ["observation.state"])
    action_keys: list[str] = field(default_factory=lambda: ["action"])
    instruction_keys: list[str] = field(default_factory=lambda: list(DROID_INSTRUCTION_KEYS))
    # Training-time labels: features read frame for frame beside the state (the observation history's frames),
    # concatenated in order into the batch's "labels" ([B, history, D], raw), for a policy's auxiliary loss (a
    # simulator's object positions, e.g. Meta-World's observation.environment_state). Never part of the state:
    # a client does not send them and serving never reads them. Empty: none.
    label_keys: list[str] = field(default_factory=list)
    # From the dataset's stats: mean_std, min_max (to [-1, 1]), quantile (q01/q99 to [-1, 1]), identity.
    state_normalization: str = "mean_std"
    action_normalization: str = "mean_std"
    # Delta actions (openpi's DeltaActions / AbsoluteActions; slurmvla/data/delta.py): one flag per action
    # dim from the first (a shorter list leaves the dims after it absolute). A true dim is trained on, and
    # predicted as, action - state (the state's dim at the same index, of the sample's current observation),
    # its statistics computed on those deltas; serving adds the observed state back. null or []: absolute.
    # E.g. DROID's joint positions with an absolute gripper: [true, true, true, true, true, true, true, false].
    delta_actions: list[bool] | None = None
    # The deltas' statistics come from the actions of the chunks starting at up to this many training
    # frames (whole episodes in a seeded order; every frame when there are fewer), computed once and cached
    # in cache_dir: the chunks of DROID's 27.6M frames would not fit in memory for exact quantiles.
    delta_stats_frames: int = 200_000
    success_only: bool = False
    keep_ranges: KeepRangesConfig = field(default_factory=KeepRangesConfig)
    control_mode: str = "joint_position"
    # This dataset's sampling weight in a mixture; more datasets go in data.mixture.<name>.
    weight: float = 1.0
    mixture: dict[str, MixtureMember] = field(default_factory=dict)
    # policy: observation -> action chunk. joint draws one of policy / forward_dynamics (observation +
    # action chunk -> future states) / inverse_dynamics (observation + future state -> action chunk)
    # per sample; each sample says which in its "mode" field.
    mode: str = "policy"
    # Observation frames per sample (the current one last), history_interval frames apart.
    num_obs_history: int = 1
    history_interval: int = 1
    # stream: episode-shuffle stream (the fast path: each episode decoded once, sequentially).
    # map: per-sample access in a global order that does not depend on the world size (debugging,
    # engine parity checks).
    loader: str = "stream"
    # Episodes interleaved by each stream worker, so one batch is not one episode.
    interleave_episodes: int = 8
    # Validation split, by episode, seeded with split_seed (independent of trainer.seed).
    val_fraction: float = 0.0
    split_seed: int = 0
    num_workers: int = 2
    # Whole decoded episodes kept per dataloader worker by the map-style reader (debugging and parity
    # checks; a DROID episode is large decoded: docs/policies.md). Validation and the stream decode through
    # forward windows instead.
    episode_cache_size: int = 64
    # Decoded episodes a stream worker keeps across epochs (0: decode every epoch). Worth it only
    # when a worker's share of the data fits in memory (the sample dataset); DROID's does not.
    stream_cache_episodes: int = 0
    # A data file that cannot be read (a video that does not decode, a parquet cut short): skip the
    # episodes it holds, each with one warning, their samples replaced deterministically so every rank keeps
    # its batch count (slurmvla/data/damaged.py); or error, the first one stopping the run.
    on_damaged: str = "skip"
    # Under skip, more damaged episodes than this share of the episodes the run reads stops it: many damaged
    # files mean the copy is wrong.
    max_damaged_share: float = 0.001

    def __post_init__(self) -> None:
        check_positive("data.num_workers", self.num_workers, allow_zero=True)
        check_choice("data.on_damaged", self.on_damaged, ON_DAMAGED)
        if not 0.0 <= self.max_damaged_share <= 1.0:
            raise ValueError(f"data.max_damaged_share={self.max_damaged_share!r} is not valid; it must be in [0, 1]")
        check_positive("data.sample_episodes", self.sample_episodes)
        check_positive("data.weight", self.weight)
        check_positive("data.num_obs_history", self.num_obs_history)
        check_positive("data.history_interval", self.history_interval)
        check_positive("data.interleave_episodes", self.interleave_episodes)
        check_positive("data.stream_cache_episodes", self.stream_cache_episodes, allow_zero=True)
        check_positive("data.delta_stats_frames", self.delta_stats_frames)
        check_choice("data.loader", self.loader, DATA_LOADERS)
        check_choice("data.mode", self.mode, DATA_MODES)
        check_choice("data.missing_cameras", self.missing_cameras, MISSING_CAMERA_CHOICES)
        check_choice("data.image_resize", self.image_resize, IMAGE_RESIZE_MODES)
        check_choice("data.augment", self.augment, IMAGE_AUGMENTATIONS)
        for cam in self.augment_wrist_cameras or []:
            if cam not in self.cameras:
                raise ValueError(f"data.augment_wrist_cameras names {cam!r}, which is not one of data.cameras="
                                 f"{list(self.cameras)}")
        check_choice("data.state_normalization", self.state_normalization, NORMALIZATIONS)
        check_choice("data.action_normalization", self.action_normalization, NORMALIZATIONS)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={self.val_fraction!r} is not valid; it must be in [0, 1)")
        if not self.cameras:
            raise ValueError("data.cameras is empty; name at least one camera feature, e.g. " f"{list(DROID_CAMERAS)}")
        for name in ("state_keys", "action_keys"):
            if not getattr(self, name):
                raise ValueError(f"data.{name} is empty; name at least one feature, e.g. observation.state / action")
        for name, member in self.mixture.items():
            check_positive(f"data.mixture.{name}.weight", member.weight)
            if name == self.name:
                raise ValueError(f"data.mixture.{name}: the name is the first dataset's (data.name={self.name!r}); "
                                 "mixture members need distinct names")

    def sample_root(self) -> Path:
        return Path(self.cache_dir).expanduser() / f"droid_sample_{SAMPLE_REVISION}_{self.sample_episodes}ep"

    @property
    def resolved_root(self) -> Path:
        return Path(self.root).expanduser() if self.root is not None else self.sample_root()
