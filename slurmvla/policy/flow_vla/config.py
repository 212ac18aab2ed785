"""The reference flow-matching policy's options (``policy=tiny|small|base``; the model is
slurmvla/policy/flow_vla.py). Imports no torch: validating a config reads it, never the model."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.config import TransformerPolicyConfig, check_positive


@dataclass
class FlowVLAConfig(TransformerPolicyConfig):
    """policy=tiny|small|base: slurmvla's reference flow-matching policy (slurmvla/policy/flow_vla.py)."""

    name: str = "flow_vla"
    size: str = "tiny"
    mlp_ratio: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("policy.mlp_ratio", self.mlp_ratio)
