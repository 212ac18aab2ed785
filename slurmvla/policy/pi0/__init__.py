"""pi0 and pi0.5 (``policy=pi0|pi0_tiny|pi05|pi05_tiny``), one folder:

- ``config``: their options and their registry entries (no torch: composing a config reads it alone);
- ``model``: the models on transformers' PaliGemma;
- ``weights``: weights in (PaliGemma, LeRobot's and openpi's checkpoints) and out (LeRobot's names), the
  tokenizer beside them;
- ``openpi``: openpi's own checkpoint directory mapped onto LeRobot's names.

``slurmvla.policy.pi0.Pi0Policy`` / ``Pi05Policy`` import the model (and torch) on first use."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("Pi0Policy", "Pi05Policy"):
        from slurmvla.policy.pi0 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
