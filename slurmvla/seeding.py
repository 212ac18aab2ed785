"""Seeding the process-wide random number generators (Python's, NumPy's, torch's): one function for the
trainer, the policy checker and anything else that needs a run to start from a known state; and their
states as a checkpoint keeps them (:class:`GlobalGenerators`).

At the bottom: it imports no other slurmvla layer. Randomness that must not depend on the process
(the training noise, a parameter's initial values) has generators of its own
(:mod:`slurmvla.data.spec`, :func:`slurmvla.parameters.parameter_generator`) and does not go through here.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every device's)."""
    random.seed(seed)
    # NumPy's legacy seeding takes 32 bits only; a derived seed (seed + 1000 * rank) may exceed them.
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class GlobalGenerators:
    """This process's torch and Python generators (and the device's, on CUDA) as a checkpoint holds them:
    one per rank."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
