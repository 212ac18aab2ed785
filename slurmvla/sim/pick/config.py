"""The pick task's registry entry (``rollout.env=pick``) and its variants: no MuJoCo is imported to read it."""

from slurmvla.registry import SimulatorEntry

# rollout.task: null is the one-cube task; two_cubes puts a red and a blue cube on the table (either one lifted
# succeeds: two equally good paths, the multimodal case of real-time chunking). Each variant with its cubes.
CUBES = {"two_cubes": 2}

ENTRIES = (SimulatorEntry(
    "pick", "slurmvla.sim.pick.env:make", demonstrations="slurmvla.sim.pick.dataset:PickDemonstrations",
    description="the pick task", tasks=tuple(CUBES), task_hint="two_cubes, or null for one cube",
    task_default="one cube", demo_episodes=100, demo_height=180, demo_width=320),)
