"""pi0's and pi0.5's options (``policy=pi0|pi0_tiny|pi05|pi05_tiny``; the models: ``model`` beside it).
Imports no torch: validating a config reads it, never the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slurmvla.config.policy import LoraConfig, TransformerPolicyConfig
from slurmvla.registry import PolicyEntry
from slurmvla.validators import check_choice, check_positive

# torch's scaled-dot-product attention kernels by the names policy.attention_kernels takes.
ATTENTION_KERNELS = ("flash", "efficient", "cudnn", "math")
# pi0 / pi0.5's attention in the cached denoising steps (policy.denoise_attention).
DENOISE_ATTENTION = ("sdpa", "matmul")
# pi0.5's state in the prompt (published) or as one projected prefix token (policy.state_input).
STATE_INPUTS = ("discrete", "continuous")
# Where the normalization statistics come from (policy.stats_source).
STATS_SOURCES = ("data", "checkpoint")
# openpi's LoRA targets in the Gemma stacks (policy.lora.targets' default).
GEMMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Pi0Config(TransformerPolicyConfig):
    """policy=pi0|pi0_tiny: pi0 on transformers' PaliGemma (slurmvla/policy/pi0/model.py)."""

    name: str = "pi0"
    size: str = "pi0_tiny"
    # Gemma's grouped key/value heads, MLP widths of the backbone, the action expert and the vision
    # tower, and the text vocabulary.
    num_kv_heads: int = 1
    mlp_dim: int = 128
    expert_mlp_dim: int = 96
    vision_mlp_dim: int = 128
    vocab_size: int = 512
    # A local Hugging Face PaliGemma directory, a pi0 / pi0.5 checkpoint saved by LeRobot (its
    # model.safetensors), or openpi's own checkpoint directory (params/ + assets/; the openpi extra reads it):
    # the weights the policy starts from. Never downloaded.
    pretrained_path: str | None = None
    # Where the tokenizer files are (default: pretrained_path when it holds them); without either, the
    # byte tokenizer (random-weight runs only).
    tokenizer_path: str | None = None
    # State and actions are zero-padded to these widths inside the model (the published heads are 32
    # wide; noise is drawn and the flow integrated in all of them, cut to the data's dims only at the
    # output and in the loss), as openpi and LeRobot do.
    max_state_dim: int = 32
    max_action_dim: int = 32
    # Where normalization statistics come from: "data" (the configured datasets) or "checkpoint" (the
    # pretrained_path directory's: LeRobot's saved normalizer, or openpi's norm_stats.json).
    stats_source: str = "data"
    # An openpi checkpoint directory with several assets/<asset_id>/norm_stats.json: the one stats_source=checkpoint
    # reads (openpi's data config's asset_id, e.g. droid).
    openpi_asset_id: str | None = None
    # Loading pretrained weights that leave some of the policy's tensors unset (they keep their random
    # initialisation, named in the log) is an error unless this is true.
    allow_partial_load: bool = False
    # openpi's LoRA targets: Gemma's attention and MLP projections (not pi0.5's adaptive-norm modulation,
    # which openpi's LoRA leaves frozen).
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(targets=list(GEMMA_LORA_TARGETS)))
    # The training forward on a GPU (and its recomputation): torch's fused attention kernels in the order
    # they are tried (flash, efficient, cudnn, math; one that cannot take a call's inputs is skipped);
    # null: torch's own order (torch 2.11: cuDNN's). cuDNN plans each new input shape (a batch's prompt
    # length sets it) and is the faster once planned: short jobs gain from [efficient, math], long ones keep
    # torch's order (the measured figures: docs/policies.md).
    attention_kernels: list[str] | None = None
    # The training batch's prompt is cut to the smallest multiple of this many columns that holds every
    # sample's tokens (padding is masked: the loss is the same). null: 32 when the policy is on a GPU,
    # where each new prompt length is a new shape for cuDNN's attention to plan and for a compiled layer
    # to recompile (32 leaves 7 lengths of pi0.5's 200), and 1 on the CPU, where a shape costs nothing and
    # padding only work.
    prompt_bucket: int | None = None
    # Inference: the attention of the denoising steps that reuse the prefix's keys and values. sdpa: torch's
    # fused kernels (policy.attention_implementation's); matmul: two matrix products around a float32 softmax
    # with the query heads folded onto their shared key / value head (slurmvla.policy.attention.
    # grouped_matmul_attention): at batch 1 a call is few queries over many keys, where a fused kernel is
    # latency bound (docs/policies.md); benchmarks/gpu_suite.sh's denoise section times both.
    denoise_attention: str = "matmul"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("policy.denoise_attention", self.denoise_attention, DENOISE_ATTENTION)
        if self.prompt_bucket is not None:
            check_positive("policy.prompt_bucket", self.prompt_bucket)
        for kernel in self.attention_kernels or []:
            check_choice("policy.attention_kernels", kernel, ATTENTION_KERNELS)
        if self.attention_kernels is not None and "math" not in self.attention_kernels:
            raise ValueError(f"policy.attention_kernels={list(self.attention_kernels)} needs math last: it is the "
                             "one kernel that takes every input (others refuse some masks, head sizes or dtypes)")
        for key in ("num_kv_heads", "mlp_dim", "expert_mlp_dim", "vision_mlp_dim", "vocab_size", "max_state_dim",
                    "max_action_dim"):
            check_positive(f"policy.{key}", getattr(self, key))
        check_choice("policy.stats_source", self.stats_source, STATS_SOURCES)
        if self.stats_source == "checkpoint" and not self.pretrained_path:
            raise ValueError("policy.stats_source=checkpoint reads the statistics saved beside policy.pretrained_path, "
                             "which is not set; set it, or use policy.stats_source=data")

    def without_local_files(self) -> Pi0Config:
        """No pretrained weights and no tokenizer files (the byte tokenizer fills the prompt, a worst case); statistics
        from the data where they were to come from beside the weights."""
        changes: dict[str, Any] = {}
        if self.pretrained_path:
            changes["pretrained_path"] = None
        if self.tokenizer_path:
            changes["tokenizer_path"] = None
        if changes and self.stats_source == "checkpoint":
            changes["stats_source"] = "data"
        return dataclasses.replace(self, **changes) if changes else self


@dataclass
class Pi05Config(Pi0Config):
    """policy=pi05|pi05_tiny: pi0.5 (adaptive-RMSNorm time conditioning, the state in the prompt)."""

    name: str = "pi05"
    size: str = "pi05_tiny"
    # How the state enters: "discrete" (published: 256-bin ids of the normalized state written into the
    # prompt, "Task: ..., State: ...;\nAction: ") or "continuous" (one projected prefix token).
    state_input: str = "discrete"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("policy.state_input", self.state_input, STATE_INPUTS)


# What policy.name selects (slurmvla.registry.POLICIES finds this folder's ENTRIES).
ENTRIES = (
    PolicyEntry("pi0", "slurmvla.policy.pi0.model:Pi0Policy", schema="slurmvla.policy.pi0.config:Pi0Config"),
    PolicyEntry("pi05", "slurmvla.policy.pi0.model:Pi05Policy", schema="slurmvla.policy.pi0.config:Pi05Config"),
)
