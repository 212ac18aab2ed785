"""slurmvla's reference flow-matching policy (``policy=tiny|small|base``), one folder: ``config`` (its options
and its registry entry; no torch) and ``model``. ``slurmvla.policy.flow_vla.FlowMatchingVLA`` imports the model
(and torch) on first use."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "FlowMatchingVLA":
        from slurmvla.policy.flow_vla.model import FlowMatchingVLA

        return FlowMatchingVLA
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
