"""What every policy has (``PolicyConfig``; ``TransformerPolicyConfig``, the built-in policies' shared shape), its
low-rank adapters (``policy.lora``) and training-time real-time chunking (``policy.rtc_training``), and how
``policy.name`` finds its schema (:func:`policy_schema`). Each built-in policy's own options are its folder's
``config`` (``slurmvla/policy/pi0/config.py``, ...), a subclass of these named by its registry entry.

A schema module of ``slurmvla.config``: it imports no torch and nothing of ``slurmvla`` above the configuration
(layer 1; docs/architecture.md). A policy folder's ``config`` subclasses these and imports nothing else of the
configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slurmvla.config.data import NORMALIZATIONS
from slurmvla.registry import POLICIES
from slurmvla.validators import check_choice, check_positive

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")
# Known names that may be unavailable on a machine; they warn once and fall back to sdpa.
ATTENTION_FALLBACKS = ("fa2", "flash_attention_2")
# What a checkpointed layer keeps besides its inputs (slurmvla/policy/recompute.py).
CHECKPOINT_SAVES = ("inputs", "matmuls")
# policy.gradient_checkpointing: on, off, or auto: the least recomputation the planner predicts fits the GPU,
# chosen at start-up (slurmvla/planner/recompute_choice.py) and saved as the concrete setting.
GRADIENT_CHECKPOINTING = (True, False, "auto")
# The parts of a policy that get adapters (its lora_parts(); slurmvla/policy/lora.py), from the least specific.
LORA_PARTS = ("backbone", "expert", "vision")
LORA_INITS = ("gaussian", "peft")
# Training-time real-time chunking's delay distributions (policy.rtc_training.distribution).
DELAY_DISTRIBUTIONS = ("uniform", "exp")
# Real-time chunking's guidance weights over the overlap after the delay (serve.rtc_schedule; slurmvla/policy/rtc.py).
RTC_SCHEDULES = ("exp", "linear", "ones", "zeros")
# The Jacobian real-time chunking's guidance pulls its error back through (serve.rtc_jacobian; policy/rtc.py).
RTC_JACOBIANS = ("model", "identity")


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

    # -- typed views of the options, for the planner (slurmvla/planner/: never an option looked up by name) ---------

    @property
    def recompute_auto(self) -> bool:
        """``gradient_checkpointing: auto``: the planner chooses the setting at start-up (a bool from then on)."""
        return self.gradient_checkpointing == "auto"

    def layer_stacks(self) -> tuple[int, ...]:
        """The depth of each of the policy's stacks of layers that activation checkpointing runs through
        (``checkpoint_every`` counts layers within each). None known here; the built-in shape names its own."""
        return ()

    def without_local_files(self) -> PolicyConfig:
        """This config with nothing its build reads from local files (pretrained weights, a tokenizer, statistics
        saved beside them): what the planner builds to count shapes. None here; a policy whose options name such
        files clears them."""
        return self


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

    def layer_stacks(self) -> tuple[int, ...]:
        """The backbone's layers (the action expert's run beside them, one per layer) and the vision tower's."""
        return (self.depth, self.vision_depth)


def policy_schema(name: str) -> type[PolicyConfig]:
    """The schema of ``policy.name=name``: the class its registry entry names (``PolicyEntry.schema``; a
    plug-in, ``policy=custom``, gets ``PolicyConfig`` and keeps its own options in ``policy.kwargs``). A
    ValueError lists the policies."""
    return POLICIES.get(name).load_schema()


def policy_options(name: str) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(policy_schema(name)))
