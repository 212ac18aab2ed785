"""Launch layer: who am I in the job (DistEnv), and how was I started. Imports no other layer."""

from slurmvla.launch.distenv import DistEnv, SlurmJob

__all__ = ["DistEnv", "SlurmJob"]
