"""The simulated tasks the closed loop runs in (the [sim] extra): one folder a simulator, found through the
``ENTRIES`` its ``config.py`` declares (:data:`slurmvla.registry.SIMULATORS`), each holding its environment, its
scripted expert and the dataset its demonstrations are recorded as: :mod:`slurmvla.sim.pick` (the DROID-shaped pick
task, ``rollout.env=pick``, one cube or ``rollout.task=two_cubes``) and :mod:`slurmvla.sim.metaworld` (Meta-World's v3
tasks, ``rollout.env=metaworld rollout.task=...``). The contract: :mod:`slurmvla.sim.base`; the one recorder:
:mod:`slurmvla.sim.record`. ``python -m slurmvla.rollout`` runs them.

Importing this package chooses MuJoCo's offscreen backend for every module under it, before any loads MuJoCo
(which reads ``MUJOCO_GL`` once): EGL (Mesa's llvmpipe on a CPU machine, the GPU's driver on a GPU node); a user's
``MUJOCO_GL`` wins. A module that imports MuJoCo (or Meta-World) before this package gets MuJoCo's own default.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

os.environ.setdefault("MUJOCO_GL", "egl")

if TYPE_CHECKING:
    from slurmvla.sim.base import Environment


def make_env(name: str, task: str | None = None, height: int = 180, width: int = 320, max_steps: int = 100) -> Environment:
    """The environment ``rollout.env`` names (an entry of :data:`slurmvla.registry.SIMULATORS`), rendering at
    ``height`` x ``width``, its episodes ``max_steps`` control steps at most."""
    from slurmvla.registry import SIMULATORS

    entry = SIMULATORS.get(name)
    problem = entry.task_problem(task, env_key=f"rollout.env={name}", task_key="rollout.task")
    if problem is not None:
        raise ValueError(problem)
    entry.check_task(task, "rollout.task")
    return entry.load()(task, height, width, max_steps)
