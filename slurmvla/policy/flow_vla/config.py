"""The reference flow-matching policy's options (``policy=tiny|small|base``; the model:
``model`` beside it). Imports no torch: validating a config reads it, never the model."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.config.policy import TransformerPolicyConfig
from slurmvla.registry import PolicyEntry
from slurmvla.validators import check_positive


@dataclass
class FlowVLAConfig(TransformerPolicyConfig):
    """policy=tiny|small|base: slurmvla's reference flow-matching policy (slurmvla/policy/flow_vla/model.py)."""

    name: str = "flow_vla"
    size: str = "tiny"
    mlp_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("policy.mlp_ratio", self.mlp_ratio)


# What policy.name selects (slurmvla.registry.POLICIES finds this folder's ENTRIES).
ENTRIES = (PolicyEntry("flow_vla", "slurmvla.policy.flow_vla.model:FlowMatchingVLA",
                       schema="slurmvla.policy.flow_vla.config:FlowVLAConfig"),)
