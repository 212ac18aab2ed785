"""The two goals' demonstrations: each task's expert from the same seeds (the same scenes), 30 steps at most,
ending at success, each episode under its task's instruction."""

from __future__ import annotations

import json

import numpy as np
from slurmvla.sim.two_goals.env import COLOURS, Expert, TwoGoals, suite

from slurmvla.data.writer import Layout, bookkeeping, vec
from slurmvla.sim.base import Demonstrations, Recording

VIDEO_KEY = "observation.images.top"


class GoalDemonstrations(Demonstrations):
    steps = 30

    def __init__(self, task: str, height: int, width: int, task_index: int):
        super().__init__(task, height, width)
        self.task_index = task_index

    def environment(self) -> TwoGoals:
        return TwoGoals(self.task, self.height, self.width)

    def expert(self, env):  # noqa: ANN001, ANN201
        return Expert()

    def observe(self, env, render):  # noqa: ANN001, ANN201
        return {"state": env.state(), "frame": env.render() if render else None}

    def perturb(self, action, rng, noise):  # noqa: ANN001, ANN201
        return np.clip(action + rng.normal(0.0, noise, 2), -1.0, 1.0)

    def done(self, outcomes) -> bool:  # noqa: ANN001
        return outcomes[-1].success

    def episode(self, env, observed, actions, outcomes, seed):  # noqa: ANN001, ANN201
        return {"state": np.stack([o["state"] for o in observed]), "action": np.asarray(actions, np.float32),
                "frames": np.stack([o["frame"] for o in observed]), "success": outcomes[-1].success, "seed": seed,
                "task": self.task}

    def columns(self, episode, episode_index, start_index):  # noqa: ANN001, ANN201
        n = len(episode["state"])
        columns = {"observation.state": episode["state"], "action": episode["action"],
                   **bookkeeping(n, episode_index, start_index, TwoGoals.fps, self.task_index)}
        return columns, {VIDEO_KEY: episode["frames"]}, {"episode_index": episode_index,
                                                         "tasks": [f"move to the {self.task} square"], "length": n}

    def tasks(self) -> list[str]:
        return [f"move to the {self.task} square"]

    def summary(self, tried, noise, frames):  # noqa: ANN001, ANN201
        return {}

    def files(self, summary, kept):  # noqa: ANN001, ANN201
        return {}


class TwoGoalsRecording(Recording):
    robot_type = "point_mass"

    def __init__(self, task: str | None, height: int, width: int):
        super().__init__(task, height, width)
        self.goals = suite(task, "--task")

    def parts(self) -> list[Demonstrations]:
        return [GoalDemonstrations(t, self.height, self.width, i) for i, t in enumerate(self.goals)]

    def tasks(self) -> list[str]:
        return [f"move to the {t} square" for t in self.goals]

    def layout(self) -> Layout:
        return Layout((VIDEO_KEY,), {"observation.state": vec(6, ["x", "y", "green_x", "green_y", "blue_x", "blue_y"]),
                                     "action": vec(2, ["vx", "vy"])}, fps=TwoGoals.fps)

    def summary(self, tried, noise, frames):  # noqa: ANN001, ANN201
        return {"tried": [[ep["task"], ep["seed"], bool(ep["success"])] for ep, _ in tried], "frames": frames,
                "colours": list(COLOURS), "expert_success_rate": float(np.mean([ep["success"] for ep, _ in tried]))}

    def files(self, summary, kept):  # noqa: ANN001, ANN201
        return {"two_goals.json": json.dumps(summary, indent=1)}
