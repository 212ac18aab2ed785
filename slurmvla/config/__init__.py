"""The run's configuration, composed from the schemas of the packages that read it, and the rules across them.

``slurmvla.compose`` registers ``Config`` in Hydra's ConfigStore, where it sits under ``conf/config.yaml`` as its
first default, so every YAML file and command-line override is merged into a typed node: a misspelled key or a
value of the wrong type fails at composition time with Hydra's message naming the key. Each group's own rules live
in its schema's ``__post_init__``, the rules across groups in ``Config.__post_init__``; they run when the composed
DictConfig becomes these dataclasses and raise ``ValueError`` naming the value and the valid choices. Nothing here
touches the filesystem: a saved config re-validates on any machine, and files are checked where they are opened.

Each group's schema is a module of this package, named by the package that reads it: ``data.*`` in
``slurmvla/config/data.py``, ``engine.*`` and ``precision`` in ``engine.py``, ``policy.*`` in ``policy.py`` (each
policy's own options in its folder: ``slurmvla/policy/pi0/config.py``, ..., named by its registry entry and
imported by that name: :func:`policy_schema`), ``serve.*`` in ``serve.py``, ``rollout.*`` in ``rollout.py``. The
groups read by a single module (``optim`` and ``scheduler``: ``optim.py``; ``trainer``, ``checkpoint``,
``logging``, ``profile``) are here. Why one package and not a schema inside each package: every package reads
the root ``Config`` or a sibling's schema (the data layer's processor reads ``serve``'s client keys, the closed
loop ``serve``'s execution modes), so a schema inside ``inference/`` would make the configuration depend on the
highest layer. Here the whole configuration sits below every package that reads it, and imports none of them
(layer 1; docs/architecture.md). Each choice list is in its owner's module; the shared checks are
``slurmvla.validators``. The names users import from here stay importable from here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from omegaconf import MISSING

from slurmvla.config.data import DataConfig, KeepRangesConfig, MixtureMember, check_delta_actions
from slurmvla.config.engine import PRECISIONS, EngineConfig
from slurmvla.config.policy import (
    LoraConfig,
    PolicyConfig,
    RTCTrainingConfig,
    TransformerPolicyConfig,
    policy_options,
    policy_schema,
)
from slurmvla.config.rollout import RolloutConfig
from slurmvla.config.rollout_array import RolloutArrayConfig
from slurmvla.config.serve import ServeConfig
from slurmvla.registry import ENGINES, SCHEDULERS
from slurmvla.validators import check_choice, check_positive

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "EngineConfig", "KeepRangesConfig", "LoggingConfig", "LoraConfig",
    "MixtureMember", "OptimConfig", "PolicyConfig", "ProfileConfig", "RTCTrainingConfig", "RolloutArrayConfig",
    "RolloutConfig",
    "SchedulerConfig", "ServeConfig", "TrainerConfig", "TransformerPolicyConfig", "WandbConfig", "check_choice",
    "check_delta_actions", "check_positive", "policy_options", "policy_schema",
]

log = logging.getLogger("slurmvla")

WANDB_MODES = ("offline", "online", "disabled")
DEVICES = ("auto", "cpu", "cuda")




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
    # where the engine shards it), saved in each checkpoint (ema.safetensors) and resumed bitwise; what
    # the run is served, rolled out, evaluated and exported with (serve.weights=auto). null: none.
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
    # trainer.rollout_every_steps as a SLURM job array per checkpoint, off the training job.
    rollout_array: RolloutArrayConfig = field(default_factory=RolloutArrayConfig)
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
        if self.rollout_array.enabled and not self.trainer.rollout_every_steps:
            raise ValueError("rollout_array.enabled=true evaluates the checkpoints of trainer.rollout_every_steps, which "
                             "is 0: set it (e.g. trainer.rollout_every_steps=1000), or rollout_array.enabled=false")
        # Off the job, the array evaluates a saved checkpoint, which any engine can be served from.
        if (self.trainer.rollout_every_steps and not self.rollout_array.enabled
                and not ENGINES.get(self.engine.name).whole_model):
            raise ValueError(
                f"trainer.rollout_every_steps={self.trainer.rollout_every_steps} runs closed-loop episodes on each rank's "
                f"copy of the model, which engine={self.engine.name!r} shards; use one of "
                f"{list(ENGINES.names(whole_model=True))}, evaluate each checkpoint off the job "
                "(rollout_array.enabled=true), or set it to 0 and roll out a checkpoint with python -m slurmvla.rollout RUN_DIR"
            )
        if self.trainer.rollout_every_steps and self.serve.weights == "ema" and self.trainer.ema_decay is None:
            raise ValueError(
                "serve.weights=ema evaluates the moving average of the weights, which this run does not keep "
                "(trainer.ema_decay=null): set trainer.ema_decay (e.g. 0.999), or serve.weights=auto / trained"
            )
        if self.policy.num_obs_history != self.data.num_obs_history:
            raise ValueError(
                f"policy.num_obs_history={self.policy.num_obs_history} does not match data.num_obs_history="
                f"{self.data.num_obs_history}: the policy would read the wrong frames; set both to the same value"
            )
        every = self.serve.request_interval
        if self.data.num_obs_history > 1 and self.data.history_interval % every:
            raise ValueError(
                f"serve.request_interval={every}: the policy reads {self.data.num_obs_history} frames "
                f"data.history_interval={self.data.history_interval} steps apart, and a client requesting every {every} "
                f"steps never sends those frames; train with a data.history_interval that is a multiple of {every}, "
                "or request every step (serve.request_interval=1)")
        check_delta_actions(self.data.delta_actions, self.policy.action_dim, self.policy.state_dim,
                            "policy.action_dim", "policy.state_dim")
        guided = self.serve.rtc_guided_dims
        if guided is not None and max(guided) >= self.policy.action_dim:
            raise ValueError(f"serve.rtc_guided_dims={list(guided)} names dim {max(guided)}, but the policy's actions have "
                             f"{self.policy.action_dim} dims (policy.action_dim): choose from 0..{self.policy.action_dim - 1}")
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
