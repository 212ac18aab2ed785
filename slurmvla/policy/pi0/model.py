"""pi0 and pi0.5 on transformers' PaliGemma: SigLIP + Gemma backbone, a Gemma action expert.

    cameras --SigLIP (units: encoder layers)--> projector --+
    instruction --Gemma embed_tokens * sqrt(width)----------+--> prefix (backbone stream) --+
    [pi0.5: proprio state --> one prefix token] ------------+                              | one attention
    [pi0:   proprio state --> one suffix token]                                            | over both, per
    noisy action chunk (+ time: pi0 MLP / pi0.5 adaRMS) --> suffix (expert stream) --------+ layer
                                                   --> velocity --> flow-matching loss

Both streams are transformers' own ``GemmaDecoderLayer`` modules (their projections, MLPs and
RMSNorms; the policy's state dict therefore maps one-to-one onto PaliGemma's and LeRobot's, see
:mod:`slurmvla.policy.pi0.weights`). Each (backbone layer, expert layer) pair is bundled in one
:class:`JointLayer` whose own ``forward`` runs the whole layer: it is the FSDP / ZeRO-3 unit, so the
all-gather of both layers' weights happens before any of them is touched. SigLIP's encoder layers
are units too.

Attention is block-causal (openpi's ``att_masks``): the prefix sees the prefix (bidirectionally,
padding masked), pi0's state token sees the prefix and itself, action tokens see everything valid.
Positions are the running count of valid tokens (RoPE). In the last layer the prefix supplies only
keys and values, so its query / output projections and MLP do not exist here (they would get no
gradient, which hangs DDP and wastes FSDP traffic); loading pretrained weights skips them by name.

pi0 vs pi0.5 here: pi0 feeds time through an MLP with the noisy actions and puts the state in the
suffix; pi0.5 conditions every expert RMSNorm on time (adaptive RMSNorm: scale, shift and a
residual gate) and writes the state into its prompt as 256-bin ids of the normalized state
(``policy.state_input=discrete``, as published; ``continuous`` projects it into one prefix token).

What LeRobot 0.6.1 computes, these do (tests/policy/test_pi0_parity.py holds them to its golden outputs):
state and actions zero-padded to ``max_state_dim`` / ``max_action_dim`` (32) inside the model, the
noise drawn and the flow integrated in all 32 dims, cut to the data's dims at the output and in the
loss (a mean over every chunk element, steps past the episode end included: they repeat the last
action, as LeRobot's loader makes them); images resized with padding by bilinear interpolation
without antialiasing on [0, 1] floats, then scaled to [-1, 1].
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from slurmvla.config.policy import PolicyConfig
from slurmvla.data.spec import DataFeatures, Draw, SampleSpec
from slurmvla.parameters import parameter_generator
from slurmvla.policy.attention import attention, grouped_matmul_attention, resolve_attention
from slurmvla.policy.base import Policy
from slurmvla.policy.flow_matching import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.policy.recompute import Recompute
from slurmvla.policy.rtc import Guidance, Prefix, conditioning, delay_draws, delayed_chunk

log = logging.getLogger(__name__)
# policy.attention_kernels' names (slurmvla.policy.pi0.config.ATTENTION_KERNELS) for torch's kernels.
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
# A batch made by Pi0Policy.prepare_inference carries its prompt under these keys, cut to a multiple of
# PROMPT_BUCKET columns.
PROMPT_IDS, PROMPT_MASK, PROMPT_BUCKET = "prompt_ids", "prompt_mask", 32
# Flow-matching time embedding periods (openpi's pi0).
MIN_PERIOD, MAX_PERIOD = 4e-3, 4.0


@functools.cache
def _transformers() -> SimpleNamespace:
    """The transformers pieces these policies are built from, by name (imported on first use: transformers
    is an optional extra)."""
    try:
        from transformers import GemmaConfig, SiglipVisionConfig
        from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer, apply_rotary_pos_emb
        from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer, SiglipVisionEmbeddings
    except ImportError as e:
        raise ValueError(f"policy=pi0 / pi05 need transformers ({e}); install the extra: pip install -e '.[vla]'") \
            from None
    return SimpleNamespace(GemmaConfig=GemmaConfig, SiglipVisionConfig=SiglipVisionConfig,
                           GemmaDecoderLayer=GemmaDecoderLayer, apply_rotary_pos_emb=apply_rotary_pos_emb,
                           SiglipEncoderLayer=SiglipEncoderLayer, SiglipVisionEmbeddings=SiglipVisionEmbeddings)


def gemma_config(width: int, depth: int, mlp_dim: int, cfg: PolicyConfig, attn: str):
    config = _transformers().GemmaConfig(
        hidden_size=width, intermediate_size=mlp_dim, num_hidden_layers=depth, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        hidden_activation="gelu_pytorch_tanh")
    config._attn_implementation = attn
    return config


def siglip_config(cfg: PolicyConfig, attn: str):
    config = _transformers().SiglipVisionConfig(
        hidden_size=cfg.vision_width, intermediate_size=cfg.vision_mlp_dim, num_hidden_layers=cfg.vision_depth,
        num_attention_heads=cfg.vision_heads, image_size=cfg.image_size, patch_size=cfg.patch_size)
    config._attn_implementation = attn
    return config


def pad_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Zero-pad the last dimension to ``dim`` (LeRobot's ``pad_vector``)."""
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def resize_with_pad(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, C, H, W]`` floats in [0, 1] -> ``[N, C, size, size]``: scaled to fit (bilinear, no
    antialiasing, clamped to [0, 1]), centred, padded with 0 (openpi's ``resize_with_pad_torch``)."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    ratio = max(w / size, h / size)
    nh, nw = int(h / ratio), int(w / ratio)
    x = F.interpolate(x, size=(nh, nw), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, left = (size - nh) // 2, (size - nw) // 2
    return F.pad(x, (left, size - nw - left, top, size - nh - top))


def sinusoidal_time(t: torch.Tensor, dim: int) -> torch.Tensor:
    """openpi's time embedding: sin / cos at periods spaced geometrically in [MIN_PERIOD, MAX_PERIOD]."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = MIN_PERIOD * (MAX_PERIOD / MIN_PERIOD) ** fraction
    angles = (2 * math.pi / period) * t.double()[..., None]  # t: [B], or [B, H] (a time per action)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).float()


def rope(positions: torch.Tensor, head_dim: int, theta: float = 10_000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's rotary tables for ``positions`` ``[B, L]`` (computed, not a buffer: nothing to
    materialise or shard)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class AdaptiveRMSNorm(nn.Module):
    """pi0.5's expert norm: RMS-normalise, then scale, shift and a residual gate from the condition
    (``dense`` starts at zero: the identity with gate 0 until trained, as openpi initialises it)."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.modulate(x, self.dense(cond))

    def modulate(self, x: torch.Tensor, modulation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The norm with ``modulation = dense(cond)`` given (``[B, 3 * dim]``: scale, shift, gate; or ``[B, H, 3 *
        dim]``, one per action token: training-time real-time chunking's time per action)."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        scale, shift, gate = (modulation[:, None, :] if modulation.dim() == 2 else modulation).chunk(3, dim=-1)
        return (normed * (1 + scale.float()) + shift.float()).to(x.dtype), gate.to(x.dtype)


def _norm(norm: nn.Module, x: torch.Tensor, cond: torch.Tensor | tuple | None,
          which: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``cond``: pi0.5's time condition, or (inference) the layer's norms' modulations computed ahead
    (a tuple: the input norm's, then the post-attention norm's; ``which`` picks)."""
    if not isinstance(norm, AdaptiveRMSNorm):
        return norm(x), None
    return norm.modulate(x, cond[which]) if isinstance(cond, tuple) else norm(x, cond)


def _residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def _linears(x: torch.Tensor, owner: nn.Module, name: str, linears: list[nn.Module]) -> list[torch.Tensor]:
    """Each of ``linears`` applied to ``x``: one product with the fused weight ``owner.<name>`` when inference
    made one (:meth:`Pi0Policy.projection_groups`)."""
    fused = getattr(owner, name, None)
    if fused is None:
        return [m(x) for m in linears]
    return list(F.linear(x, fused).split([m.weight.shape[0] for m in linears], dim=-1))


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP, ``down(act(gate(x)) * up(x))``, with gate and up as one product once fused."""
    if getattr(mlp, "fused_gate_up", None) is None:
        return mlp(x)
    gate, up = _linears(x, mlp, "fused_gate_up", [mlp.gate_proj, mlp.up_proj])
    return mlp.down_proj(mlp.act_fn(gate) * up)


class JointLayer(nn.Module):
    """Gemma layer ``i`` of the backbone and of the action expert, attending jointly: the unit a
    sharding engine wraps (its ``forward`` touches both layers' weights, nothing outside)."""

    def __init__(self, backbone: nn.Module, expert: nn.Module, last: bool, impl: str = "sdpa",
                 denoise_attention: str = "matmul"):
        super().__init__()
        self.backbone, self.expert, self.last, self.impl = backbone, expert, last, impl
        self.denoise_attention = denoise_attention  # the cached denoising steps' (policy.denoise_attention)
        self._apply_rotary = _transformers().apply_rotary_pos_emb  # looked up once, not per forward
        if last:  # the prefix's output of the last layer is never read: no parameters for it
            backbone.self_attn.q_proj = None
            backbone.self_attn.o_proj = None
            backbone.post_attention_layernorm = None
            backbone.mlp = None

    @staticmethod
    def _project(layer: nn.Module, x: torch.Tensor, cond: torch.Tensor | tuple | None, queries: bool):
        h, gate = _norm(layer.input_layernorm, x, cond, 0)
        attn = layer.self_attn
        shape = (*h.shape[:2], -1, attn.head_dim)
        parts = [attn.q_proj, attn.k_proj, attn.v_proj] if queries else [attn.k_proj, attn.v_proj]
        out = [y.view(shape).transpose(1, 2) for y in _linears(h, attn, "fused_qkv", parts)]
        return (*out, gate) if queries else (None, *out, gate)

    @staticmethod
    def _finish(layer: nn.Module, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None,
                cond: torch.Tensor | tuple | None) -> torch.Tensor:
        x = _residual(x, layer.self_attn.o_proj(y.transpose(1, 2).flatten(2)), gate)
        h, gate = _norm(layer.post_attention_layernorm, x, cond, 1)
        return _residual(x, _mlp(layer.mlp, h), gate)

    def forward(self, prefix: torch.Tensor | None, suffix: torch.Tensor, rotary: tuple, masks: tuple,
                cond: torch.Tensor | tuple | None = None, prefix_kv: tuple | None = None) -> tuple:
        """``rotary``: (cos, sin) over [prefix, suffix]; ``masks``: bool (prefix queries -> prefix
        keys ``[B, 1, P, P]``, suffix queries -> all keys ``[B, 1, S, P + S]``); ``cond``: pi0.5's
        time condition, or its two norms' modulations computed ahead (inference). With ``prefix_kv`` (an
        earlier call's prefix keys / values: the prefix never attends to the suffix, so they are the same at
        every denoising step) only the suffix runs.
        Returns ``(prefix or None, suffix, (k, v) of the prefix)``."""
        apply_rotary = self._apply_rotary
        cos, sin = rotary
        p = cos.shape[1] - suffix.shape[1]
        qs, ks, vs, gate_s = self._project(self.expert, suffix, cond, True)
        qs, ks = apply_rotary(qs, ks, cos[:, p:], sin[:, p:])
        if prefix_kv is None:
            qp, kp, vp, gate_p = self._project(self.backbone, prefix, None, not self.last)
            if qp is None:
                kp = apply_rotary(kp, kp, cos[:, :p], sin[:, :p])[1]
            else:
                qp, kp = apply_rotary(qp, kp, cos[:, :p], sin[:, :p])
        else:
            kp, vp = prefix_kv
        k, v = torch.cat([kp, ks], dim=2), torch.cat([vp, vs], dim=2)
        if prefix_kv is not None and self.denoise_attention == "matmul":
            ys = grouped_matmul_attention(qs, k, v, masks[1])
        else:
            ys = attention(qs, k, v, masks[1], self.impl)
        suffix = self._finish(self.expert, suffix, ys, gate_s, cond)
        if prefix_kv is not None or self.last:
            return None, suffix, (kp, vp)
        yp = attention(qp, k[:, :, :p], v[:, :, :p], masks[0], self.impl)
        return self._finish(self.backbone, prefix, yp, gate_p, None), suffix, (kp, vp)


class VisionTower(nn.Module):
    """SigLIP from transformers' modules (patch + position embeddings, encoder layers, final norm),
    run here so the position table is read as a weight (no ``position_ids`` buffer to materialise)."""

    def __init__(self, config):
        super().__init__()
        hf = _transformers()
        self.embeddings = hf.SiglipVisionEmbeddings(config)
        del self.embeddings.position_ids
        self.layers = nn.ModuleList(hf.SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, recompute: Recompute | None = None) -> torch.Tensor:
        """``recompute``: the encoder layers are checkpointed as it says (with the policy's gradient
        checkpointing, as LeRobot checkpoints its vision tower too)."""
        x = self.embeddings.patch_embedding(pixels.to(self.embeddings.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2) + self.embeddings.position_embedding.weight[None]
        for i, layer in enumerate(self.layers):
            x = recompute(layer, i, x, None) if recompute is not None else layer(x, None)
        return self.post_layernorm(x)


@dataclass
class PrefixCache:
    """What the denoising steps of one ``sample_actions`` call share, filled by the first: each layer's
    prefix keys / values (the prefix never attends to the suffix, so they are the same at every step),
    the rotary tables and the attention masks (the tokens do not change between steps either)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    masks: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class StepCondition:
    """pi0.5, one denoising step: every adaptive norm's modulation at that step's time, computed with every
    other step's before the loop (they depend on the time alone, so each norm's weights are read once per
    call, not once per step; the time condition itself is then read by nothing)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    final: torch.Tensor


class Pi0Policy(Policy):
    """pi0: state as a suffix token, time through an MLP with the noisy actions."""

    ADAPTIVE_TIME = False
    supports_rtc = True  # sample_actions(..., rtc=): real-time chunking (slurmvla/policy/rtc.py)
    supports_rtc_training = True  # policy.rtc_training: a time per action, a clean prefix left out of the loss

    def __init__(self, cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None = None):
        super().__init__()
        if cfg.dynamics:
            raise ValueError(f"policy.dynamics=true is not supported by policy={cfg.name} (the reference policy, "
                             "policy=tiny/small/base, has it); use data.mode=policy")
        self.cfg = cfg
        # Whether batches carry the instruction's tokens is settled here, as the sample spec the data is
        # built to says: never by asking the other ranks in forward.
        self.reads_text = self._data_tokenizes(cfg)
        # One draw from the global RNG, before any module is built (a module built on the meta
        # device draws nothing), seeds every parameter's own generator: the same weights whether
        # built whole or parameter by parameter on each rank's shard.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu").item())
        self.gradient_checkpointing = cfg.gradient_checkpointing
        # The recomputation in the backward pass runs under the forward's attention kernels (a kernel's
        # saved outputs differ between kernels, which checkpointing checks).
        self.recompute = Recompute.from_config(cfg, context=self._kernels)
        attn = resolve_attention(cfg.attention_implementation)  # sdpa or eager
        GemmaDecoderLayer = _transformers().GemmaDecoderLayer
        self.vision = VisionTower(siglip_config(cfg, attn))
        self.projector = nn.Linear(cfg.vision_width, cfg.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        backbone = gemma_config(cfg.width, cfg.depth, cfg.mlp_dim, cfg, attn)
        expert = gemma_config(cfg.expert_width, cfg.depth, cfg.expert_mlp_dim, cfg, attn)
        self.layers = nn.ModuleList(
            JointLayer(GemmaDecoderLayer(backbone, i), self._expert_layer(GemmaDecoderLayer(expert, i)),
                       last=i == cfg.depth - 1, impl=attn, denoise_attention=cfg.denoise_attention)
            for i in range(cfg.depth))
        w = cfg.expert_width
        self.expert_norm = AdaptiveRMSNorm(w, w) if self.ADAPTIVE_TIME else type(self.layers[0].expert.input_layernorm)(w)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, w)
        self.action_out_proj = nn.Linear(w, cfg.max_action_dim)
        self._time_modules(w)
        self.register_normalization(cfg, stats)
        if not self.embed_tokens.weight.is_meta:  # built on the meta device: the engine materialises
            self.reset_parameters()
            self.load_initial_weights()
        self.freeze(self.vision, cfg)

    def _expert_layer(self, layer: nn.Module) -> nn.Module:
        if self.ADAPTIVE_TIME:
            w = self.cfg.expert_width
            layer.input_layernorm = AdaptiveRMSNorm(w, w)
            layer.post_attention_layernorm = AdaptiveRMSNorm(w, w)
        return layer

    def _time_modules(self, w: int) -> None:
        self.state_proj = nn.Linear(self.cfg.num_obs_history * self.cfg.max_state_dim, w)
        self.action_time_mlp_in = nn.Linear(2 * w, w)
        self.action_time_mlp_out = nn.Linear(w, w)

    # -- initialisation ---------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """Random initialisation, one rule (:meth:`init_parameter`) and one generator per parameter,
        so any parameter can be initialised alone (a sharded build does so as it materialises)."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p, parameter_generator(self.init_seed, name))

    def load_initial_weights(self) -> None:
        """Pretrained weights from ``policy.pretrained_path`` (after random initialisation)."""
        if self.cfg.pretrained_path:
            from slurmvla.policy.pi0.weights import load_pretrained

            load_pretrained(self, self.cfg.pretrained_path)

    @staticmethod
    def init_parameter(name: str, p: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """PaliGemma-style: normal(0.02) weights, zero biases, Gemma RMSNorm weights 0 (they scale by
        1 + w), LayerNorm weights 1, adaptive-norm projections 0."""
        with torch.no_grad():
            if ".dense." in name or name.endswith("bias"):
                p.zero_()
            elif "layernorm" in name or "layer_norm" in name or name == "expert_norm.weight":
                p.fill_(1.0 if ("vision." in name) else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)

    # -- contract ---------------------------------------------------------------------------------

    @classmethod
    def sample_spec(cls, cfg: PolicyConfig) -> SampleSpec:
        from slurmvla.policy.pi0.weights import tokenizer_for

        # image_size=None: frames arrive as recorded; _pixels applies the reference preprocessing (a
        # resize in the data layer first would be a second, different one).
        return SampleSpec(
            image_size=None, action_horizon=cfg.action_horizon, num_obs_history=cfg.num_obs_history,
            tokenizer=tokenizer_for(cfg) if cls._data_tokenizes(cfg) else None,
            draws=(Draw("noise", "normal", (cfg.action_horizon, cfg.max_action_dim)), Draw("time_u", "uniform"),
                   *delay_draws(cfg)),
        )

    @classmethod
    def _data_tokenizes(cls, cfg: PolicyConfig) -> bool:
        """pi0's prompt is the instruction alone: the data pipeline tokenizes it."""
        return True

    @classmethod
    def check_data(cls, cfg: PolicyConfig, features: DataFeatures) -> None:
        super().check_data(cfg, features)
        if cfg.pretrained_path:  # before a model of billions of parameters is built for it
            from slurmvla.policy.pi0.weights import check_pretrained_path

            check_pretrained_path(cfg.pretrained_path)
        for what, dim, cap in (("state", features.state_dim, cfg.max_state_dim),
                               ("action", features.action_dim, cfg.max_action_dim)):
            if dim > cap:
                raise ValueError(f"the data's {what} has {dim} dims, more than policy.max_{what}_dim={cap} "
                                 f"(policy={cfg.name}); raise policy.max_{what}_dim (a pretrained checkpoint's "
                                 "heads fix it: 32 for the published ones)")
        heads_fit = cfg.num_heads % cfg.num_kv_heads == 0
        if not heads_fit:
            raise ValueError(f"policy.num_heads={cfg.num_heads} must be a multiple of policy.num_kv_heads="
                             f"{cfg.num_kv_heads}")

    def wrap_units(self) -> list[nn.Module]:
        return [*self.vision.layers, *self.layers]

    def expert_modules(self) -> list[nn.Module]:
        return [layer.expert for layer in self.layers] + [
            m for n, m in self.named_children() if n not in ("vision", "projector", "embed_tokens", "layers")]

    def lora_parts(self) -> dict[str, list[nn.Module]]:
        """openpi's split: the two language models (the backbone with its token embedding; the expert with
        its final norm) and the vision tower; the projector, the action and time projections are neither."""
        return {"vision": [self.vision], "backbone": [self.embed_tokens, *(layer.backbone for layer in self.layers)],
                "expert": [*(layer.expert for layer in self.layers), self.expert_norm]}

    def no_weight_decay(self, name: str, p: torch.Tensor) -> bool:
        return super().no_weight_decay(name, p) or name.startswith("embed_tokens.") or "position_embedding" in name

    # -- model ------------------------------------------------------------------------------------

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, H, W, 3]`` -> SigLIP's input ``[N, 3, S, S]`` in [-1, 1], on the device, as openpi
        and LeRobot preprocess: [0, 1] floats; an image not at ``policy.image_size`` resized with
        padding (aspect kept, centred, black bars) by bilinear interpolation without antialiasing."""
        return resize_with_pad(images.permute(0, 3, 1, 2).float() / 255.0, self.cfg.image_size) * 2.0 - 1.0

    def _checkpointing(self) -> bool:
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def _text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prompt's token ids and mask: pi0's come with the batch (the data pipeline tokenizes the
        instruction)."""
        return self.text_inputs(batch, self.reads_text)

    def _prompt(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The prompt's ids and mask without the columns that are padding in every sample: as
        :meth:`prepare_inference` left them, or trimmed here (which waits on the device for the count)."""
        if PROMPT_IDS in batch:
            return batch[PROMPT_IDS], batch[PROMPT_MASK]
        text = self._text(batch)
        return None if text is None else _trim_padding(*text)

    def prepare_inference(self, batch: dict, bucket: int = PROMPT_BUCKET) -> dict:
        """The host's part of :meth:`sample_actions` and of the training forward, done before the model runs
        (on the host batch, before it moves to the device): the prompt's ids and mask (pi0.5 writes and
        tokenizes its prompt from the state), cut to the smallest multiple of ``bucket`` columns that holds
        every sample's tokens. On the batch returned, ``sample_actions`` and ``forward`` never wait on the
        device (``sample_actions`` can be captured in a CUDA graph: :mod:`slurmvla.inference.graphs`), its
        shapes take few values (one graph each), and its actions and loss are those of the batch given
        (padding is masked and shifts no position). The trainer prepares with ``bucket=1``: the prompt cut
        exactly as the forward would cut it. A batch prepared already (or a part of one) is cut again."""
        text = (batch[PROMPT_IDS], batch[PROMPT_MASK]) if PROMPT_IDS in batch else self._text(batch)
        out = {k: v for k, v in batch.items() if k not in ("text", "text_mask", "instruction")}
        if text is not None:
            out[PROMPT_IDS], out[PROMPT_MASK] = _trim_padding(*text, bucket=bucket)
        return out

    def prepare_training(self, batch: dict) -> dict:
        """The trainer's host part of a training batch: :meth:`prepare_inference` with the prompt cut to a
        multiple of ``policy.prompt_bucket`` columns (default: 32 on a GPU, where each prompt length is a
        shape its attention kernels plan and its compiled layers compile for; 1 on the CPU)."""
        bucket = self.cfg.prompt_bucket or (PROMPT_BUCKET if self.action_in_proj.weight.is_cuda else 1)
        return self.prepare_inference(batch, bucket=bucket)

    def _prefix(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        images = batch["images"]
        b, cams = images.shape[:2]
        img = self.projector(self.vision(self._pixels(images.flatten(0, 1)),
                                         self.recompute if self._checkpointing() else None))
        per_cam = img.shape[1]
        parts = [img.reshape(b, cams * per_cam, -1)]
        keep = [batch["image_mask"][:, :, None].expand(b, cams, per_cam).reshape(b, cams * per_cam)]
        prompt = self._prompt(batch)
        if prompt is not None:
            ids, mask = prompt
            parts.append(self.embed_tokens(ids) * math.sqrt(self.cfg.width))
            keep.append(mask)
        parts, keep = self._state_in_prefix(batch, parts, keep)
        dtype = parts[0].dtype
        return torch.cat([x.to(dtype) for x in parts], dim=1), torch.cat(keep, dim=1)

    def _state_in_prefix(self, batch: dict, parts: list, keep: list) -> tuple[list, list]:
        return parts, keep

    def _step_conditions(self, times: list[float], b: int, dtype: torch.dtype, device: torch.device,
                         prefix: torch.Tensor | None = None) -> list[StepCondition | None]:
        """pi0.5's per-step conditions for the denoising ``times`` (pi0 has none); with ``prefix`` ``[B, H]``
        (training-time RTC's clean actions, at time 0) one per action token."""
        return [None] * len(times)

    def _suffix(self, batch: dict, x_t: torch.Tensor, t: torch.Tensor,
                with_cond: bool = True) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """Expert-stream tokens, how many leading ones form their own attention block (pi0's state
        token), and the time condition (pi0.5; none with ``with_cond=False``: its modulations were
        computed ahead)."""
        state = self._state_token(batch)
        a = self.action_in_proj(x_t)
        time = sinusoidal_time(t, a.shape[-1])
        time = (time[:, None, :] if time.dim() == 2 else time).expand_as(a).to(a.dtype)
        a = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, time], dim=-1))))
        return torch.cat([state.to(a.dtype), a], dim=1), 1, None

    def _state_token(self, batch: dict) -> torch.Tensor:
        """The normalized state, zero-padded to ``max_state_dim`` per history step, projected to one token."""
        state = pad_last(self.normalize_states(batch["state"]), self.cfg.max_state_dim)
        return self.state_proj(state.reshape(state.shape[0], -1))[:, None, :]

    def _masks(self, keep: torch.Tensor, s: int, lead: int) -> tuple[tuple, tuple]:
        b, p = keep.shape
        device = keep.device
        valid = torch.cat([keep, keep.new_ones(b, s)], dim=1)
        positions = valid.long().cumsum(dim=1) - 1
        block = torch.cat([torch.zeros(p, dtype=torch.long, device=device),
                           torch.ones(lead, dtype=torch.long, device=device),
                           torch.full((s - lead,), 2, dtype=torch.long, device=device)])
        allowed = (block[None, :] <= block[:, None])[None] & valid[:, None, :]  # [B, query, key]
        return rope(positions, self.cfg.head_dim), (allowed[:, None, :p, :p], allowed[:, None, p:, :])

    def _velocity(self, prefix: torch.Tensor, keep: torch.Tensor, batch: dict, x_t: torch.Tensor,
                  t: torch.Tensor, cache: PrefixCache | None = None, step: StepCondition | None = None) -> torch.Tensor:
        """The expert's velocity at ``(x_t, t)``: one training forward, or one denoising step. With a
        ``cache`` (inference), the first call fills it and later calls skip the prefix stream, reading
        each layer's prefix keys / values from it; ``step``: pi0.5's condition at ``t``, computed ahead."""
        suffix, lead, cond = self._suffix(batch, x_t, t, with_cond=step is None)
        filled = cache is not None and bool(cache.kv)
        if filled:
            rotary, masks = cache.rotary, cache.masks
        else:
            rotary, masks = self._masks(keep, suffix.shape[1], lead)
        for j, layer in enumerate(self.layers):
            if self._checkpointing():
                prefix, suffix, _ = self.recompute(layer, j, prefix, suffix, rotary, masks, cond)
            else:
                layer_cond = cond if step is None else step.layers[j]
                prefix, suffix, kv = layer(prefix, suffix, rotary, masks, layer_cond, cache.kv[j] if filled else None)
                if cache is not None and not filled:
                    cache.kv.append(kv)
        if cache is not None and not filled:
            cache.rotary, cache.masks = rotary, masks
        out, _ = _norm(self.expert_norm, suffix, cond if step is None else (step.final,))
        return self.action_out_proj(out[:, lead:])

    def _kernels(self):
        """The attention kernels policy.attention_kernels asks for the training forward on a GPU, in its order
        (torch's own choice without it). Inference keeps torch's choice: its shapes repeat (the prompt cut
        to a multiple of 32 tokens, one CUDA graph per shape), so a kernel planned per shape costs nothing."""
        names = self.cfg.attention_kernels
        if not names or not self.action_in_proj.weight.is_cuda:
            return contextlib.nullcontext()
        return sdpa_kernel([SDPA_BACKENDS[n] for n in names], set_priority=True)

    def forward(self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None) -> dict:
        with self._kernels():
            return self._loss(batch, noise, t)

    def _loss(self, batch: dict, noise: torch.Tensor | None, t: torch.Tensor | None) -> dict:
        """Flow-matching loss in the padded action space, reported over the data's dims: the mean over
        every chunk element (LeRobot's and openpi's convention; see the module docstring)."""
        actions = pad_last(self.normalize_actions(batch["actions"]), self.cfg.max_action_dim)
        noise, t = noise_and_time(batch, actions, noise, t)
        prefix, keep = self._prefix(batch)
        every = torch.ones_like(batch["action_mask"], dtype=torch.bool)
        if self.cfg.rtc_training.enabled:  # a delayed, clean prefix of each chunk, outside the loss
            x_t, t, every = delayed_chunk(batch, actions, noise, t, self.cfg.rtc_training, every)
        else:
            x_t = noisy_actions(actions, noise, t)
        pred = self._velocity(prefix, keep, batch, x_t.to(prefix.dtype), t)
        d = self.cfg.action_dim
        return flow_matching_loss(pred[..., :d], noise[..., :d], actions[..., :d], every)

    def prefix_modules(self) -> list[nn.Module]:
        """What a request runs once, before its denoising steps: the vision tower, its projector and the
        backbone's half of every layer (``serve.fp8_prefix`` runs their matrix products in float8:
        slurmvla/inference/fp8.py)."""
        return [self.vision, self.projector, *(layer.backbone for layer in self.layers)]

    def projection_groups(self):
        """For inference: each Gemma layer's query / key / value projections, and its MLP's gate / up
        projections, as ``(owner, name, linears)``: projections that read one input, which inference may
        store as one weight ``owner.<name>`` (:func:`slurmvla.inference.optimize.fuse_projections`; the
        layers read it when it is there). At batch 1 the action expert's products have 50 rows, and its
        key / value products 256 columns: too small to keep the GPU's memory system busy, so one wider
        product reads the same weights in less time."""
        for layer in self.layers:
            for part in (layer.backbone, layer.expert):
                attn = part.self_attn
                yield attn, "fused_qkv", [m for m in (attn.q_proj, attn.k_proj, attn.v_proj) if m is not None]
                if part.mlp is not None:
                    yield part.mlp, "fused_gate_up", [part.mlp.gate_proj, part.mlp.up_proj]

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: torch.Tensor | None = None, num_steps: int | None = None,
                       rtc: Guidance | None = None) -> torch.Tensor:
        """Euler integration from noise (t = 1) to actions (t = 0); the prefix runs once, later steps
        reuse its keys / values. Returns actions in the dataset's units. ``rtc``: real-time chunking's
        guidance towards a previous chunk (slurmvla/policy/rtc.py), through the same cached prefix."""
        steps = num_steps or self.cfg.num_inference_steps
        b = batch["state"].shape[0]
        x = torch.randn((b, self.cfg.action_horizon, self.cfg.max_action_dim), device=batch["state"].device) \
            if noise is None else pad_last(noise.float(), self.cfg.max_action_dim)
        dt = -1.0 / steps
        prefix, keep = self._prefix(batch)
        cache = PrefixCache()
        times = [1.0 + i * dt for i in range(steps)]
        guide = conditioning(self.cfg, rtc, self.action_offset, self.action_scale, self.cfg.max_action_dim)
        # pi0.5's conditions, computed ahead: per step, and with a clean prefix (training-time RTC) per action token.
        conditions = self._step_conditions(times, b, prefix.dtype, x.device,
                                           guide.mask if isinstance(guide, Prefix) else None)
        for i in range(steps):
            t = torch.full((b,), times[i], device=x.device)
            if guide is None or isinstance(guide, Prefix):
                if guide is not None:  # training-time RTC: the previous chunk's first d actions, clean
                    x, t = guide.fill(x), guide.times(t)
                x = x + dt * self._velocity(prefix, keep, batch, x.to(prefix.dtype), t, cache, conditions[i]).float()
                continue
            x = x + dt * guide.velocity(lambda xt, t=t, c=conditions[i]: self._velocity(
                prefix, keep, batch, xt.to(prefix.dtype), t, cache, c), x, times[i])
            # The guidance differentiates through x_t only: the cached prefix keys / values drop their history.
            cache.kv = [(k.detach(), v.detach()) for k, v in cache.kv]
        if isinstance(guide, Prefix):
            x = guide.fill(x)
        actions = x[..., : self.cfg.action_dim] * self.action_scale + self.action_offset
        return actions if guide is None else guide.freeze(actions)


def _trim_padding(ids: torch.Tensor, mask: torch.Tensor, bucket: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt without its trailing columns that are padding in every sample of the batch (kept to a
    multiple of ``bucket`` columns). Padding is masked out of every attention and shifts no position
    (positions count the tokens kept), so the outputs are the same with less work: a pi0.5 prompt fills
    ~60 of its 200 tokens, and LeRobot runs all 200 through the backbone."""
    used = mask.any(dim=0)
    n = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
    n = min(mask.shape[1], -(-n // bucket) * bucket)
    return ids[:, :n], mask[:, :n]


class Pi05Policy(Pi0Policy):
    """pi0.5: adaptive-RMSNorm time conditioning in every expert norm; the state written into the
    prompt as discretised text (published) or, with ``policy.state_input=continuous``, one projected
    prefix token."""

    ADAPTIVE_TIME = True
    _warned_full_prompt = False

    def _time_modules(self, w: int) -> None:
        if self.cfg.state_input == "continuous":
            self.state_proj = nn.Linear(self.cfg.num_obs_history * self.cfg.max_state_dim, self.cfg.width)
        else:
            from slurmvla.policy.pi0.weights import tokenizer_for

            self.prompt_tokenizer = tokenizer_for(self.cfg)
        self.time_mlp_in = nn.Linear(w, w)
        self.time_mlp_out = nn.Linear(w, w)

    @classmethod
    def _data_tokenizes(cls, cfg: PolicyConfig) -> bool:
        """The discrete-state prompt holds the normalized state, which the policy's own statistics
        define: the policy writes and tokenizes it."""
        return cfg.state_input == "continuous"

    def expert_modules(self) -> list[nn.Module]:
        return [m for m in super().expert_modules() if m is not getattr(self, "state_proj", None)]

    def prompts(self, batch: dict) -> list[str]:
        """LeRobot's / openpi's pi0.5 prompt per sample: ``Task: {instruction, cleaned}, State: {256-bin
        ids of the normalized state};\nAction: `` (bins of [-1, 1]; below -1 gives -1, from 1 - 1/128 up 255)."""
        raw = batch["state"]
        offset, scale = self._normalization_on(raw.device)
        state = ((raw.float() - offset) / scale).reshape(raw.shape[0], -1)
        bins = np.digitize(state.detach().float().cpu().numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        return [f"Task: {task.strip().replace('_', ' ').replace(chr(10), ' ')}, State: {' '.join(map(str, row))};\nAction: "
                for task, row in zip(batch["instruction"], bins.tolist())]

    def _normalization_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The state's offset and scale where the state is: the buffers themselves, or (a batch still on the
        host, as the trainer prepares it before moving it to the GPU) host copies, made again only when
        a buffer was written or replaced (its storage or version counter changed; reading those waits on
        nothing)."""
        offset, scale = self.state_offset, self.state_scale
        if offset.device == device:
            return offset, scale
        key = (device, offset.data_ptr(), offset._version, scale.data_ptr(), scale._version)
        cached = self.__dict__.get("_host_normalization")
        if cached is None or cached[0] != key:
            cached = (key, offset.to(device), scale.to(device))
            self.__dict__["_host_normalization"] = cached
        return cached[1], cached[2]

    def _text(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        given = super()._text(batch)  # None for the discrete-state prompt, after checking the batch has no tokens
        if given is not None:
            return given
        ids, mask = zip(*(self.prompt_tokenizer.encode(p) for p in self.prompts(batch)))
        ids, mask = torch.stack(ids), torch.stack(mask)
        if mask[:, -1].any() and not self._warned_full_prompt:
            self._warned_full_prompt = True
            log.warning("a pi0.5 prompt filled policy.max_text_len=%d tokens and may be cut (the state ids and "
                        "'Action: ' come last); raise policy.max_text_len", self.cfg.max_text_len)
        device = batch["state"].device
        return ids.to(device), mask.to(device)

    def _state_in_prefix(self, batch: dict, parts: list, keep: list) -> tuple[list, list]:
        if self.cfg.state_input != "continuous":
            return parts, keep
        state = self._state_token(batch)
        return [*parts, state], [*keep, torch.ones(state.shape[0], 1, dtype=torch.bool, device=state.device)]

    def _suffix(self, batch: dict, x_t: torch.Tensor, t: torch.Tensor,
                with_cond: bool = True) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        a = self.action_in_proj(x_t)
        return a, 0, self._time_condition(t, a.dtype) if with_cond else None

    def _time_condition(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        time = sinusoidal_time(t, self.cfg.expert_width).to(dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time))))

    def _step_conditions(self, times: list[float], b: int, dtype: torch.dtype, device: torch.device,
                         prefix: torch.Tensor | None = None) -> list[StepCondition]:
        steps = len(times)
        # Filled where the model runs (no copy from the host: a CUDA graph captures this too), each step's value
        # the float32 the loop's torch.full gives it. A clean prefix adds time 0, selected per action token.
        t = torch.cat([torch.full((b,), time, device=device) for time in [*times, *([0.0] if prefix is not None else [])]])
        cond = self._time_condition(t, dtype)

        def per_step(norm: AdaptiveRMSNorm) -> torch.Tensor:
            m = norm.dense(cond).unflatten(0, (-1, b))
            if prefix is None:
                return m
            return torch.where(prefix[None, :, :, None], m[steps][None, :, None, :], m[:steps, :, None, :])

        layers = [(per_step(layer.expert.input_layernorm), per_step(layer.expert.post_attention_layernorm))
                  for layer in self.layers]
        final = per_step(self.expert_norm)
        return [StepCondition([(a[i], p[i]) for a, p in layers], final[i]) for i in range(steps)]


def describe(cfg: PolicyConfig) -> dict[str, Any]:
    """Parameter counts by part (no weights: built on the meta device)."""
    from slurmvla.policy import policy_class

    with torch.device("meta"):
        policy = policy_class(cfg)(cfg, None)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    expert = sum(count(m) for m in policy.expert_modules())
    return {"total": count(policy), "vision": count(policy.vision), "expert": expert,
            "backbone_lm": count(policy) - count(policy.vision) - expert}
