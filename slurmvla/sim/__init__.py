"""The simulated tasks the closed loop runs in (the [sim] extra), one module per embodiment:
:mod:`slurmvla.sim.env` (the DROID-shaped pick task, ``rollout.env=pick``, with one cube or, ``rollout.task=two_cubes``,
two; its scripted expert in
:mod:`slurmvla.sim.expert`) and :mod:`slurmvla.sim.metaworld` (Meta-World's tasks, ``rollout.env=metaworld
rollout.task=...``, with their own scripted experts); :mod:`slurmvla.sim.record` (demonstrations as a LeRobot
dataset), :mod:`slurmvla.sim.policies` (reference policies). ``python -m slurmvla.rollout`` runs them.

An environment offers ``reset(seed)``, ``observe(client_keys) -> obs``, ``step(action) -> Step``,
``rest_action()``, ``close()`` and, as facts the closed loop reads, ``client_cameras`` (client key -> camera),
``state_keys``, ``action_dim``, ``action_space`` (in words), ``video_keys``, ``fps``, ``instruction``, ``steps``.

Importing this package chooses MuJoCo's offscreen backend for every module under it, before any loads MuJoCo
(which reads ``MUJOCO_GL`` once): EGL (Mesa's llvmpipe on a CPU machine, the GPU's driver on a GPU node); a user's
``MUJOCO_GL`` wins. A module that imports MuJoCo (or Meta-World) before this package gets MuJoCo's own default.
"""

import os

os.environ.setdefault("MUJOCO_GL", "egl")


def make_env(name: str, task: str | None = None, height: int = 180, width: int = 320, max_steps: int = 100):  # noqa: ANN201
    """The environment ``rollout.env`` names (one of :data:`slurmvla.config.rollout.SIM_ENVS`), rendering at ``height`` x
    ``width``."""
    if name == "pick":
        from slurmvla.config.rollout import PICK_TASKS
        from slurmvla.sim.env import CAMERAS, PickCube

        return PickCube(height=height, width=width, cameras=CAMERAS, cubes=PICK_TASKS.get(task, 1))
    if name == "metaworld":
        from slurmvla.sim.metaworld import MetaWorld

        return MetaWorld(task, height=height, width=width, max_steps=max_steps)
    from slurmvla.config.rollout import SIM_ENVS

    raise ValueError(f"rollout.env={name!r} is not valid; choose one of {list(SIM_ENVS)}")
