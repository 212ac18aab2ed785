"""The point mass's registry entry (``rollout.env=point_mass``)."""

from slurmvla.registry import SimulatorEntry

ENTRIES = (SimulatorEntry(
    "point_mass", "slurmvla.sim.point_mass.env:make", demonstrations="slurmvla.sim.point_mass.dataset:PointMassDemonstrations",
    description="the point mass", tasks=(), task_hint="none", task_default="reach the goal", demo_episodes=8,
    demo_height=32, demo_width=32),)
