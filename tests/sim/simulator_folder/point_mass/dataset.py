"""The point mass's demonstrations: 30 steps at most, ending at success; the top camera, the position as the
state, the velocity as the action."""

from __future__ import annotations

import json

import numpy as np
from slurmvla.sim.point_mass.env import Expert, PointMass

from slurmvla.data.writer import Layout, bookkeeping, vec
from slurmvla.sim.base import Demonstrations

VIDEO_KEY = "observation.images.top"


class PointMassDemonstrations(Demonstrations):
    steps = 30
    robot_type = "point_mass"

    def environment(self) -> PointMass:
        return PointMass(self.height, self.width)

    def expert(self, env):  # noqa: ANN001, ANN201
        return Expert()

    def observe(self, env, render):  # noqa: ANN001, ANN201
        return {"state": env.position.astype(np.float32), "frame": env.render() if render else None}

    def perturb(self, action, rng, noise):  # noqa: ANN001, ANN201
        return np.clip(action + rng.normal(0.0, noise, 2), -1.0, 1.0)

    def done(self, outcomes) -> bool:  # noqa: ANN001
        return outcomes[-1].success

    def episode(self, env, observed, actions, outcomes, seed):  # noqa: ANN001, ANN201
        return {"state": np.stack([o["state"] for o in observed]), "action": np.asarray(actions, np.float32),
                "frames": np.stack([o["frame"] for o in observed]) if observed[0]["frame"] is not None else None,
                "success": outcomes[-1].success, "seed": seed}

    def columns(self, episode, episode_index, start_index):  # noqa: ANN001, ANN201
        n = len(episode["state"])
        columns = {"observation.state": episode["state"], "action": episode["action"],
                   **bookkeeping(n, episode_index, start_index, PointMass.fps)}
        return columns, {VIDEO_KEY: episode["frames"]}, {"episode_index": episode_index, "tasks": self.tasks(), "length": n}

    def tasks(self) -> list[str]:
        return [PointMass.instruction]

    def layout(self) -> Layout:
        return Layout((VIDEO_KEY,), {"observation.state": vec(2, ["x", "y"]), "action": vec(2, ["vx", "vy"])},
                      fps=PointMass.fps)

    def summary(self, tried, noise, frames):  # noqa: ANN001, ANN201
        successes = [ep["success"] for ep, _ in tried]
        return {"seeds": [ep["seed"] for ep, _ in tried], "success": successes, "action_noise": noise,
                "expert_success_rate": float(np.mean(successes)), "frames": frames}

    def files(self, summary, kept):  # noqa: ANN001, ANN201
        return {"point_mass.json": json.dumps(summary, indent=1)}
