"""pooled_flow's options and its registry entry. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.config.policy import PolicyConfig
from slurmvla.registry import PolicyEntry
from slurmvla.validators import check_positive


@dataclass
class PooledFlowConfig(PolicyConfig):
    """``policy=pooled_flow``: the options of :class:`model.PooledFlowPolicy`."""

    name: str = "pooled_flow"
    size: str = "pooled_flow"
    hidden: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("policy.hidden", self.hidden)


ENTRIES = (PolicyEntry("pooled_flow", "slurmvla.policy.pooled_flow.model:PooledFlowPolicy",
                       schema="slurmvla.policy.pooled_flow.config:PooledFlowConfig"),)
