"""Validation: one pass over the whole mixture, sharded across ranks, reported by dataset and control mode."""

from slurmvla.eval.validate import bucket, per_sample, validate

__all__ = ["bucket", "per_sample", "validate"]
