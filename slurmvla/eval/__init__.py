"""Validation: one pass over the whole mixture, sharded across ranks, reported by dataset and control mode."""

from slurmvla.eval.validate import bucket, validate

__all__ = ["bucket", "validate"]
