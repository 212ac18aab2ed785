"""The contract between a policy and the data layer.

A policy says what its samples must look like (:class:`SampleSpec`: image size, action horizon,
observation history, its tokenizer, and which training randomness the data pipeline pre-draws);
the data layer builds samples to that spec and never imports a policy. In the other direction the
data says what it yields (:class:`DataFeatures`), and the policy checks that against its shapes
before it is built.

Pre-drawn randomness (``SampleSpec.draws``) is drawn per sample from a generator seeded by
``(seed, epoch, dataset, episode, frame, repeat)``, in the order listed: the training noise is a
pure function of the sample, so every world size, worker count and resume trains the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# text -> (ids [max_len] long, mask [max_len] bool)
Tokenizer = Callable[[str], tuple[torch.Tensor, torch.Tensor]]

DISTRIBUTIONS = ("normal", "uniform")


@dataclass(frozen=True)
class Draw:
    """One field of per-sample training randomness: ``normal`` (standard) or ``uniform`` on [0, 1)."""

    name: str
    distribution: str
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"Draw({self.name!r}): distribution={self.distribution!r} is not valid; choose one of "
                             f"{list(DISTRIBUTIONS)}")

    def sample(self, generator: torch.Generator) -> torch.Tensor:
        if self.distribution == "normal":
            return torch.randn(self.shape, generator=generator)
        return torch.rand(self.shape, generator=generator)


@dataclass(frozen=True)
class SampleSpec:
    """What a policy needs its samples to look like.

    Samples carry ``images`` ``[num_obs_history * cameras, image_size, image_size, 3]`` uint8 (at
    the videos' own size when ``image_size`` is None),
    ``image_mask``, ``state``, ``actions`` ``[action_horizon, action_dim]`` with ``action_mask``,
    the raw ``instruction`` string and, when ``tokenizer`` is set, its ``text`` / ``text_mask``;
    plus one field per :class:`Draw`.
    """

    # None: frames as recorded (the policy resizes them itself, e.g. pi0's reference preprocessing).
    image_size: int | None
    action_horizon: int
    num_obs_history: int = 1
    tokenizer: Tokenizer | None = None
    draws: tuple[Draw, ...] = ()

    def __post_init__(self) -> None:
        names = [d.name for d in self.draws]
        if len(set(names)) != len(names):
            raise ValueError(f"SampleSpec.draws names a field twice: {names}")

    def draw(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {d.name: d.sample(generator) for d in self.draws}


@dataclass(frozen=True)
class DataFeatures:
    """What the configured data yields (the first dataset of a mixture; all share state and action dims)."""

    root: str
    cameras: tuple[str, ...]
    state_keys: tuple[str, ...]
    state_dim: int
    action_keys: tuple[str, ...]
    action_dim: int
