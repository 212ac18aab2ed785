"""Flow matching as pi0 trains it, shared by the built-in policies.

``x_t = t * noise + (1 - t) * actions``; the model predicts the velocity ``u = noise - actions``;
the loss is the squared error over every chunk element, masked ones counting as zero.
"""

from __future__ import annotations

import torch


def noise_and_time(batch: dict, actions: torch.Tensor, noise: torch.Tensor | None,
                   t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise and time from the arguments, else from the batch (``noise``, ``time_u``: drawn per sample
    by the data pipeline), else from the global RNG. Time follows pi0's Beta(1.5, 1) (inverse CDF
    ``u ** (1 / 1.5)``), which leans towards the noisy end, kept off t = 0."""
    if noise is None:
        noise = batch["noise"].float() if "noise" in batch else torch.randn_like(actions)
    if t is None:
        u = batch["time_u"].float() if "time_u" in batch else torch.rand(actions.shape[0], device=actions.device)
        t = u.pow(1.0 / 1.5) * 0.999 + 0.001
    return noise, t


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t[:, None, None] * noise + (1 - t[:, None, None]) * actions


def flow_matching_loss(pred: torch.Tensor, noise: torch.Tensor, actions: torch.Tensor,
                       action_mask: torch.Tensor) -> dict:
    """The contract's ``{"loss", "components"}`` for a predicted velocity ``pred`` ``[B, H, D]``.

    The loss is a mean over every chunk element, masked ones counting as zero error: its denominator
    is a constant of the batch shape, so the loss of a global batch is exactly the mean of its shards'
    losses (the same training on any world size and accumulation split, with no collective to count
    valid elements first)."""
    pred = pred.float()
    mask = action_mask[:, :, None].expand_as(pred).float()
    mse_sum = ((pred - (noise - actions)).square() * mask).sum(dim=(1, 2))
    return {"loss": mse_sum.sum() / pred.numel(),
            "components": {"mse": (mse_sum.detach(), mask.sum(dim=(1, 2)).detach())}}
