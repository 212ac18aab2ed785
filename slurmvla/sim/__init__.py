"""The simulated pick task the closed loop runs in (the [sim] extra): :mod:`slurmvla.sim.env` (the scene),
:mod:`slurmvla.sim.expert` (the scripted expert), :mod:`slurmvla.sim.record` (its demonstrations as a
LeRobot dataset), :mod:`slurmvla.sim.policies` (reference policies). ``python -m slurmvla.rollout`` runs it."""

import os

# Offscreen rendering without a display: EGL (Mesa's llvmpipe on a CPU machine, the GPU's driver on a
# GPU node). MuJoCo reads it when first imported; a user's MUJOCO_GL wins.
os.environ.setdefault("MUJOCO_GL", "egl")
