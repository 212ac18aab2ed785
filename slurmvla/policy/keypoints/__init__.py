"""The keypoint policies (``policy=keypoints``, ``policy=keypoints_flow``), one folder: ``config`` (their options and
registry entries; no torch) and ``model``. ``slurmvla.policy.keypoints.KeypointPolicy`` (and the other classes of
``model``) import the model (and torch) on first use."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if not name.startswith("_"):
        from slurmvla.policy.keypoints import model

        if hasattr(model, name):
            return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
