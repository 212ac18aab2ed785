"""The closed loop's options (``rollout.*``: ``python -m slurmvla.rollout`` and ``trainer.rollout_every_steps``); the
simulators it runs in are the registry's (``rollout.env``: :data:`slurmvla.registry.SIMULATORS`, each a folder of
``slurmvla/sim/``). A schema module of ``slurmvla.config``: it imports no torch, no simulator and nothing of ``slurmvla``
above the configuration (layer 1; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.config.serve import EXECUTION_MODES
from slurmvla.registry import SIMULATORS
from slurmvla.validators import check_choice, check_positive

# rollout.delay: fixed (rollout.delay_steps) or measured (each call's wall time times the control rate).
DELAYS = ("fixed", "measured")


@dataclass
class RolloutConfig:
    """python -m slurmvla.rollout and trainer.rollout_every_steps: closed-loop episodes in a simulated task
    (slurmvla.sim, the [sim] extra), the policy queried through openpi's client."""

    # The simulator, an entry of slurmvla.registry.SIMULATORS: pick (the DROID-shaped pick task) or metaworld (a
    # Meta-World v3 task, rollout.task), or a simulator folder of one's own (docs/extending.md).
    env: str = "pick"
    # The simulator's task: the Meta-World task (e.g. assembly-v3; every v3 task the package ships); for the pick task
    # null (one cube) or two_cubes (a red and a blue cube, either one will do).
    task: str | None = None
    episodes: int = 50
    # Episode e is the environment's seed first_seed + e. The recorded demonstrations use 0..N-1;
    # the default evaluates on seeds no demonstration was recorded from.
    first_seed: int = 100000
    # Actions of each predicted chunk executed before the policy is asked again, at most policy.action_horizon.
    # null: half the chunk in every mode (in async and rtc the rest is the overlap a late answer switches into); on
    # the pick task sync solves 0.97 replanning every 4 of 8 steps and 0.92 executing all 8
    # (docs/benchmarks.md#real-time-chunking). openpi's DROID client executes 8 of pi0.5's 10.
    replan_steps: int | None = None
    # An episode ends at success or after this many control steps (15 Hz).
    max_steps: int = 100
    # Camera frames as the environment renders them (DROID's are 180 x 320).
    height: int = 180
    width: int = 320
    # How long a client waits for a server address to accept connections (a server still starting).
    connect_timeout_s: float = 120.0
    # Episodes (the first ones) written as MP4 videos: the exterior and wrist cameras side by side.
    videos: int = 3
    # Where the summary (rollout.json), per-episode results and videos go; null: beside the source
    # (RUN_DIR/rollout/step_N/) for a run, ./rollout/ for a server address.
    out: str | None = None
    # How chunks run (docs/serving.md, "Execution modes"): sync (run replan_steps actions, ask, hold until
    # the answer), async (keep executing while asking, then switch to the new chunk), rtc (as async, the
    # request carrying the old chunk and the delay; the server must list "rtc" in its execution_modes).
    execution: str = "sync"
    # The simulator keeps time: each request's answer takes effect this many control steps after its
    # observation, the arm executing (async, rtc) or holding (sync) meanwhile. 0: at once (the environment
    # waits for the policy).
    delay_steps: int = 0
    # fixed: delay_steps; measured: each call's wall time times the control rate (15 Hz), rounded up.
    delay: str = "fixed"

    def __post_init__(self) -> None:
        problem = SIMULATORS.get(self.env).task_problem(self.task, env_key=f"rollout.env={self.env}", task_key="rollout.task")
        if problem is not None:
            raise ValueError(problem)
        check_choice("rollout.execution", self.execution, EXECUTION_MODES)
        check_choice("rollout.delay", self.delay, DELAYS)
        check_positive("rollout.delay_steps", self.delay_steps, allow_zero=True)
        check_positive("rollout.episodes", self.episodes)
        if self.replan_steps is not None:
            check_positive("rollout.replan_steps", self.replan_steps)
        check_positive("rollout.max_steps", self.max_steps)
        check_positive("rollout.videos", self.videos, allow_zero=True)
        check_positive("rollout.connect_timeout_s", self.connect_timeout_s)
        if min(self.height, self.width) < 16 or self.height % 2 or self.width % 2:
            raise ValueError(f"rollout.height={self.height} / rollout.width={self.width}: each must be an even number "
                             ">= 16 of pixels (the videos are yuv420p)")
