"""Meta-World (metaworld 3.1.1 on MuJoCo 3.3.0) as a simulator of the closed loop, in 3D Diffusion Policy's regime:
:mod:`.env` (a task under the closed loop, its camera's calibration), :mod:`.expert` (the scripted experts),
:mod:`.dataset` (the demonstrations), :mod:`.config` (the registry entry, read without importing Meta-World).

The names of those modules are offered here too (``from slurmvla.sim.metaworld import MetaWorld, CAMERA``),
imported, with Meta-World and MuJoCo, on first use."""

from __future__ import annotations

from typing import Any

_MODULES = ("env", "expert", "dataset")


def __getattr__(name: str) -> Any:
    import importlib

    for module in _MODULES:
        found = importlib.import_module(f"{__name__}.{module}")
        if hasattr(found, name):
            return getattr(found, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
