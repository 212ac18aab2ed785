"""Inference-time real-time chunking (RTC: Black, Galliker, Levine 2025, arXiv 2506.07339, Algorithm 1).

The next chunk is sampled while the previous one still runs: its first ``d`` actions (the delay) execute from
the previous chunk anyway, so they are frozen to it, and the rest of the overlap ``k`` is guided towards it with
weights that decay over ``d <= i < k``. On every flow step the predicted clean chunk ``x_t - t * u`` is compared
with the previous chunk ``Y``; the weighted error, pulled back through the velocity (a vector-Jacobian product
with respect to ``x_t``), corrects the velocity, its weight clipped at ``max_guidance`` (the paper's beta). The
weights over the overlap are the ``schedule``: the paper's soft mask (``exp``), or the hard mask (``zeros``: the d
frozen actions alone guide), which the server uses by default (``serve.rtc_schedule``; docs/serving.md).

Time: slurmvla's flow runs t = 1 (noise) -> 0 (actions) with ``u = noise - actions``; the paper's runs
tau = 0 (noise) -> 1 with ``v = actions - noise``. So ``tau = 1 - t`` and ``v = -u``; the clean estimate
``x + (1 - tau) v`` is ``x - t u`` and the guided velocity ``v + w g`` is ``u - w g``.

Shapes are static: ``Y`` is padded to the horizon and ``d`` / ``k`` are tensors, so the weights are tensor ops
whatever the request (a compiled graph is not specialised on them). A request without a previous chunk takes
the policy's plain path, which this module never touches.

A flow policy opts in (slurmvla/policy/base.py) with ``supports_rtc = True`` and a ``sample_actions(batch,
noise=None, rtc=None)`` that, when ``rtc`` is given, calls :meth:`Guide.velocity` instead of its velocity on
each step and :meth:`Guide.freeze` on its result; :func:`integrate` is that loop for a policy with a
``velocity(features, x_t, t)``-style function.

Training-time RTC (Black, Ren, Equi, Levine 2025, arXiv 2512.05964; ``policy.rtc_training``) needs no
guidance: each training sample draws a delay d (:func:`draw_delays`, from the data pipeline's per-sample
``delay_u``), its first d actions enter the velocity clean, at flow time 0, and leave the loss
(:func:`delayed_chunk`). The velocity takes a time per action (``t`` ``[B, H]``). At inference such a
policy answers an ``rtc`` request by the same conditioning: on every flow step the first d actions are the
previous chunk's, at time 0 (:class:`Prefix`, :func:`integrate`'s ``prefix``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slurmvla.config.policy import RTC_JACOBIANS, RTC_SCHEDULES
from slurmvla.data.spec import Draw


@dataclass
class Guidance:
    """One request's RTC inputs, in the dataset's units: ``prev_actions`` ``[B, H, action_dim]`` (the previous
    chunk from the observation's step on, zero-padded to the horizon ``H``), ``delay`` ``[B]`` (d) and
    ``overlap`` ``[B]`` (k, the rows of ``prev_actions`` that are real), both integer tensors."""

    prev_actions: torch.Tensor
    delay: torch.Tensor
    overlap: torch.Tensor
    max_guidance: float = 5.0
    schedule: str = "exp"
    # RTC_JACOBIANS: the velocity model's, by a vector-Jacobian product (the paper's Algorithm 1), or the identity
    # (LeRobot 0.6.1's RTCProcessor, which computes the velocity before x_t requires gradients: no backward pass,
    # about a plain step's cost).
    jacobian: str = "model"
    # The action dims guided towards the previous chunk (None: every one); the others follow the policy alone
    # (e.g. a binary gripper command), their first d actions still frozen to the previous chunk's.
    guided_dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.schedule not in RTC_SCHEDULES:
            raise ValueError(f"rtc schedule={self.schedule!r} is not one of {list(RTC_SCHEDULES)}")
        if not self.max_guidance >= 0:
            raise ValueError(f"rtc max_guidance={self.max_guidance} must be >= 0")
        if self.jacobian not in RTC_JACOBIANS:
            raise ValueError(f"rtc jacobian={self.jacobian!r} is not one of {list(RTC_JACOBIANS)}")
        if self.guided_dims is not None:
            self.guided_dims = tuple(int(i) for i in self.guided_dims)
            dims = self.prev_actions.shape[-1]
            if not self.guided_dims or any(not 0 <= i < dims for i in self.guided_dims):
                raise ValueError(f"rtc guided_dims={list(self.guided_dims)}: each must be an action dim in 0..{dims - 1}")

    def _target(self, offset: torch.Tensor, scale: torch.Tensor, width: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw previous chunk (fp32, on the statistics' device) and it normalized as ``(a - offset) / scale``
        (the policy's action statistics), zero-padded to ``width`` action dims (pi0's ``max_action_dim``)."""
        prev = self.prev_actions.to(offset.device, torch.float32)
        target = (prev - offset) / scale
        dims = target.shape[-1]
        if width and width > dims:
            target = torch.nn.functional.pad(target, (0, width - dims))
        return prev, target

    def guide(self, offset: torch.Tensor, scale: torch.Tensor, width: int | None = None) -> Guide:
        """The per-call :class:`Guide` in the policy's action space (:meth:`_target`), the padded dims carrying
        no weight."""
        prev, target = self._target(offset, scale, width)
        dims = prev.shape[-1]
        weights = prefix_weights(self.delay.to(prev.device), self.overlap.to(prev.device), prev.shape[1],
                                 self.schedule)[:, :, None].expand(*prev.shape).contiguous()
        if self.guided_dims is not None:
            guided = torch.zeros(dims, dtype=weights.dtype, device=weights.device)
            guided[list(self.guided_dims)] = 1.0
            weights = weights * guided
        if target.shape[-1] > dims:
            weights = torch.nn.functional.pad(weights, (0, target.shape[-1] - dims))
        return Guide(target, weights, prev, self.delay.to(prev.device), self.max_guidance, self.jacobian)

    def prefix(self, offset: torch.Tensor, scale: torch.Tensor, width: int | None = None) -> Prefix:
        """Training-time RTC's conditioning in the policy's action space (:meth:`_target`): the previous chunk's
        first ``d`` actions, given clean on every flow step."""
        prev, target = self._target(offset, scale, width)
        delay = torch.minimum(self.delay, self.overlap).to(prev.device)
        return Prefix(target, prefix_mask(delay, prev.shape[1]), prev)

    def to(self, device: torch.device) -> Guidance:
        return Guidance(self.prev_actions.to(device), self.delay.to(device), self.overlap.to(device),
                        self.max_guidance, self.schedule, self.jacobian, self.guided_dims)

    def settings(self) -> tuple:
        """What, besides its tensors, decides how a request is guided (a captured graph is kept per settings)."""
        return (self.max_guidance, self.schedule, self.jacobian, self.guided_dims)


def prefix_weights(delay: torch.Tensor, overlap: torch.Tensor, horizon: int, schedule: str = "exp") -> torch.Tensor:
    """``[B, horizon]`` guidance weights: 1 for ``i < d``; over ``d <= i < k`` the paper's soft mask
    ``c_i (e^{c_i} - 1) / (e - 1)`` with ``c_i = (k - i) / (k - d + 1)`` (``exp``), or ``c_i`` (``linear``),
    1 (``ones``), 0 (``zeros``: only the frozen actions guide); 0 for ``i >= k``."""
    i = torch.arange(horizon, device=delay.device, dtype=torch.float32)[None, :]
    k = overlap.to(torch.float32)[:, None]
    d = torch.minimum(delay.to(torch.float32)[:, None], k)
    if schedule == "ones":
        soft = torch.ones_like(i).expand(k.shape[0], horizon)
    elif schedule == "zeros":
        soft = torch.zeros_like(i).expand(k.shape[0], horizon)
    else:
        soft = ((k - i) / (k - d + 1)).clamp(0, 1)
        if schedule == "exp":
            soft = soft * torch.expm1(soft) / (math.e - 1)
    w = torch.where(i < d, torch.ones_like(soft), soft)
    return torch.where(i >= k, torch.zeros_like(w), w)


def guidance_weight(t: float, max_guidance: float) -> float:
    """The paper's ``min(beta, (1 - tau) / (tau r_tau^2))`` with ``r_tau^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)``,
    at slurmvla's time ``t = 1 - tau``: ``(t^2 + (1 - t)^2) / (t (1 - t))``, beta at either end."""
    tau = 1.0 - t
    if tau <= 0.0 or tau >= 1.0:
        return float(max_guidance)
    return min(float(max_guidance), (tau**2 + (1 - tau) ** 2) / (tau * (1 - tau)))


def prefix_mask(delay: torch.Tensor, horizon: int) -> torch.Tensor:
    """``[B, horizon]``: True at the first ``delay[b]`` actions of each chunk."""
    return torch.arange(horizon, device=delay.device)[None, :] < delay[:, None]


def delay_draws(cfg) -> tuple[Draw, ...]:  # noqa: ANN001 - a PolicyConfig
    """The sample spec's draw for training-time RTC (``delay_u``: one uniform per sample, drawn by the data
    pipeline, so the delays are a function of the sample on any world size and on resume), or none."""
    return (Draw("delay_u", "uniform"),) if cfg.rtc_training.enabled else ()


def delay_probabilities(rtc_training) -> torch.Tensor:  # noqa: ANN001 - an RTCTrainingConfig
    """``P(d)`` over ``d = min_delay .. max_delay``: uniform, or ``exp(-exp_decay (d - min_delay))`` normalized."""
    n = rtc_training.max_delay - rtc_training.min_delay + 1
    if rtc_training.distribution == "uniform":
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.exp(-rtc_training.exp_decay * torch.arange(n, dtype=torch.float64))
    return w / w.sum()


def draw_delays(u: torch.Tensor, rtc_training) -> torch.Tensor:  # noqa: ANN001 - an RTCTrainingConfig
    """Delays ``[B]`` (long) from uniforms ``u`` in [0, 1) by the inverse CDF of :func:`delay_probabilities`."""
    cdf = delay_probabilities(rtc_training).cumsum(0).to(u.device)
    index = torch.searchsorted(cdf, u.double().contiguous(), right=True).clamp_max(cdf.numel() - 1)
    return index + rtc_training.min_delay


def delayed_chunk(batch: dict, actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, rtc_training,  # noqa: ANN001
                  action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-time RTC on one batch: ``(x_t, times, loss_mask)``. The first d actions of each sample
    (d from :func:`draw_delays` of the batch's ``delay_u``) are the clean actions at time 0, the rest
    ``t * noise + (1 - t) * actions`` at the sample's ``t``; ``times`` ``[B, H]`` is each action's time;
    ``loss_mask`` is ``action_mask`` without the prefix (which the loss leaves out)."""
    if "delay_u" not in batch:
        raise ValueError("policy.rtc_training is on but this batch has no 'delay_u': the policy's sample_spec must "
                         "include slurmvla.policy.rtc.delay_draws(cfg)")
    prefix = prefix_mask(draw_delays(batch["delay_u"], rtc_training), actions.shape[1])
    times = torch.where(prefix, torch.zeros_like(t)[:, None], t[:, None])
    x_t = times[..., None] * noise + (1 - times[..., None]) * actions
    return x_t, times, action_mask.bool() & ~prefix


class Prefix:
    """One ``sample_actions`` call's training-time RTC conditioning: ``target`` (the previous chunk,
    normalized), ``mask`` ``[B, H]`` (its first d actions) and the raw chunk (for :meth:`freeze`)."""

    def __init__(self, target: torch.Tensor, mask: torch.Tensor, raw: torch.Tensor):
        self.target, self.mask, self.raw = target, mask, raw

    def fill(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the first d actions replaced by the previous chunk's (normalized)."""
        return torch.where(self.mask[..., None], self.target.to(x.dtype), x)

    def times(self, t: torch.Tensor) -> torch.Tensor:
        """Per-action times ``[B, H]``: 0 on the prefix, ``t`` ``[B]`` elsewhere."""
        return torch.where(self.mask, torch.zeros_like(t)[:, None], t[:, None])

    def freeze(self, actions: torch.Tensor) -> torch.Tensor:
        """``actions`` (dataset units) with the first d exactly the previous chunk's."""
        return torch.where(self.mask[..., None], self.raw.to(actions.dtype), actions)


class Guide:
    """One ``sample_actions`` call's guidance: the previous chunk normalized (``target``), its per-element
    weights, the raw chunk and the delay (for :meth:`freeze`)."""

    def __init__(self, target: torch.Tensor, weights: torch.Tensor, raw: torch.Tensor, delay: torch.Tensor,
                 max_guidance: float, jacobian: str = "model"):
        self.target, self.weights, self.raw, self.delay, self.max_guidance = target, weights, raw, delay, max_guidance
        self.jacobian = jacobian

    def velocity(self, velocity: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, t: float) -> torch.Tensor:
        """The guided velocity at ``(x, t)`` (slurmvla's ``u``), ``velocity(x_t)`` being the model's with the
        observation's features cached. ``jacobian="model"``: the weighted error pulled back through
        ``d(x_t - t u) / d x_t`` by a vector-Jacobian product (autograd); ``"identity"``: that Jacobian taken as the
        identity, the weighted error itself (no backward pass)."""
        if self.jacobian == "identity":
            u = velocity(x).float()
            error = (self.target - (x.float() - t * u)) * self.weights
            return u - guidance_weight(t, self.max_guidance) * error
        with torch.enable_grad():
            x_in = x.detach().float().requires_grad_(True)
            u = velocity(x_in).float()
            clean = x_in - t * u
            error = (self.target - clean.detach()) * self.weights
            (pull,) = torch.autograd.grad(clean, x_in, grad_outputs=error)
        return u.detach() - guidance_weight(t, self.max_guidance) * pull

    def freeze(self, actions: torch.Tensor) -> torch.Tensor:
        """``actions`` (dataset units) with the ``d`` frozen ones replaced by the previous chunk's, exactly: they
        execute from it anyway. Only at the end: guidance already drives them there (weight 1), and replacing
        ``x_t`` on every step would feed the velocity states off the path the guidance follows."""
        i = torch.arange(actions.shape[1], device=actions.device)[None, :, None]
        return torch.where(i < self.delay[:, None, None], self.raw.to(actions.dtype), actions)


def integrate(velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, steps: int,
              guide: Guide | Prefix | None = None) -> torch.Tensor:
    """Euler integration of ``velocity(x_t, t)`` (``t`` a ``[B]`` tensor) from noise ``x`` (t = 1) to actions
    (t = 0) in the policy's normalized action space, guided by a :class:`Guide` or conditioned on a
    :class:`Prefix` (then ``t`` is ``[B, H]``, per action) when given; un-normalize and call its ``freeze``
    on the result. For a policy whose own loop is this one."""
    b = x.shape[0]
    for i in range(steps):
        time = 1.0 - i / steps
        t = torch.full((b,), time, device=x.device)
        if guide is None:
            u = velocity(x, t).float()
        elif isinstance(guide, Prefix):
            x = guide.fill(x)
            u = velocity(x, guide.times(t)).float()
        else:
            u = guide.velocity(lambda xt, t=t: velocity(xt, t), x, time)
        x = x - u / steps
    return x if not isinstance(guide, Prefix) else guide.fill(x)


def conditioning(policy_cfg, rtc: Guidance | None, offset: torch.Tensor, scale: torch.Tensor,  # noqa: ANN001
                 width: int | None = None) -> Guide | Prefix | None:
    """How a flow policy answers ``rtc``: none without it; a :class:`Prefix` when the policy was trained with
    training-time RTC (``policy.rtc_training``: it knows clean prefixes, no guidance needed); else inference-time
    guidance (:class:`Guide`)."""
    if rtc is None:
        return None
    if policy_cfg.rtc_training.enabled:
        return rtc.prefix(offset, scale, width)
    return rtc.guide(offset, scale, width)
