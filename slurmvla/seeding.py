"""Seeding the process-wide random number generators (Python's, NumPy's, torch's): one function for the
trainer, the policy checker and anything else that needs a run to start from a known state.

At the bottom: it imports no other slurmvla layer. Randomness that must not depend on the process
(the training noise, a parameter's initial values) has generators of its own
(:mod:`slurmvla.data.spec`, :func:`slurmvla.weights.parameter_generator`) and does not go through here.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (torch's seeds every device's)."""
    random.seed(seed)
    # NumPy's legacy seeding takes 32 bits only; a derived seed (seed + 1000 * rank) may exceed them.
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
