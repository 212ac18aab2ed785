"""The value checks every schema's ``__post_init__`` shares: one message shape for every key, naming the value and
what is valid. A schema module beside its package (``slurmvla/config/data.py``, ...) imports these from here, not
from ``slurmvla.config``, which composes those modules (``slurmvla.config`` re-exports them for users)."""

from __future__ import annotations

from typing import Any


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} is not valid; it must be {bound}")
