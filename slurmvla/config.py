"""Structured-config schemas for every Hydra config group, and their validation rules.

``slurmvla.compose`` registers ``Config`` in Hydra's ConfigStore, where it sits under
``conf/config.yaml`` as its first default, so every YAML file and command-line override is merged
into a typed node: a misspelled key or a value of the wrong type fails at composition time with
Hydra's message naming the key. Cross-field rules live in ``__post_init__`` and run when the
composed DictConfig becomes these dataclasses; they raise ``ValueError`` naming the value and the
valid choices. Names of engines, policies, schedules and data modes come from
``slurmvla.registry``. Nothing here touches the filesystem: a saved config re-validates on any
machine, and files are checked where they are opened.

What every policy has is here (``PolicyConfig``, and ``TransformerPolicyConfig`` for the built-in
policies' shared shape); each policy's own options are its schema, a subclass beside its model
(``slurmvla/policy/pi0/config.py``, ...) named by its registry entry and imported by that name when a
config is validated (:func:`policy_schema`): a schema module imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from slurmvla.droid_features import DROID_CAMERAS, DROID_INSTRUCTION_KEYS
from slurmvla.registry import (
    DATA_MODES,
    ENGINES,
    EXECUTION_MODES,
    IMAGE_RESIZE_MODES,
    POLICIES,
    SCHEDULERS,
    SIM_ENVS,
)

log = logging.getLogger("slurmvla")

PRECISIONS = ("fp32", "bf16")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# Known names that may be unavailable on a machine; they warn once and fall back to sdpa.
ATTENTION_FALLBACKS = ("fa2", "flash_attention_2")
WANDB_MODES = ("offline", "online", "disabled")
DEVICES = ("auto", "cpu", "cuda")


# What a checkpointed layer keeps besides its inputs (slurmvla/policy/recompute.py).
CHECKPOINT_SAVES = ("inputs", "matmuls")
# policy.gradient_checkpointing: on, off, or auto: the least recomputation the planner predicts fits the GPU,
# chosen at start-up (slurmvla/planner/recompute_choice.py) and saved as the concrete setting.
GRADIENT_CHECKPOINTING = (True, False, "auto")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} is not valid; it must be {bound}")


@dataclass
class EngineConfig:
    name: str = "single"
    # Process-group backend: "auto" picks nccl on CUDA and gloo on CPU.
    backend: str = "auto"
    timeout_s: int = 1800
    # Under precision=bf16: the dtype gradients are reduced in across ranks.
    reduce_dtype: str = "fp32"
    # hsdp: shard within groups of shard_degree ranks, replicate across replicate_degree groups.
    # 0 means derived: shard_degree = ranks per node, replicate_degree = world size / shard_degree.
    replicate_degree: int = 0
    shard_degree: int = 0

    def __post_init__(self) -> None:
        ENGINES.check(self.name)
        check_choice("engine.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("engine.reduce_dtype", self.reduce_dtype, ("fp32", "bf16"))
        check_positive("engine.timeout_s", self.timeout_s)
        check_positive("engine.replicate_degree", self.replicate_degree, allow_zero=True)
        check_positive("engine.shard_degree", self.shard_degree, allow_zero=True)


LORA_PARTS = ("backbone", "expert", "vision")
LORA_INITS = ("gaussian", "peft")


# Training-time real-time chunking's delay distributions (policy.rtc_training.distribution).
DELAY_DISTRIBUTIONS = ("uniform", "exp")


@dataclass
class RTCTrainingConfig:
    """``policy.rtc_training``: training-time real-time chunking (Black, Ren, Equi, Levine 2025, arXiv
    2512.05964; slurmvla/policy/rtc.py). Each sample draws a delay d in ``[min_delay, max_delay]``; its first
    d actions enter the model clean (flow time 0, as the previous chunk's actions will at inference) and are
    left out of the loss. The policy then serves real-time chunking by conditioning on the previous chunk's
    first d actions, with no guidance (no extra cost). ``max_delay: 0`` (the default) is plain training."""

    # The delay range, in control steps (inclusive): max_delay about the worst inference delay expected.
    min_delay: int = 0
    max_delay: int = 0
    # uniform over the range, or exp: P(d) proportional to exp(-exp_decay * (d - min_delay)) (more
    # samples at small delays).
    distribution: str = "uniform"
    exp_decay: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.max_delay > 0

    def __post_init__(self) -> None:
        check_choice("policy.rtc_training.distribution", self.distribution, DELAY_DISTRIBUTIONS)
        check_positive("policy.rtc_training.min_delay", self.min_delay, allow_zero=True)
        check_positive("policy.rtc_training.max_delay", self.max_delay, allow_zero=True)
        check_positive("policy.rtc_training.exp_decay", self.exp_decay, allow_zero=True)
        if self.min_delay > self.max_delay:
            raise ValueError(f"policy.rtc_training.min_delay={self.min_delay} is above policy.rtc_training.max_delay="
                             f"{self.max_delay}; the delays are drawn from [min_delay, max_delay]")


@dataclass
class LoraConfig:
    """``policy.lora``: low-rank adapters (peft's LoRA) trained instead of the language models' weights.

    The defaults are openpi's LoRA fine-tuning preset (openpi ``src/openpi/models/gemma.py``: variants
    ``gemma_2b_lora`` and ``gemma_300m_lora``; ``src/openpi/models/lora.py``; the freeze filter of
    ``pi0_config.Pi0Config.get_freeze_filter`` used by ``training/config.py``'s
    ``pi0_libero_low_mem_finetune``): adapters on every attention and MLP projection of the backbone
    (rank 16, alpha 16) and of the action expert (rank 32, alpha 32), both factors drawn from N(0, 0.01),
    every other weight of those two language models frozen, and what lies outside them (the vision
    tower, the projections in and out, the time MLP) trained in full. Under ``precision=bf16`` the
    frozen weights are held in bf16; the adapters' masters and optimizer state are fp32."""

    enabled: bool = False
    # Rank and alpha (the update is scaled by alpha / rank) in the backbone and the vision tower ...
    rank: int = 16
    alpha: float = 16.0
    # ... and in the action expert.
    expert_rank: int = 32
    expert_alpha: float = 32.0
    dropout: float = 0.0
    # The parts that get adapters (the policy's lora_parts(): backbone, expert, vision); their other
    # weights are frozen.
    parts: list[str] = field(default_factory=lambda: ["backbone", "expert"])
    # Names of the nn.Linear modules adapted inside those parts (the last component, e.g. q_proj);
    # null: every nn.Linear in them (pi0 / pi0.5: q, k, v, o, gate, up and down projections).
    targets: list[str] | None = None
    # gaussian: both factors from N(0, 0.01) (openpi); peft: peft's default (Kaiming-uniform A, zero B:
    # training starts from exactly the base model).
    init: str = "gaussian"
    # Parameters outside the adapted parts train in full (openpi); false freezes them too.
    train_other: bool = True

    def __post_init__(self) -> None:
        for key in ("rank", "expert_rank"):
            check_positive(f"policy.lora.{key}", getattr(self, key))
        for key in ("alpha", "expert_alpha"):
            check_positive(f"policy.lora.{key}", getattr(self, key))
        if not 0 <= self.dropout < 1:
            raise ValueError(f"policy.lora.dropout={self.dropout!r} is not valid; it must be in [0, 1)")
        if not self.parts:
            raise ValueError("policy.lora.parts=[] adapts nothing; name at least one of "
                             f"{list(LORA_PARTS)}, or set policy.lora.enabled=false")
        for part in self.parts:
            check_choice("policy.lora.parts", part, LORA_PARTS)
        check_choice("policy.lora.init", self.init, LORA_INITS)
        if self.targets is not None and not self.targets:
            raise ValueError("policy.lora.targets=[] adapts nothing; name the nn.Linear modules (e.g. [q_proj, "
                             "v_proj]) or leave it null for every nn.Linear in policy.lora.parts")


@dataclass
class PolicyConfig:
    """What every policy has, built-in or a user's (``policy=custom``): the shapes the data is built and
    checked against, and the switches the framework reads. Each built-in policy extends it with its own
    options (its schema, named by its registry entry and chosen by ``policy.name``): an option the
    chosen policy does not have is an error naming the policy and its options, never silently ignored."""

    # A registered policy (slurmvla.registry.POLICIES), or custom: the class policy.target names.
    name: str = "custom"
    # policy=custom: the import path of an nn.Module class, built as Class(policy_cfg, stats, **kwargs).
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    size: str = "custom"
    image_size: int = 64
    num_cameras: int = 3
    max_text_len: int = 24
    state_dim: int = 8
    action_dim: int = 8
    action_horizon: int = 8
    # Observation frames per sample; must equal data.num_obs_history (checked at start-up).
    num_obs_history: int = 1
    # A conditioning token and a mode embedding for data.mode=joint / forward_dynamics / inverse_dynamics.
    dynamics: bool = False
    num_inference_steps: int = 10
    # true, false, or auto (see GRADIENT_CHECKPOINTING): a bool once training starts.
    gradient_checkpointing: Any = False
    # With gradient_checkpointing: checkpoint layers 0, k, 2k, ... of each stack (the rest keep their
    # activations), and what a checkpointed layer keeps: inputs (all recomputed) or matmuls (the outputs
    # of its matrix products and attention too; slurmvla/policy/recompute.py).
    checkpoint_every: int = 1
    checkpoint_saves: str = "inputs"
    freeze_vision_encoder: bool = False
    train_expert_only: bool = False
    # Normalization a policy was trained with (pi0.5: quantile); None: data.state/action_normalization.
    state_normalization: str | None = None
    action_normalization: str | None = None
    # Low-rank adapters instead of full fine-tuning (slurmvla/policy/lora.py; the peft extra).
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Training-time real-time chunking: a delayed, clean prefix of the chunk (slurmvla/policy/rtc.py).
    rtc_training: RTCTrainingConfig = field(default_factory=RTCTrainingConfig)

    def __post_init__(self) -> None:
        if not (isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto"):
            raise ValueError(f"policy.gradient_checkpointing={self.gradient_checkpointing!r} is not valid; choose one of "
                             "[true, false, auto]")
        check_choice("policy.checkpoint_saves", self.checkpoint_saves, CHECKPOINT_SAVES)
        check_positive("policy.checkpoint_every", self.checkpoint_every)
        entry = POLICIES.get(self.name)
        if not entry.target and not self.target:
            raise ValueError(f"policy.name={self.name!r} needs policy.target=package.module.Class (the policy's class); "
                             f"or choose a built-in policy: {[n for n in POLICIES if POLICIES.get(n).target]}")
        if entry.target and self.target:
            raise ValueError(f"policy.target={self.target!r} is read only with policy=custom, not with "
                             f"policy.name={self.name!r}; choose policy=custom or drop policy.target")
        schema = policy_schema(self.name)
        if type(self) is not schema:
            raise ValueError(f"policy.name={self.name!r} has the schema {schema.__name__}, not "
                             f"{type(self).__name__}: build it with slurmvla.config.policy_schema({self.name!r})")
        for key in ("image_size", "num_cameras", "max_text_len", "state_dim", "action_dim", "action_horizon",
                    "num_inference_steps", "num_obs_history"):
            check_positive(f"policy.{key}", getattr(self, key))
        for key in ("state_normalization", "action_normalization"):
            if getattr(self, key) is not None:
                check_choice(f"policy.{key}", getattr(self, key), NORMALIZATIONS)
        if self.rtc_training.max_delay >= self.action_horizon:
            raise ValueError(f"policy.rtc_training.max_delay={self.rtc_training.max_delay} must be below "
                             f"policy.action_horizon={self.action_horizon}: a chunk needs actions left to learn")
        if self.lora.enabled and self.train_expert_only and "backbone" in self.lora.parts:
            raise ValueError(f"policy.train_expert_only=true trains nothing in the backbone, but policy.lora.parts="
                             f"{list(self.lora.parts)} puts trained adapters there; set policy.lora.parts=[expert] "
                             "(adapters on the expert only) or policy.train_expert_only=false")


@dataclass
class TransformerPolicyConfig(PolicyConfig):
    """The built-in policies' shared shape: a vision tower, a backbone and an action expert."""

    patch_size: int = 16
    vision_width: int = 64
    vision_depth: int = 1
    vision_heads: int = 2
    width: int = 64
    depth: int = 2
    num_heads: int = 2
    head_dim: int = 32
    expert_width: int = 48
    attention_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("policy.attention_implementation", self.attention_implementation,
                ATTENTION_IMPLEMENTATIONS + ATTENTION_FALLBACKS)
        for key in ("patch_size", "vision_width", "vision_depth", "vision_heads", "width", "depth", "num_heads",
                    "head_dim", "expert_width"):
            check_positive(f"policy.{key}", getattr(self, key))
        if self.image_size % self.patch_size:
            raise ValueError(
                f"policy.image_size={self.image_size} must be a multiple of policy.patch_size={self.patch_size}"
            )
        if self.vision_width % self.vision_heads:
            raise ValueError(
                f"policy.vision_width={self.vision_width} must be divisible by policy.vision_heads={self.vision_heads}"
            )


def policy_schema(name: str) -> type[PolicyConfig]:
    """The schema of ``policy.name=name``: the class its registry entry names (``PolicyEntry.schema``; a
    plug-in, ``policy=custom``, gets ``PolicyConfig`` and keeps its own options in ``policy.kwargs``). A
    ValueError lists the policies."""
    return POLICIES.get(name).load_schema()


def policy_options(name: str) -> list[str]:
    import dataclasses

    return sorted(f.name for f in dataclasses.fields(policy_schema(name)))


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
        check_choice("data.keep_ranges.semantics", self.semantics, ("frame", "window"))


ON_DAMAGED = ("skip", "error")
DATA_LOADERS = ("stream", "map")
# The sample dataset's generator revision (part of its cache folder's name): a changed generator
# writes a new copy instead of reusing an older one.
SAMPLE_REVISION = "v3.0_av1_r2"
NORMALIZATIONS = ("mean_std", "min_max", "quantile", "identity")
MISSING_CAMERA_CHOICES = ("fail", "pad")
# Training image augmentation (slurmvla.data.augment): none, or openpi's preprocess_observation(train=True).
IMAGE_AUGMENTATIONS = ("none", "openpi")


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


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-4
    # The backbone (vision encoder, language tower) learns at lr * backbone_lr_scale.
    backbone_lr_scale: float = 1.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    # "auto": fused AdamW on CUDA, the foreach implementation elsewhere.
    fused: str = "auto"

    def __post_init__(self) -> None:
        check_choice("optim.name", self.name, ("adamw",))
        check_choice("optim.fused", self.fused, ("auto", "true", "false"))
        check_positive("optim.lr", self.lr)
        check_positive("optim.backbone_lr_scale", self.backbone_lr_scale, allow_zero=True)
        check_positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas!r} is not valid; give two values in [0, 1)")


@dataclass
class SchedulerConfig:
    name: str = "cosine"
    warmup_steps: int = 0
    # cosine decays to lr * min_lr_ratio at scheduler.decay_steps (0: at trainer.max_steps) and stays there.
    min_lr_ratio: float = 0.1
    decay_steps: int = 0
    # frozen_backbone: the backbone's lr is 0 for this many steps while the action expert trains.
    frozen_backbone_steps: int = 0

    def __post_init__(self) -> None:
        SCHEDULERS.check(self.name)
        check_positive("scheduler.warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("scheduler.frozen_backbone_steps", self.frozen_backbone_steps, allow_zero=True)
        check_positive("scheduler.decay_steps", self.decay_steps, allow_zero=True)
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"scheduler.decay_steps={self.decay_steps} must exceed scheduler.warmup_steps="
                             f"{self.warmup_steps} (the cosine runs between them), or be 0 for trainer.max_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"scheduler.min_lr_ratio={self.min_lr_ratio!r} is not valid; it must be in [0, 1]")


@dataclass
class TrainerConfig:
    max_steps: int = 200
    seed: int = 0
    # Samples per optimizer step summed over all ranks and accumulation steps.
    global_batch_size: int = 16
    grad_accum_steps: int = 1
    max_grad_norm: float = 1.0
    log_every_steps: int = 10
    device: str = "auto"
    progress_bar: bool = True
    # How often the ranks agree on a pending preemption signal (one small all-reduce). SLURM signals
    # signal_delay seconds ahead of the kill, so a few steps of latency cost nothing.
    signal_check_every_steps: int = 5
    # A validation pass over data.val_fraction's split every this many steps (and at the last); 0 disables.
    val_every_steps: int = 0
    # Closed-loop episodes in the simulator (rollout.*) every this many steps (and at the last), on rank 0,
    # logged as rollout/success_rate etc.; 0 disables. Needs the [sim] extra.
    rollout_every_steps: int = 0
    # Deterministic kernels where torch has them (cuBLAS workspace, no cuDNN autotuning), warning where
    # it has none: a resumed GPU run then repeats the uninterrupted one as closely as the kernels allow.
    # Slower; CPU runs are deterministic without it.
    deterministic: bool = False
    # torch.compile each of the policy's repeated layers (its wrap_units(): regional compilation, one
    # compilation per kind of layer, fused elementwise kernels); the first steps pay for it.
    compile: bool = False
    # An exponential moving average of the fp32 master weights (openpi's ema_decay; 0.99 in its DROID
    # fine-tuning), updated after every optimizer step, held as the optimizer state is held (sharded
    # where the engine shards it), saved in each checkpoint (ema.safetensors) and resumed bitwise;
    # python -m slurmvla.export --ema writes it. null: none.
    ema_decay: float | None = None

    def __post_init__(self) -> None:
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"trainer.ema_decay={self.ema_decay} must lie strictly between 0 and 1 (e.g. 0.99), "
                             "or be null for no moving average")
        check_positive("trainer.max_steps", self.max_steps)
        check_positive("trainer.global_batch_size", self.global_batch_size)
        check_positive("trainer.grad_accum_steps", self.grad_accum_steps)
        check_positive("trainer.max_grad_norm", self.max_grad_norm, allow_zero=True)
        check_positive("trainer.log_every_steps", self.log_every_steps)
        check_positive("trainer.signal_check_every_steps", self.signal_check_every_steps)
        check_positive("trainer.val_every_steps", self.val_every_steps, allow_zero=True)
        check_positive("trainer.rollout_every_steps", self.rollout_every_steps, allow_zero=True)
        check_choice("trainer.device", self.device, DEVICES)

    def micro_batch_size(self, world_size: int) -> int:
        per_step = world_size * self.grad_accum_steps
        if self.global_batch_size % per_step:
            raise ValueError(
                f"trainer.global_batch_size={self.global_batch_size} is not divisible by world size "
                f"{world_size} x trainer.grad_accum_steps={self.grad_accum_steps} = {per_step}; "
                f"choose a multiple of {per_step}"
            )
        return self.global_batch_size // per_step


@dataclass
class CheckpointConfig:
    # 0 saves only at the end of training.
    every_steps: int = 100
    keep: int = 2
    # Resume from the newest complete checkpoint in the run directory, if there is one.
    resume: bool = True
    # Write checkpoints in the background while training goes on (every built-in engine: the state is
    # copied to the host first); an engine registered without background_save saves synchronously,
    # said once. Atomicity and resume are the same either way: a checkpoint counts only once it is
    # renamed into place.
    async_save: bool = True

    def __post_init__(self) -> None:
        check_positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        check_positive("checkpoint.keep", self.keep)


@dataclass
class WandbConfig:
    mode: str = "offline"
    project: str = "slurmvla"
    entity: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_choice("logging.wandb.mode", self.mode, WANDB_MODES)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    level: str = "INFO"


@dataclass
class ProfileConfig:
    """python -m slurmvla.profile: steps run and not timed, then timed."""

    warmup_steps: int = 3
    steps: int = 10
    # Dense peak of one accelerator in TFLOP/s for MFU (e.g. 989 for an H100 SXM in bf16); 0 = not reported.
    peak_tflops: float = 0.0
    # After the timed steps, one more step under torch's profiler: its N most expensive kernels (GPU) or
    # operators (CPU) and their kinds (matrix products, attention, elementwise, ...); 0 = none.
    kernels: int = 0

    def __post_init__(self) -> None:
        check_positive("profile.warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("profile.steps", self.steps)
        check_positive("profile.peak_tflops", self.peak_tflops, allow_zero=True)
        check_positive("profile.kernels", self.kernels, allow_zero=True)


@dataclass
class ServeConfig:
    """python -m slurmvla.serve: where it listens, and which client keys feed which policy input.

    The defaults are what openpi's DROID client sends: one exterior camera, the wrist camera, the 7
    joint positions, the gripper position and the prompt."""

    host: str = "0.0.0.0"
    port: int = 8000
    # One client key per entry of data.cameras, in that order; null: the client never sends that
    # camera, so it is padded black and masked, as data.missing_cameras=pad does in training.
    cameras: list[str | None] = field(
        default_factory=lambda: ["observation/exterior_image_1_left", None, "observation/wrist_image_left"])
    # Client keys concatenated (in this order) into the policy's raw state (data.state_keys).
    state: list[str] = field(default_factory=lambda: ["observation/joint_position", "observation/gripper_position"])
    prompt: str = "prompt"
    # Each request samples its action chunk from noise seeded by this: the same observation always
    # gives the same chunk, on any server. null: fresh noise per request (openpi's server): in closed loop
    # a fixed seed is the same draw at every request, a bias that does not average out.
    seed: int | None = 0
    # auto: the GPU when there is one.
    device: str = "auto"
    # Real-time inference on a GPU (slurmvla/inference/graphs.py). cuda_graph: each request replays one
    # CUDA graph of the whole sample_actions (captured per input shape on first use; pi0 / pi0.5).
    # compile: torch.compile the policy's repeated layers first (a one-time compilation at the first
    # request of each shape; fused kernels).
    cuda_graph: bool = False
    compile: bool = False
    # pi0 / pi0.5: each layer's query / key / value projections, and its MLP's gate / up projections, run
    # as one matrix product each (the same weights, not copied; slurmvla.inference.optimize.fuse_linears).
    fused_projections: bool = True
    # pi0 / pi0.5 on a GPU with FP8 matrix units (compute capability >= 8.9: L40S, RTX 4090, H100, H200), bf16:
    # the prefix's linear layers (vision tower, projector, the backbone's half of each layer; run once per
    # request) in float8 with per-row scales through torchao (pip install -e '.[fp8]'); the denoising steps stay
    # bf16. The actions move by float8's rounding (slurmvla/inference/fp8.py, tests/test_fp8.py).
    fp8_prefix: bool = False
    # The largest request (one msgpack frame) accepted, in MiB; a larger one is refused as its header
    # arrives (close code 1009), before any of it is buffered. null: derived from the policy (see
    # slurmvla.inference.runner.default_max_request_bytes): 4 x one observation, each camera counted at the
    # policy's image size or 1280 x 720 RGB, whichever is larger, plus 16 MiB.
    max_request_mb: float | None = None
    # Overload gets an answer, never an unbounded backlog (slurmvla.inference.server). max_connections:
    # connections served at once; one more is refused at the handshake with HTTP 503 naming this option.
    # max_pending: requests being answered or waiting for the policy at once, over all connections; one more
    # gets a text frame naming this option and its connection closes with code 1013 (try again later).
    max_connections: int = 64
    max_pending: int = 32
    # API key (clients send "Authorization: Api-Key <key>", openpi's WebsocketClientPolicy(..., api_key=...)).
    # The NAME of an environment variable holding the key; the default one may be unset (no key
    # from it), any other name must be set. null: no key from the environment.
    api_key_env: str | None = "SLURMVLA_API_KEY"
    # A file whose content is the key (readable only by its owner); must be readable when set.
    # The key itself is never part of the config, so it never reaches config.resolved.yaml.
    api_key_file: str | None = None
    # Without a key, a server on an address beyond this machine (serve.host not 127.0.0.1 / ::1 / localhost)
    # refuses to start: anyone who reaches the port could drive the robot. true: start anyway, with a warning.
    allow_unauthenticated: bool = False
    # Real-time chunking (a request with prev_actions / delay; slurmvla/policy/rtc.py): the largest guidance
    # weight (the paper's beta), and how the guidance weights decay over the overlap after the delay
    # (exp: the paper's soft mask; linear; ones: the whole overlap as the frozen part; zeros: the frozen part only).
    rtc_max_guidance: float = 5.0
    rtc_schedule: str = "exp"

    def __post_init__(self) -> None:
        if not 0 <= self.rtc_max_guidance < float("inf"):
            raise ValueError(f"serve.rtc_max_guidance={self.rtc_max_guidance} must be a number >= 0 (the paper's "
                             "5.0; 0 turns guidance off, the delay's actions still come from prev_actions)")
        if self.rtc_schedule not in ("exp", "linear", "ones", "zeros"):
            raise ValueError(f"serve.rtc_schedule={self.rtc_schedule!r} is not one of exp, linear, ones, zeros")
        if not 0 <= self.port < 65536:
            raise ValueError(f"serve.port={self.port} is not a TCP port (0..65535; 0 picks a free one)")
        if self.max_request_mb is not None and not (0 < self.max_request_mb < float("inf")):
            raise ValueError(f"serve.max_request_mb={self.max_request_mb} is not a size: give a number of MiB > 0 "
                             "(e.g. 64), or null for the default derived from the policy's observation size")
        for name in ("max_connections", "max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"serve.{name}={value!r} is not valid: give an integer >= 1 (default "
                                 f"{getattr(ServeConfig, name)})")
        if self.api_key_env is not None and not (self.api_key_env.isascii() and self.api_key_env.replace("_", "a").isalnum()
                                               and not self.api_key_env[0].isdigit()):
            # Not echoed: a key put here by mistake must not reach the terminal or a log.
            raise ValueError("serve.api_key_env must be the NAME of an environment variable holding the key "
                             "(letters, digits and _, e.g. SLURMVLA_API_KEY), not the key itself")
        if self.api_key_file is not None and not self.api_key_file.strip():
            raise ValueError("serve.api_key_file is empty; give the path of a file holding the key, or null")
        if not self.state:
            raise ValueError("serve.state is empty; name the client keys that make up the state, e.g. "
                             "[observation/joint_position, observation/gripper_position]")
        if not any(self.cameras):
            raise ValueError(f"serve.cameras={self.cameras} names no client key; a policy needs at least one camera")


@dataclass
class RolloutConfig:
    """python -m slurmvla.rollout and trainer.rollout_every_steps: closed-loop episodes in a simulated task
    (slurmvla.sim, the [sim] extra), the policy queried through openpi's client."""

    # The embodiment: pick (the DROID-shaped pick task) or metaworld (a Meta-World v3 task, rollout.task).
    env: str = "pick"
    # The Meta-World task (e.g. assembly-v3; every v3 task the package ships); null for the pick task.
    task: str | None = None
    episodes: int = 50
    # Episode e is the environment's seed first_seed + e. The recorded demonstrations use 0..N-1;
    # the default evaluates on seeds no demonstration was recorded from.
    first_seed: int = 100000
    # Actions of each predicted chunk executed before the policy is asked again (openpi's DROID
    # client: open_loop_horizon = 8); at most policy.action_horizon.
    replan_steps: int = 4
    # An episode ends at success or after this many control steps (15 Hz).
    max_steps: int = 100
    # Camera frames as the environment renders them (DROID's are 180 x 320).
    height: int = 180
    width: int = 320
    # How long a client waits for a server address to accept connections (a server still starting).
    connect_timeout_s: float = 120.0
    # Episodes (the first ones) written as MP4 videos: the exterior and wrist cameras side by side.
    videos: int = 3
    # Where the summary (rollout.json), per-episode results and videos go; null: beside the source
    # (RUN_DIR/rollout/step_N/) for a run, ./rollout/ for a server address.
    out: str | None = None
    # How chunks run (docs/serving.md, "Execution modes"): sync (run replan_steps actions, ask, hold until
    # the answer), async (keep executing while asking, then switch to the new chunk), rtc (as async, the
    # request carrying the old chunk and the delay; the server must list "rtc" in its execution_modes).
    execution: str = "sync"
    # The simulator keeps time: each request's answer takes effect this many control steps after its
    # observation, the arm executing (async, rtc) or holding (sync) meanwhile. 0: at once (the environment
    # waits for the policy).
    delay_steps: int = 0
    # fixed: delay_steps; measured: each call's wall time times the control rate (15 Hz), rounded up.
    delay: str = "fixed"

    def __post_init__(self) -> None:
        check_choice("rollout.env", self.env, SIM_ENVS)
        if self.env == "metaworld" and not self.task:
            raise ValueError("rollout.env=metaworld needs rollout.task (a Meta-World v3 task, e.g. rollout.task=assembly-v3)")
        if self.env == "pick" and self.task is not None:
            raise ValueError(f"rollout.task={self.task!r}: the pick task has no tasks to choose (rollout.env=pick); "
                             "set rollout.env=metaworld for a Meta-World task, or leave rollout.task null")
        check_choice("rollout.execution", self.execution, EXECUTION_MODES)
        check_choice("rollout.delay", self.delay, ("fixed", "measured"))
        check_positive("rollout.delay_steps", self.delay_steps, allow_zero=True)
        check_positive("rollout.episodes", self.episodes)
        check_positive("rollout.replan_steps", self.replan_steps)
        check_positive("rollout.max_steps", self.max_steps)
        check_positive("rollout.videos", self.videos, allow_zero=True)
        check_positive("rollout.connect_timeout_s", self.connect_timeout_s)
        if min(self.height, self.width) < 16 or self.height % 2 or self.width % 2:
            raise ValueError(f"rollout.height={self.height} / rollout.width={self.width}: each must be an even number "
                             ">= 16 of pixels (the videos are yuv420p)")


@dataclass
class Config:
    engine: EngineConfig = MISSING
    policy: PolicyConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    scheduler: SchedulerConfig = MISSING
    trainer: TrainerConfig = MISSING
    checkpoint: CheckpointConfig = MISSING
    logging: LoggingConfig = MISSING
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # bf16: bf16 compute with fp32 master weights and fp32 optimizer state, on every engine.
    precision: str = "fp32"
    name: str = "debug"

    def __post_init__(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)
        if self.policy.gradient_checkpointing is True and not ENGINES.get(self.engine.name).activation_checkpointing:
            raise ValueError(
                f"policy.gradient_checkpointing=true is refused with engine={self.engine.name!r}: torch activation "
                "checkpointing under ZeRO-3 re-gathers partitioned parameters in the recomputation and is known to "
                f"corrupt gradients; use it with one of {list(ENGINES.names(activation_checkpointing=True))}, or "
                "turn it off"
            )
        if self.trainer.rollout_every_steps and not ENGINES.get(self.engine.name).whole_model:
            raise ValueError(
                f"trainer.rollout_every_steps={self.trainer.rollout_every_steps} runs closed-loop episodes on each rank's "
                f"copy of the model, which engine={self.engine.name!r} shards; use one of "
                f"{list(ENGINES.names(whole_model=True))}, or set it to 0 and roll out a checkpoint with "
                "python -m slurmvla.rollout RUN_DIR"
            )
        if self.policy.num_obs_history != self.data.num_obs_history:
            raise ValueError(
                f"policy.num_obs_history={self.policy.num_obs_history} does not match data.num_obs_history="
                f"{self.data.num_obs_history}: the policy would read the wrong frames; set both to the same value"
            )
        check_delta_actions(self.data.delta_actions, self.policy.action_dim, self.policy.state_dim,
                            "policy.action_dim", "policy.state_dim")
        if self.data.mode != "policy" and not self.policy.dynamics:
            raise ValueError(
                f"data.mode={self.data.mode!r} yields dynamics samples, which need policy.dynamics=true "
                "(a conditioning token and a mode embedding); set it, or use data.mode='policy'"
            )
        if self.data.mode in ("joint", "forward_dynamics") and self.policy.state_dim != self.policy.action_dim:
            raise ValueError(
                f"data.mode={self.data.mode!r} predicts future states with the action head, so policy.state_dim="
                f"{self.policy.state_dim} must equal policy.action_dim={self.policy.action_dim}; use "
                "data.mode='policy' or 'inverse_dynamics'"
            )
        if self.trainer.log_every_steps > self.trainer.max_steps:
            log.warning("trainer.log_every_steps=%d is more than trainer.max_steps=%d: logging every %d steps instead",
                        self.trainer.log_every_steps, self.trainer.max_steps, self.trainer.max_steps)
            self.trainer.log_every_steps = self.trainer.max_steps
