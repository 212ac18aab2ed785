"""The reference policy: a pi0-style flow-matching VLA in plain PyTorch.

    images --ViT--> image tokens --+
    instruction --bytes--> tokens  +--> prefix (backbone stream) --+
    proprio state --> one token ---+                              | joint attention, layer by layer
    noisy action chunk + time --> suffix (action-expert stream) --+--> velocity --> flow-matching loss

Each ``VLALayer`` bundles one backbone sub-layer and one action-expert sub-layer that attend
jointly (prefix tokens see the prefix; action tokens see the prefix and each other), so a sharding
engine wraps one unit per layer. In the last layer the prefix only supplies keys and values: its
query, output projection and MLP would receive no gradient, so they do not exist.

Flow matching (pi0 convention): ``x_t = t * noise + (1 - t) * actions``, the expert predicts
``u = noise - actions``; the loss is the MSE over valid chunk steps, normalized per element.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from slurmvla.config.data import SAMPLE_MODES
from slurmvla.config.policy import PolicyConfig
from slurmvla.data.spec import Draw, SampleSpec
from slurmvla.policy.attention import attention, resolve_attention
from slurmvla.policy.base import Policy
from slurmvla.policy.flow_matching import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.policy.recompute import Recompute
from slurmvla.policy.rtc import Guidance, Guide, conditioning, delay_draws, delayed_chunk
from slurmvla.policy.tokenizer import VOCAB_SIZE, ByteTokenizer

# Sample modes (a sample's "mode" field indexes slurmvla.config.data.SAMPLE_MODES).
FORWARD_DYNAMICS = SAMPLE_MODES.index("forward_dynamics")
INVERSE_DYNAMICS = SAMPLE_MODES.index("inverse_dynamics")


class MLP(nn.Module):
    def __init__(self, dim: int, ratio: float):
        super().__init__()
        hidden = int(dim * ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, impl: str):
        super().__init__()
        self.heads, self.impl = heads, impl
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(attention(q, k, v, None, self.impl).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """A small ViT shared by all cameras; outputs tokens in the backbone width."""

    def __init__(self, cfg: PolicyConfig, impl: str):
        super().__init__()
        self.patch = nn.Conv2d(3, cfg.vision_width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.position_embedding = nn.Parameter(torch.zeros(1, num_patches, cfg.vision_width))
        self.blocks = nn.ModuleList(
            VisionBlock(cfg.vision_width, cfg.vision_heads, cfg.mlp_ratio, impl) for _ in range(cfg.vision_depth)
        )
        self.norm = nn.LayerNorm(cfg.vision_width)
        self.proj = nn.Linear(cfg.vision_width, cfg.width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images``: uint8 ``[B, cams, H, W, 3]`` (channels-last, as decoded) -> ``[B, cams * patches, width]``.

        The layout change to channels-first happens here, on the device, where it costs nothing;
        in the data workers it was a strided copy of every image."""
        b, c = images.shape[:2]
        x = images.flatten(0, 1).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        x = self.patch(x).flatten(2).transpose(1, 2) + self.position_embedding
        for block in self.blocks:
            x = block(x)
        return self.proj(self.norm(x)).reshape(b, -1, self.proj.out_features)


class JointAttention(nn.Module):
    """One stream's half of a joint attention layer: its own projections into shared heads."""

    def __init__(self, dim: int, heads: int, head_dim: int, queries: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q = nn.Linear(dim, heads * head_dim) if queries else None
        self.kv = nn.Linear(dim, 2 * heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim) if queries else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k, v = self.kv(x).view(b, n, 2, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = None if self.q is None else self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        return q, k, v


class VLALayer(nn.Module):
    """One decoder layer owning both streams: the unit a sharding engine wraps."""

    def __init__(self, cfg: PolicyConfig, impl: str, prefix_output: bool):
        super().__init__()
        self.impl, self.prefix_output = impl, prefix_output
        self.backbone_norm1 = nn.RMSNorm(cfg.width)
        self.backbone_attn = JointAttention(cfg.width, cfg.num_heads, cfg.head_dim, queries=prefix_output)
        if prefix_output:
            self.backbone_norm2 = nn.RMSNorm(cfg.width)
            self.backbone_mlp = MLP(cfg.width, cfg.mlp_ratio)
        self.expert_norm1 = nn.RMSNorm(cfg.expert_width)
        self.expert_attn = JointAttention(cfg.expert_width, cfg.num_heads, cfg.head_dim, queries=True)
        self.expert_norm2 = nn.RMSNorm(cfg.expert_width)
        self.expert_mlp = MLP(cfg.expert_width, cfg.mlp_ratio)

    def expert_parts(self) -> list[nn.Module]:
        return [self.expert_norm1, self.expert_attn, self.expert_norm2, self.expert_mlp]

    def forward(self, prefix: torch.Tensor | None, suffix: torch.Tensor, prefix_keep: torch.Tensor,
                prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
        """``prefix_keep``: bool ``[B, P]``, False for padding tokens and missing cameras.

        Returns ``(prefix, suffix, (k, v) of the prefix)``. Prefix tokens never attend to the
        suffix, so at inference the prefix's keys and values are the same at every denoising step:
        given ``prefix_kv`` (from an earlier call), the prefix stream is skipped (``prefix`` may be
        None and None is returned for it) and only the action tokens are computed."""
        s = suffix.shape[1]
        if prefix_kv is None:
            qp, kp, vp = self.backbone_attn.project(self.backbone_norm1(prefix))
        else:
            (kp, vp), qp = prefix_kv, None
        p = kp.shape[2]
        qs, ks, vs = self.expert_attn.project(self.expert_norm1(suffix))
        k, v = torch.cat([kp, ks], dim=2), torch.cat([vp, vs], dim=2)
        keys_ok = torch.cat([prefix_keep, prefix_keep.new_ones(prefix_keep.shape[0], s)], dim=1)[:, None, None, :]
        # Action tokens see everything valid; prefix tokens see only the prefix.
        suffix_mask = keys_ok.expand(-1, 1, s, -1)
        ys = attention(qs, k, v, suffix_mask, self.impl)
        suffix = suffix + self.expert_attn.out(ys.transpose(1, 2).flatten(2))
        suffix = suffix + self.expert_mlp(self.expert_norm2(suffix))
        if self.prefix_output and prefix_kv is None:
            prefix_mask = keys_ok[..., :p].expand(-1, 1, p, -1)
            yp = attention(qp, kp, vp, prefix_mask, self.impl)
            prefix = prefix + self.backbone_attn.out(yp.transpose(1, 2).flatten(2))
            prefix = prefix + self.backbone_mlp(self.backbone_norm2(prefix))
        elif prefix_kv is not None:
            prefix = None
        return prefix, suffix, (kp, vp)


class ActionTimeEmbedding(nn.Module):
    def __init__(self, action_dim: int, width: int):
        super().__init__()
        self.width = width
        self.action = nn.Linear(action_dim, width)
        self.mlp_in = nn.Linear(2 * width, width)
        self.mlp_out = nn.Linear(width, width)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        half = self.width // 2
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        # t: [B], or [B, H] (a time per action: training-time real-time chunking's clean prefix).
        angles = t.float()[..., None] * freqs * 1000.0
        time = F.pad(torch.cat([angles.sin(), angles.cos()], dim=-1), (0, self.width - 2 * half))
        if time.dim() == 2:
            time = time[:, None, :].expand(-1, x_t.shape[1], -1)
        a = self.action(x_t)
        h = torch.cat([a, time.to(a.dtype)], dim=-1)
        return self.mlp_out(F.silu(self.mlp_in(h)))


class FlowMatchingVLA(Policy):
    supports_rtc = True  # sample_actions(..., rtc=): real-time chunking (slurmvla/policy/rtc.py)
    supports_rtc_training = True  # policy.rtc_training: a time per action, a clean prefix left out of the loss

    def __init__(self, cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.cfg = cfg
        # What the batches hold is settled here, from the sample spec the data is built to: never by
        # asking the other ranks in forward.
        self.reads_text = self.sample_spec(cfg).tokenizer is not None
        impl = resolve_attention(cfg.attention_implementation)
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self.recompute = Recompute.from_config(cfg)
        self.vision = VisionEncoder(cfg, impl)
        # One embedding per (history frame, camera): images arrive as [B, num_obs_history * cams, ...].
        self.camera_embedding = nn.Parameter(torch.zeros(cfg.num_obs_history * cfg.num_cameras, cfg.width))
        self.text_embed = nn.Embedding(VOCAB_SIZE, cfg.width)
        self.state_proj = nn.Linear(cfg.num_obs_history * cfg.state_dim, cfg.width)
        if cfg.dynamics:
            # Dynamics samples (data.mode=joint/forward_dynamics/inverse_dynamics) add one prefix token:
            # the mode's embedding plus its conditioning (the action chunk, or the future state).
            self.mode_embedding = nn.Embedding(len(SAMPLE_MODES), cfg.width)
            self.cond_actions = nn.Linear(cfg.action_horizon * cfg.action_dim, cfg.width)
            self.cond_future_state = nn.Linear(cfg.state_dim, cfg.width)
        self.layers = nn.ModuleList(VLALayer(cfg, impl, prefix_output=i < cfg.depth - 1) for i in range(cfg.depth))
        self.expert_in = ActionTimeEmbedding(cfg.action_dim, cfg.expert_width)
        self.expert_out_norm = nn.RMSNorm(cfg.expert_width)
        self.expert_out = nn.Linear(cfg.expert_width, cfg.action_dim)
        # Normalization (x - offset) / scale, from the data's stats in the mode data.*_normalization chose.
        self.register_normalization(cfg, stats)
        self.apply(self._init)
        self.freeze(self.vision, cfg)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, VisionEncoder):
            nn.init.trunc_normal_(m.position_embedding, std=0.02)

    # -- contract ---------------------------------------------------------------------------------

    @classmethod
    def sample_spec(cls, cfg: PolicyConfig) -> SampleSpec:
        # The flow-matching noise and time are drawn per sample by the data pipeline, so the training
        # randomness is a pure function of (seed, epoch, sample) on any world size.
        return SampleSpec(
            image_size=cfg.image_size, action_horizon=cfg.action_horizon, num_obs_history=cfg.num_obs_history,
            tokenizer=ByteTokenizer(cfg.max_text_len),
            draws=(Draw("noise", "normal", (cfg.action_horizon, cfg.action_dim)), Draw("time_u", "uniform"),
                   *delay_draws(cfg)),
        )

    def wrap_units(self) -> list[nn.Module]:
        return [*self.vision.blocks, *self.layers]

    def lora_parts(self) -> dict[str, list[nn.Module]]:
        """The vision tower; the transformer layers (their expert halves are the expert's) and the text
        embedding as the backbone; the input and output projections are neither."""
        return {"vision": [self.vision], "backbone": [self.text_embed, *self.layers],
                "expert": [m for layer in self.layers for m in layer.expert_parts()]}

    def expert_modules(self) -> list[nn.Module]:
        parts = [self.expert_in, self.expert_out_norm, self.expert_out]
        for layer in self.layers:
            parts.extend(layer.expert_parts())
        return parts

    # -- model ------------------------------------------------------------------------------------

    def _prefix(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        text = self.text_inputs(batch, self.reads_text)  # a batch that does not fit fails before any compute
        images = batch["images"]
        b, cams = images.shape[:2]
        img = self.vision(images)
        per_cam = img.shape[1] // cams
        img = img + self.camera_embedding[:cams].repeat_interleave(per_cam, dim=0)
        state = self.normalize_states(batch["state"]).reshape(b, -1)
        parts = [img, self.state_proj(state)[:, None, :].to(img.dtype)]
        keep = [batch["image_mask"].repeat_interleave(per_cam, dim=1), torch.ones(b, 1, dtype=torch.bool, device=images.device)]
        if self.cfg.dynamics:
            parts.append(self._dynamics_token(batch).to(img.dtype))
            keep.append(torch.ones(b, 1, dtype=torch.bool, device=images.device))
        if text is not None:
            # A sample with an empty instruction (only BOS/EOS: a data source without instructions)
            # sees no text tokens, as if they were absent: its result does not depend on its
            # batch-mates' instructions.
            has_text = text[1].sum(dim=1) > 2
            parts.insert(1, self.text_embed(text[0]).to(img.dtype))
            keep.insert(1, text[1] & has_text[:, None])
        return torch.cat(parts, dim=1), torch.cat(keep, dim=1)

    def _velocity(self, prefix: torch.Tensor, keep: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                  cache: list | None = None) -> torch.Tensor:
        """The expert's velocity at ``(x_t, t)``: one training forward, or one denoising step. With a
        ``cache`` (inference), the first call fills it with each layer's prefix keys and values and
        later calls reuse them, skipping the prefix stream (the prefix never attends to the suffix).
        Every layer still runs through its own ``__call__``, so sharding hooks see it."""
        suffix = self.expert_in(x_t, t)
        filled = bool(cache)
        for j, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                prefix, suffix, _ = self.recompute(layer, j, prefix, suffix, keep)
            else:
                prefix, suffix, kv = layer(prefix, suffix, keep, cache[j] if filled else None)
                if cache is not None and not filled:
                    cache.append(kv)
        return self.expert_out(self.expert_out_norm(suffix))

    def _dynamics_token(self, batch: dict) -> torch.Tensor:
        """Mode embedding + conditioning: forward dynamics sees the action chunk, inverse dynamics the
        future state; both projections run on every sample (zeroed where unused), so every parameter
        takes part in every step whatever the batch's mix of modes."""
        b = batch["state"].shape[0]
        device = batch["state"].device
        mode = batch.get("mode")
        if mode is None:  # data.mode=policy, or inference: every sample is a policy sample
            mode = torch.zeros(b, dtype=torch.long, device=device)
        fwd = (mode == FORWARD_DYNAMICS).float()[:, None]
        inv = (mode == INVERSE_DYNAMICS).float()[:, None]
        if "actions" in batch:
            actions = self.normalize_actions(batch["actions"]) * batch["action_mask"][:, :, None].float()
        else:  # an observation at inference time: no recorded actions (only forward dynamics reads them)
            actions = torch.zeros(b, self.cfg.action_horizon, self.cfg.action_dim, device=device)
        future = batch.get("future_states")
        future = self.normalize_states(future[:, -1]) if future is not None else torch.zeros_like(self.state_offset).expand(b, -1)
        token = (self.mode_embedding(mode) + self.cond_actions(actions.reshape(b, -1)) * fwd
                 + self.cond_future_state(future) * inv)
        return token[:, None, :]

    def _targets(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """What the flow is trained to produce: the action chunk, or for forward dynamics the future states."""
        actions = self.normalize_actions(batch["actions"])
        mask = batch["action_mask"]
        if self.cfg.dynamics and "mode" in batch:
            fwd = batch["mode"] == FORWARD_DYNAMICS
            states = self.normalize_states(batch["future_states"])
            actions = torch.where(fwd[:, None, None], states, actions)
            mask = torch.where(fwd[:, None], batch["future_mask"], mask)
        return actions, mask

    def forward(self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None) -> dict:
        """Flow-matching loss (slurmvla/policy/flow_matching.py): noise and time from the arguments, the batch
        (drawn per sample by the data pipeline) or the global RNG, in that order."""
        actions, action_mask = self._targets(batch)
        noise, t = noise_and_time(batch, actions, noise, t)
        prefix, keep = self._prefix(batch)
        if self.cfg.rtc_training.enabled:  # a delayed, clean prefix of each chunk, outside the loss
            x_t, t, action_mask = delayed_chunk(batch, actions, noise, t, self.cfg.rtc_training, action_mask)
        else:
            x_t = noisy_actions(actions, noise, t)
        pred = self._velocity(prefix, keep, x_t, t)
        return flow_matching_loss(pred, noise, actions, action_mask)

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: torch.Tensor | None = None, num_steps: int | None = None,
                       rtc: Guidance | None = None) -> torch.Tensor:
        """Integrate the learned velocity from noise (t = 1) to actions (t = 0); returns raw actions. ``rtc``:
        real-time chunking's guidance towards a previous chunk (slurmvla/policy/rtc.py)."""
        steps = num_steps or self.cfg.num_inference_steps
        b = batch["state"].shape[0]
        shape = (b, self.cfg.action_horizon, self.cfg.action_dim)
        x = torch.randn(shape, device=batch["state"].device) if noise is None else noise.float()
        prefix, keep = self._prefix(batch)
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # the prefix stream runs in the first step only
        condition = conditioning(self.cfg, rtc, self.action_offset, self.action_scale)
        if isinstance(condition, Guide):
            return self._guided(prefix, keep, x, steps, cache, condition)
        for i in range(steps):
            t = torch.full((b,), 1.0 - i / steps, device=x.device)
            if condition is not None:  # training-time RTC: the previous chunk's first d actions, clean
                x, t = condition.fill(x), condition.times(t)
            x = x - self._velocity(prefix, keep, x, t, cache).float() / steps
        if condition is None:
            return x * self.action_scale + self.action_offset
        return condition.freeze(condition.fill(x) * self.action_scale + self.action_offset)

    def _guided(self, prefix: torch.Tensor, keep: torch.Tensor, x: torch.Tensor, steps: int, cache: list,
                guide: Guide) -> torch.Tensor:
        """``sample_actions``' loop with RTC's guided velocity; the prefix's keys / values filled by the first
        step are kept without their autograd history (the guidance differentiates through ``x_t`` only)."""
        for i in range(steps):
            time = 1.0 - i / steps
            t = torch.full((x.shape[0],), time, device=x.device)
            x = x - guide.velocity(lambda xt, t=t: self._velocity(prefix, keep, xt, t, cache), x, time) / steps
            cache[:] = [tuple(v.detach() for v in kv) for kv in cache]
        return guide.freeze(x * self.action_scale + self.action_offset)
