"""Meta-World's registry entry (``rollout.env=metaworld``): neither Meta-World nor MuJoCo is imported to read it."""

from slurmvla.registry import SimulatorEntry

ENTRIES = (SimulatorEntry(
    "metaworld", "slurmvla.sim.metaworld.env:make",
    demonstrations="slurmvla.sim.metaworld.dataset:MetaWorldDemonstrations", description="Meta-World", tasks=None,
    task_required=True, task_hint="a Meta-World v3 task, e.g. assembly-v3",
    task_check="slurmvla.sim.metaworld.env:check_task", demo_episodes=10, demo_height=128, demo_width=128),)
