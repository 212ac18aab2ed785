"""An example policy for slurmvla, in a package of its own."""

from slurmvla_example_policy.mlp import MLPPolicy

__all__ = ["MLPPolicy"]
