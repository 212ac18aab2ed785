"""Meta-World's registry entries: ``rollout.env=metaworld`` (one task, 3D Diffusion Policy's regime, the v2 table's) and
``rollout.env=mt50`` (LeRobot's regime; rollout.task null for all fifty tasks, a group or tasks). Neither Meta-World
nor MuJoCo is imported to read them."""

from slurmvla.registry import SimulatorEntry

ENTRIES = (
    SimulatorEntry(
        "metaworld", "slurmvla.sim.metaworld.env:make",
        demonstrations="slurmvla.sim.metaworld.dataset:MetaWorldDemonstrations", description="Meta-World", tasks=None,
        task_required=True, task_hint="a Meta-World v3 task, e.g. assembly-v3",
        task_check="slurmvla.sim.metaworld.env:check_task", demo_episodes=10, demo_height=128, demo_width=128),
    SimulatorEntry(
        "mt50", "slurmvla.sim.metaworld.env:make_lerobot",
        demonstrations="slurmvla.sim.metaworld.dataset:MT50Demonstrations",
        description="Meta-World MT50 in LeRobot's regime", tasks=None, task_required=False,
        task_hint="null (all fifty tasks), a group (easy, medium, hard, very_hard), or v3 tasks, comma-separated",
        task_default="all fifty tasks", task_check="slurmvla.sim.metaworld.mt50:check",
        suite="slurmvla.sim.metaworld.mt50:suite", groups="slurmvla.sim.metaworld.mt50:GROUPS",
        demo_episodes=10, demo_height=480, demo_width=480),
)
