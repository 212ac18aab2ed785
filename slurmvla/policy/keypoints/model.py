"""The keypoint policies (``policy=keypoints``, ``policy=keypoints_flow``; their options: ``config`` beside it): small
visuomotor policies for the closed loop on a CPU, built through the same contract as a user's own. Per camera a
backbone (three convolutions, or ResNet-18's trunk) and a spatial softmax give a few image positions; with the
normalized state, :class:`KeypointPolicy`'s MLP regresses the action chunk and :class:`KeypointFlowPolicy`'s
flow-matching head samples it.

    python -m slurmvla.train experiment=sim_pick policy=keypoints_flow
"""

from __future__ import annotations

import torch
from torch import nn

from slurmvla.data.spec import Draw, SampleSpec
from slurmvla.policy.base import register_normalization
from slurmvla.policy.baselines import chunk_mse
from slurmvla.policy.flow_matching import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.policy.rtc import Guidance, conditioning, delay_draws, delayed_chunk, integrate
from slurmvla.policy.tokenizer import VOCAB_SIZE, ByteTokenizer


class SpatialSoftmax(nn.Module):
    """Feature maps -> the expected image position of each channel's activation (Levine et al. 2016):
    a few keypoints that say where things are, which global pooling would average away.

    ``channels`` given: each map is first standardized over its positions (zero mean, unit standard deviation)
    and multiplied by a learned per-channel temperature (starting at 1), so the softmax is peaked from the first
    step. Without it the softmax reads the raw maps, and a small convolution's maps vary by ~0.1 across the
    image at initialization: over 24 x 24 positions the softmax is then nearly uniform, every keypoint sits at
    the image's centre whatever the image, and its gradient is divided by the number of positions (measured on
    Meta-World's button-press after 2000 steps: the maps still varied by ~0.1, the keypoints moved by ~0.001
    between episodes whose buttons stood on opposite sides, and the first action was the same for all)."""

    def __init__(self, channels: int | None = None):
        super().__init__()
        self.log_temperature = None if channels is None else nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        flat = x.flatten(2)
        if self.log_temperature is not None:
            mean, std = flat.mean(dim=-1, keepdim=True), flat.std(dim=-1, keepdim=True)
            flat = (flat - mean) / (std + 1e-5) * self.log_temperature.exp()[:, None]
        weights = torch.softmax(flat, dim=-1).view(b, c, h, w)
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        return torch.cat([(weights.sum(dim=3) * ys).sum(dim=2), (weights.sum(dim=2) * xs).sum(dim=2)], dim=1)


# The keypoint encoders' backbones (policy.kwargs.encoder).
ENCODERS = ("conv", "resnet18")


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016) with GroupNorm in place of BatchNorm, as Diffusion Policy trains its
    image encoder (one group per 16 channels): two 3 x 3 convolutions and the shortcut, a 1 x 1 convolution where
    the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(max(cout // 16, 1), cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(max(cout // 16, 1), cout))
        self.shortcut = (nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(max(cout // 16, 1), cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet18(width: int = 64) -> nn.Sequential:
    """ResNet-18's convolutional trunk (no pooling, no classifier), GroupNorm throughout: a 7 x 7 stem and
    max-pool, then four stages of two basic blocks of ``width``, 2x, 4x and 8x channels, each after the first
    halving the resolution (an image of 96 px gives 3 x 3 maps of ``8 * width`` channels). At ``width=64`` it is
    torchvision's ``resnet18`` without its ``fc``: 11,176,512 parameters."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.GroupNorm(max(width // 16, 1), width),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for stage, stride in enumerate((1, 2, 2, 2)):
        cout = width * 2**stage
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers)


def keypoint_backbone(encoder: str, keypoints: int, width: int) -> list[nn.Module]:
    """The layers from an image to ``keypoints`` feature maps, which the spatial softmax reads."""
    if encoder == "conv":  # three convolutions: 96 px -> 24 x 24 maps
        return [nn.Conv2d(3, 32, kernel_size=5, stride=2, padding=2), nn.ReLU(),
                nn.Conv2d(32, 32, kernel_size=3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(32, keypoints, kernel_size=3, padding=1)]
    if encoder == "resnet18":  # robomimic's and Diffusion Policy's: the trunk, then a 1 x 1 convolution to keypoints
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"policy.kwargs.width={width!r} is not valid: the first stage's channels, a positive integer "
                             "(64 is ResNet-18's own)")
        return [resnet18(width), nn.Conv2d(8 * width, keypoints, kernel_size=1)]
    raise ValueError(f"policy.kwargs.encoder={encoder!r} is not valid; choose one of {list(ENCODERS)}")


class InstructionEncoder(nn.Module):
    """The instruction's bytes (the byte tokenizer's ids, ``policy.max_text_len`` of them, the same prompt path as
    the reference VLA's: the dataset's task string in training, openpi's ``prompt`` when served) -> ``dim``
    features: an embedding per byte, a convolution over five neighbours (the words' spellings), the maximum over
    the instruction's bytes, a linear map."""

    def __init__(self, dim: int = 64, width: int = 128):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(VOCAB_SIZE, 32)
        self.conv = nn.Conv1d(32, width, kernel_size=5, padding=2)
        self.out = nn.Linear(width, dim)

    def forward(self, text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(self.embed(text).transpose(1, 2)))  # [B, width, L]
        h = h.masked_fill(~mask.bool()[:, None, :], float("-inf")).amax(dim=2)
        return self.out(h)


class KeypointEncoding(nn.Module):
    """The keypoint policies' observation encoder: per camera (and history frame) a backbone (by default three
    convolutions) and a spatial softmax (``keypoints`` image positions), with the normalized state; ``features(batch)`` ->
    ``[B, feature_dim]``. Subclasses add the head that turns the features into an action chunk.
    ``spatial_norm`` (``policy.kwargs.spatial_norm=true``): the softmax reads standardized maps with a learned
    temperature (:class:`SpatialSoftmax`). Off by default: the encoder every run so far trained, whose checkpoints
    load and act as they did (docs/benchmarks.md#meta-world: what it changes, measured).
    ``encoder`` (``policy.kwargs.encoder``): ``conv`` (the default) or ``resnet18``, Diffusion Policy's image trunk
    (:func:`resnet18`, ``width`` channels in its first stage: 64 is ResNet-18's own, ~25x the ``conv`` encoder's
    multiply-adds at 96 px).
    ``prompt`` (``policy.kwargs.prompt=true``): the features also hold the instruction's
    (:class:`InstructionEncoder`), so one policy is told its task in words (Meta-World's MT50); off by default: the
    policy reads no instruction, as every single-task run so far."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, keypoints: int = 16,  # noqa: ANN001
                 spatial_norm: bool = False, encoder: str = "conv", width: int = 64, prompt: bool = False):
        super().__init__()
        self.horizon, self.action_dim = cfg.action_horizon, cfg.action_dim
        frames = cfg.num_obs_history * cfg.num_cameras
        self.encoders = nn.ModuleList(nn.Sequential(
            *keypoint_backbone(encoder, keypoints, width), SpatialSoftmax(keypoints if spatial_norm else None))
            for _ in range(frames))
        if not isinstance(prompt, bool):
            raise ValueError(f"policy.kwargs.prompt={prompt!r} is not valid; choose true (the policy reads the "
                             "instruction) or false")
        self.instruction = InstructionEncoder() if prompt else None
        self.feature_dim = (frames * 2 * keypoints + cfg.num_obs_history * cfg.state_dim
                            + (self.instruction.dim if prompt else 0))
        register_normalization(self, cfg, stats)

    @staticmethod
    def tokenizer(cfg) -> ByteTokenizer | None:  # noqa: ANN001 - a PolicyConfig
        """The byte tokenizer when the policy reads the instruction (``policy.kwargs.prompt``), else None."""
        return ByteTokenizer(cfg.max_text_len) if cfg.kwargs.get("prompt", False) is True else None

    def features(self, batch: dict) -> torch.Tensor:
        images = batch["images"]  # [B, frames, H, W, 3] uint8
        x = images.permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
        # A masked (missing) camera contributes zeros.
        points = [enc(x[:, f]) * batch["image_mask"][:, f, None] for f, enc in enumerate(self.encoders)]
        words = [self.instruction(batch["text"], batch["text_mask"])] if self.instruction is not None else []
        return torch.cat([*points, self.normalized_state(batch), *words], dim=1)

    def normalized_state(self, batch: dict) -> torch.Tensor:
        """The batch's state by the data's statistics, its history frames side by side: ``[B, history * D]``."""
        return ((batch["state"].float() - self.state_offset) / self.state_scale).reshape(batch["state"].shape[0], -1)

    def wrap_units(self) -> list[nn.Module]:
        return [*self.encoders, *([self.instruction] if self.instruction is not None else []), self.head]


class KeypointPolicy(KeypointEncoding):
    """A small visuomotor policy for the closed loop on a CPU: per camera, three convolutions and a
    spatial softmax (``keypoints`` image positions); with the normalized state, an MLP regresses the
    whole normalized action chunk (MSE, deterministic: no sampling noise to replay at every request).

        python -m slurmvla.train experiment=sim_pick policy=keypoints
    """

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, keypoints: int = 16,  # noqa: ANN001
                 hidden: int = 256, spatial_norm: bool = False, encoder: str = "conv", width: int = 64,
                 prompt: bool = False):
        super().__init__(cfg, stats, keypoints, spatial_norm, encoder, width, prompt)
        self.head = nn.Sequential(
            nn.Linear(self.feature_dim, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, self.horizon * self.action_dim))

    def _predict(self, batch: dict) -> torch.Tensor:
        return self.head(self.features(batch)).view(-1, self.horizon, self.action_dim)

    def forward(self, batch: dict) -> dict:
        return chunk_mse(self, self._predict(batch), batch)

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        return self._predict(batch).float() * self.action_scale + self.action_offset


class FlowHead(nn.Module):
    """The velocity of the whole normalized chunk from ``(x_t, t, features)``: the flattened chunk, a
    sinusoidal embedding of t and the observation's features in, residual MLP blocks (each re-reads the
    conditioning by FiLM, so t and the observation steer every layer), the flattened velocity out.

    With ``horizon`` (training-time real-time chunking) t may be a time per action ``[B, H]``: the chunk's
    input also reads those times (so the clean prefix, at time 0, is known as such) and the conditioning
    reads the latest one (the noisy actions' time)."""

    def __init__(self, chunk_dim: int, feature_dim: int, hidden: int, blocks: int, time_dim: int = 64,
                 horizon: int = 0):
        super().__init__()
        self.time_dim, self.horizon = time_dim, horizon
        self.condition = nn.Sequential(nn.Linear(feature_dim + time_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.inp = nn.Linear(chunk_dim + horizon, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden, elementwise_affine=False) for _ in range(blocks))
        self.films = nn.ModuleList(nn.Linear(hidden, 2 * hidden) for _ in range(blocks))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
                                  for _ in range(blocks))
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, chunk_dim))

    def time_embedding(self, t: torch.Tensor) -> torch.Tensor:
        # Frequencies from 100 down to 0.1 radians per unit of t: both coarse and fine changes of t show.
        half = self.time_dim // 2
        freqs = 100.0 * torch.logspace(0.0, -3.0, half, device=t.device)
        angles = t.float()[:, None] * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        chunk = x_t.flatten(1)
        if self.horizon:
            times = t[:, None].expand(-1, self.horizon) if t.dim() == 1 else t
            chunk, t = torch.cat([chunk, times.to(chunk.dtype)], dim=1), times[:, -1]
        cond = self.condition(torch.cat([features, self.time_embedding(t)], dim=1))
        h = self.inp(chunk)
        for norm, film, mlp in zip(self.norms, self.films, self.mlps, strict=True):
            scale, shift = film(torch.nn.functional.silu(cond)).chunk(2, dim=1)
            h = h + mlp(norm(h) * (1 + scale) + shift)
        return self.out(h).view_as(x_t)


# What KeypointFlowPolicy's head predicts (policy.kwargs.prediction).
PREDICTIONS = ("sample", "velocity")


class KeypointFlowPolicy(KeypointEncoding):
    """The keypoint encoder feeding a flow-matching action head, as visuomotor flow / diffusion policies
    localise: slurmvla's flow (slurmvla/policy/flow_matching.py: ``x_t = t * noise + (1 - t) * actions`` on the
    normalized chunk, pi0's Beta time), sampled by integrating ``policy.num_inference_steps`` Euler steps of
    the velocity ``u = noise - actions`` from noise (t = 1) to actions (t = 0). ``velocity(features, x_t, t)``
    is the one function of ``(x_t, t)`` each step calls, given the observation's ``features`` computed once.

    ``prediction``: what the head outputs. ``sample`` (the default): the clean chunk, trained by its squared
    error, the velocity being ``(x_t - sample) / t`` (x-prediction: at t = 1 the head learns the mean chunk of
    the observation, as the keypoint MSE policy does, so the encoder gets the regression's strong signal and
    localises the cube in CPU minutes; trained as long, the ``velocity`` head did not). ``velocity``: the
    velocity itself, trained by flow matching's squared error, as pi0 does.

        python -m slurmvla.train experiment=sim_pick policy=keypoints_flow
    """

    supports_rtc = True  # a plug-in opting into real-time chunking: sample_actions(..., rtc=) through rtc.integrate
    supports_rtc_training = True  # policy.rtc_training: the head reads a time per action

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, keypoints: int = 16,  # noqa: ANN001
                 hidden: int = 256, blocks: int = 3, prediction: str = "sample", spatial_norm: bool = False,
                 encoder: str = "conv", width: int = 64, prompt: bool = False):
        super().__init__(cfg, stats, keypoints, spatial_norm, encoder, width, prompt)
        if prediction not in PREDICTIONS:
            raise ValueError(f"policy.kwargs.prediction={prediction!r} is not valid; choose one of {list(PREDICTIONS)}")
        self.prediction = prediction
        self.num_inference_steps = cfg.num_inference_steps
        self.rtc_training = cfg.rtc_training
        self.cfg = cfg
        self.head = FlowHead(self.horizon * self.action_dim, self.feature_dim, hidden, blocks,
                             horizon=self.horizon if cfg.rtc_training.enabled else 0)

    @classmethod
    def sample_spec(cls, cfg) -> SampleSpec:  # noqa: ANN001 - a PolicyConfig
        # The noise and time are drawn per sample by the data pipeline: the training randomness is a
        # function of the sample on any world size. The instruction is read only under policy.kwargs.prompt.
        return SampleSpec(image_size=cfg.image_size, action_horizon=cfg.action_horizon,
                          num_obs_history=cfg.num_obs_history, tokenizer=cls.tokenizer(cfg),
                          draws=(Draw("noise", "normal", (cfg.action_horizon, cfg.action_dim)),
                                 Draw("time_u", "uniform"), *delay_draws(cfg)))

    def velocity(self, features: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The predicted ``u = noise - actions`` ``[B, H, D]`` at the normalized noisy chunk ``x_t`` and
        time ``t`` ``[B]`` (or ``[B, H]``, a time per action, when trained with ``policy.rtc_training``)."""
        out = self.head(x_t, t, features)
        if self.prediction == "velocity":
            return out
        # From the predicted clean chunk. A clean prefix (time 0) has no velocity: it is given, never integrated.
        t = (t[:, None, None] if t.dim() == 1 else t[..., None]).clamp_min(1e-3)
        return (x_t - out) / t

    def forward(self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None) -> dict:
        actions = (batch["actions"].float() - self.action_offset) / self.action_scale
        noise, t = noise_and_time(batch, actions, noise, t)
        mask = batch["action_mask"]
        if self.rtc_training.enabled:  # a delayed, clean prefix of each chunk, outside the loss
            x_t, t, mask = delayed_chunk(batch, actions, noise, t, self.rtc_training, mask)
        else:
            x_t = noisy_actions(actions, noise, t)
        out = self.head(x_t, t, self.features(batch))
        # x-prediction's loss is the clean chunk's squared error: flow_matching_loss of noise - sample against
        # noise - actions is exactly that, with its masking and normalization.
        return flow_matching_loss(out if self.prediction == "velocity" else noise - out, noise, actions, mask)

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: torch.Tensor | None = None, num_steps: int | None = None,
                       rtc: Guidance | None = None) -> torch.Tensor:
        """Integrate the velocity from ``noise`` (normalized units, ``[B, H, D]``; drawn when None) at t = 1
        to the actions at t = 0 in ``num_steps`` Euler steps; returns raw actions. ``rtc``: real-time
        chunking's guidance towards a previous chunk (slurmvla/policy/rtc.py)."""
        steps = num_steps or self.num_inference_steps
        features = self.features(batch)
        b = features.shape[0]
        x = (torch.randn(b, self.horizon, self.action_dim, device=features.device) if noise is None
             else noise.float())
        guide = conditioning(self.cfg, rtc, self.action_offset, self.action_scale)
        x = integrate(lambda xt, t: self.velocity(features, xt, t), x, steps, guide)
        actions = x * self.action_scale + self.action_offset
        return actions if guide is None else guide.freeze(actions)
