"""The two goals' registry entry (``rollout.env=two_goals``): a suite of two tasks, ``green`` and ``blue``, with the
same scenes (rollout.task null runs both)."""

from slurmvla.registry import SimulatorEntry

ENTRIES = (SimulatorEntry(
    "two_goals", "slurmvla.sim.two_goals.env:make", demonstrations="slurmvla.sim.two_goals.dataset:TwoGoalsRecording",
    description="the point mass between two goals", tasks=None, task_hint="green, blue, or null for both",
    task_default="both goals", suite="slurmvla.sim.two_goals.env:suite", groups="slurmvla.sim.two_goals.env:GROUPS",
    demo_episodes=16, demo_height=32, demo_width=32),)
