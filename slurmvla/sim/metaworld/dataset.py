"""Meta-World's demonstrations (:class:`MetaWorldDemonstrations`, which the one recorder, :mod:`slurmvla.sim.record`,
writes) in 3D Diffusion Policy's regime: 200-step episodes at 128 x 128 from the ``corner2`` camera, only those
where the task succeeded on at least :data:`MIN_SUCCESS_STEPS` steps (DP3's rule), seeds tried from ``--first-seed``
on; beside the data ``metaworld.json`` lists every seed tried. ``--noise``: the executed end-effector displacement
perturbed, the expert's command for the reached state recorded.

:class:`MT50Demonstrations` (``--env mt50``) records in LeRobot's regime into the layout of ``lerobot/metaworld_mt50``
(:func:`lerobot_layout`): one dataset of many tasks, each episode under its task's instruction, ending when the task
first succeeds (LeRobot's environment ends an episode there), kept when it did."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from slurmvla.data.writer import Layout, bookkeeping, vec
from slurmvla.sim.base import Demonstrations, Recording, Step
from slurmvla.sim.metaworld.env import (
    ACTION_DIM,
    CAMERA,
    DP3,
    EPISODE_STEPS,
    FPS,
    IMAGE_SIZE,
    LEROBOT,
    STATE_DIM,
    MetaWorld,
    Regime,
    check_task,
    instruction,
)
from slurmvla.sim.metaworld.expert import Expert

# DP3 keeps a demonstration when its task succeeded on at least this many steps (gen_demonstration_expert.py).
MIN_SUCCESS_STEPS = 5
# Camera and features of a recorded Meta-World dataset (LeRobot's names: observation.environment_state is the
# simulator's full state, which its Meta-World datasets keep too).
VIDEO_KEY = f"observation.images.{CAMERA}"


def layout() -> Layout:
    """The recorded dataset's cameras and features (slurmvla.data.writer)."""
    xyz = ["x", "y", "z"]
    features = {
        "observation.state": vec(STATE_DIM, [f"{part}_{a}" for part in ("hand", "right_finger", "left_finger") for a in xyz]),
        "observation.environment_state": vec(39, [f"s{i}" for i in range(39)]),
        "action": vec(ACTION_DIM, ["dx", "dy", "dz", "gripper"]),
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
    }
    return Layout((VIDEO_KEY,), features, fps=FPS, episode_stats=("observation.state", "action"))


class MetaWorldDemonstrations(Demonstrations):
    """``task``'s scripted expert, ``steps`` control steps an episode whatever happens (as DP3 records them)."""

    robot_type = "sawyer"
    regime: Regime = DP3

    def __init__(self, task: str | None, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, steps: int = EPISODE_STEPS):
        super().__init__(check_task(task, "--task"), height, width)
        self.steps = steps

    def environment(self) -> MetaWorld:
        return MetaWorld(self.task, height=self.height, width=self.width, max_steps=self.steps, regime=self.regime)

    def expert(self, env: MetaWorld) -> Expert:
        return Expert(env.task)

    def observe(self, env: MetaWorld, render: bool) -> dict[str, Any]:
        return {"state": env.state(), "env_state": env.env_state(), "frame": env.render() if render else None}

    def perturb(self, action: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
        """Gaussian noise on the end effector's displacement (dims 0-2, in the action's [-1, 1] units), clipped to
        the range; the gripper's effort as commanded."""
        action = np.array(action, dtype=np.float32)
        action[:3] = np.clip(action[:3] + rng.normal(0.0, noise, size=3), -1.0, 1.0)
        return action

    def episode(self, env: MetaWorld, observed: list[dict], actions: list[np.ndarray], outcomes: list[Step],
                seed: int) -> dict[str, Any]:
        render = observed[0]["frame"] is not None
        return {"state": np.asarray([o["state"] for o in observed], np.float32),
                "env_state": np.asarray([o["env_state"] for o in observed], np.float32),
                "action": np.clip(np.asarray(actions, np.float32), -1.0, 1.0),
                "reward": np.asarray([o.reward for o in outcomes], np.float32),
                "success": np.asarray([o.success for o in outcomes], bool),
                "frames": np.stack([o["frame"] for o in observed]) if render else None, "seed": seed,
                "task": self.task}

    def keep(self, episode: dict[str, Any]) -> bool:
        return int(episode["success"].sum()) >= MIN_SUCCESS_STEPS

    def max_tries(self, episodes: int) -> int:
        return 4 * episodes

    def columns(self, episode: dict[str, Any], episode_index: int, start_index: int) -> tuple[dict, dict, dict]:
        return (columns(episode, episode_index, start_index, FPS), {VIDEO_KEY: episode["frames"]},
                {"episode_index": episode_index, "tasks": [instruction(self.task)], "length": len(episode["state"])})

    def tasks(self) -> list[str]:
        return [instruction(self.task)]

    def layout(self) -> Layout:
        return layout()

    def summary(self, tried: list[tuple[dict[str, Any], bool]], noise: float, frames: int) -> dict[str, Any]:
        return {"env": "metaworld", "task": self.task, "instruction": instruction(self.task), "camera": CAMERA,
                "camera_position": list(self.regime.camera_position), "height": self.height, "width": self.width,
                "steps": self.steps, "action_noise": noise, "seeds": [ep["seed"] for ep, ok in tried if ok],
                "tried": [{"seed": ep["seed"], "success_steps": int(ep["success"].sum()), "kept": ok} for ep, ok in tried],
                "expert_success_rate": sum(ok for _, ok in tried) / len(tried), "frames": frames}

    def files(self, summary: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, str]:
        return {"metaworld.json": json.dumps(summary, indent=1)}


def lerobot_layout() -> Layout:
    """``lerobot/metaworld_mt50``'s features (its ``meta/info.json``): the 4-number state and action, reward and
    success, Meta-World's 39 numbers, LeRobot's task id; the camera is ``observation.image`` (a video here, where
    LeRobot's recording stores PNG frames in the data files)."""
    features = {
        "observation.state": {"dtype": "float32", "shape": [4], "names": {"axes": None}},
        "action": {"dtype": "float32", "shape": [ACTION_DIM], "names": {"axes": ["x", "y", "z", "gripper"]}},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
        "observation.environment_state": {"dtype": "float32", "shape": [39], "names": ["keypoints"]},
        "task_id": {"dtype": "int16", "shape": [1], "names": None},
    }
    return Layout((LEROBOT_VIDEO_KEY,), features, fps=FPS, episode_stats=("observation.state", "action"))


# The camera's key in LeRobot's Meta-World datasets (and its policies' OBS_IMAGE).
LEROBOT_VIDEO_KEY = "observation.image"


class MT50Task(MetaWorldDemonstrations):
    """One task's demonstrations within an MT50 recording (``MT50Demonstrations.parts``): LeRobot's regime, the
    episode ending when the task first succeeds, its episodes written under the recording's index of its
    instruction."""

    regime = LEROBOT

    def __init__(self, task: str, height: int, width: int, steps: int, task_index: int):
        super().__init__(task, height, width, steps)
        self.task_index = task_index

    def done(self, outcomes: list[Step]) -> bool:
        return outcomes[-1].success

    def keep(self, episode: dict[str, Any]) -> bool:
        return bool(episode["success"].any())

    def columns(self, episode: dict[str, Any], episode_index: int, start_index: int) -> tuple[dict, dict, dict]:
        from slurmvla.sim.metaworld.mt50 import TASK_IDS

        n = len(episode["state"])
        cols = {"observation.state": episode["state"], "action": episode["action"],
                "next.reward": episode["reward"][:, None], "next.success": episode["success"],
                "observation.environment_state": episode["env_state"],
                "task_id": np.full(n, TASK_IDS[self.task], np.int16),
                **bookkeeping(n, episode_index, start_index, FPS, self.task_index)}
        return cols, {LEROBOT_VIDEO_KEY: episode["frames"]}, {
            "episode_index": episode_index, "tasks": [instruction(self.task, LEROBOT)], "length": n}


class MT50Demonstrations(Recording):
    """``--env mt50``: the scripted experts of the tasks ``--task`` names (null: all fifty; a group; tasks,
    comma-separated) in LeRobot's regime, ``--episodes`` each, one dataset in ``lerobot/metaworld_mt50``'s layout."""

    robot_type = "metaworld"

    def __init__(self, task: str | None, height: int = 480, width: int = 480, steps: int = LEROBOT.steps):
        from slurmvla.sim.metaworld.mt50 import suite, task_strings

        super().__init__(task, height, width)
        self.suite = suite(task, "--task")
        self.strings = task_strings(self.suite)
        self.steps = steps

    def parts(self) -> list[Demonstrations]:
        return [MT50Task(t, self.height, self.width, self.steps, self.strings.index(instruction(t, LEROBOT)))
                for t in self.suite]

    def tasks(self) -> list[str]:
        return list(self.strings)

    def layout(self) -> Layout:
        return lerobot_layout()

    def summary(self, tried: list[tuple[dict[str, Any], bool]], noise: float, frames: int) -> dict[str, Any]:
        per_task = {}
        for t in self.suite:
            mine = [(ep, ok) for ep, ok in tried if ep["task"] == t]
            per_task[t] = {"instruction": instruction(t, LEROBOT), "seeds": [ep["seed"] for ep, ok in mine if ok],
                           "tried": len(mine), "expert_success_rate": sum(ok for _, ok in mine) / max(len(mine), 1),
                           "mean_length": float(np.mean([len(ep["action"]) for ep, ok in mine if ok] or [0]))}
        return {"env": "mt50", "regime": LEROBOT.name, "tasks": per_task, "camera": CAMERA,
                "camera_position": list(LEROBOT.camera_position), "flip": LEROBOT.flip, "height": self.height,
                "width": self.width, "steps": self.steps, "action_noise": noise,
                "expert_success_rate": sum(ok for _, ok in tried) / len(tried), "frames": frames}

    def files(self, summary: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, str]:
        return {"mt50.json": json.dumps(summary, indent=1)}


def columns(ep: dict, episode_index: int, start_index: int, fps: int) -> dict[str, np.ndarray]:
    """One episode's columns in :func:`layout`'s features."""
    return {"observation.state": ep["state"], "observation.environment_state": ep["env_state"], "action": ep["action"],
            "next.reward": ep["reward"][:, None], "next.success": ep["success"],
            **bookkeeping(len(ep["state"]), episode_index, start_index, fps)}


def expert_episode(env: MetaWorld, seed: int, steps: int = EPISODE_STEPS, render: bool = True,
                   noise: float = 0.0) -> dict:
    """One seeded episode of the task's scripted expert in ``env``, ``steps`` long whatever happens
    (:func:`slurmvla.sim.record.episode`): per-step state, environment state, action, reward and success, and the
    camera's frames. ``noise``: the standard deviation of Gaussian noise on the executed end-effector displacement,
    drawn from the episode's seed; what is recorded is the expert's command: the scripted policy reads the state at
    every step, so the demonstrations show it correcting the drift a learned policy makes (DART, Laskey et al.
    2017), and a policy that models the action distribution does not learn to add the noise."""
    from slurmvla.sim.record import episode

    return episode(MetaWorldDemonstrations(env.task, env.height, env.width, steps), env, seed, render=render, noise=noise)
