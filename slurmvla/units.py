"""Byte units, one definition for every module that sizes memory or requests."""

from __future__ import annotations

MiB = 2**20
GiB = 2**30
