"""The pick task's demonstrations in DROID's layout (:class:`PickDemonstrations`, which the one recorder,
:mod:`slurmvla.sim.record`, writes).

Per step: the observed joint and gripper positions (``observation.state``), DROID's action keys
(``action.joint_velocity``: the commanded joint velocities, DROID's action space; ``action.gripper_position``: the
commanded gripper, 1 = closed; ``action``: the next joint positions and the commanded gripper, as DROID stores it),
the gripper's Cartesian pose, three instructions and the three cameras as AV1 video. An episode ends
:data:`HOLD_STEPS` after the cube first counts as lifted, or after :data:`MAX_STEPS`; every episode is kept. Beside
the data: DROID's keep-ranges file (every step kept: the expert never idles) and ``sim.json`` (the task, the seeds,
the success of each episode), so every data path the project has applies unchanged.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from slurmvla.data.keep_ranges import episode_key
from slurmvla.data.writer import droid_columns
from slurmvla.droid_features import DROID_CAMERAS
from slurmvla.sim.base import Demonstrations, Step
from slurmvla.sim.pick.config import CUBES
from slurmvla.sim.pick.env import PickCube
from slurmvla.sim.pick.expert import Expert

# Steps recorded after the cube first counts as lifted: the demonstrations go on lifting, so a chunk
# predicted near the goal still lifts.
HOLD_STEPS = 6
MAX_STEPS = 120
INSTRUCTIONS = ("pick up the red cube", "lift the red cube off the table", "grasp the cube and lift it")
TWO_CUBES_INSTRUCTIONS = ("pick up the red cube or the blue cube", "lift a cube off the table", "grasp either cube and lift it")


def cartesian(env: PickCube) -> np.ndarray:
    """The gripper's pose as DROID stores it: position, then roll, pitch and yaw."""
    import mujoco

    quat = np.empty(4)
    mujoco.mju_mat2Quat(quat, env.data.xmat[env._hand])
    w, x, y, z = quat
    roll = np.arctan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y))
    pitch = np.arcsin(np.clip(2 * (w * y - z * x), -1, 1))
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return np.array([*env.tcp_position(), roll, pitch, yaw])


class PickDemonstrations(Demonstrations):
    """The scripted expert (:class:`slurmvla.sim.pick.expert.Expert`) in the pick task (``task``: null, one cube,
    or ``two_cubes``), every DROID camera rendered."""

    steps = MAX_STEPS
    robot_type = "sim_franka"

    def __init__(self, task: str | None = None, height: int = 180, width: int = 320, episodes_per_file: int = 25):
        super().__init__(task, height, width)
        self.episodes_per_file = episodes_per_file
        self.cubes = CUBES.get(task, 1) if task else 1
        self.instructions = INSTRUCTIONS if self.cubes == 1 else TWO_CUBES_INSTRUCTIONS

    def environment(self) -> PickCube:
        return PickCube(height=self.height, width=self.width,
                        cameras=tuple(c.removeprefix("observation.images.") for c in DROID_CAMERAS), cubes=self.cubes)

    def expert(self, env: PickCube) -> Expert:
        return Expert()

    def observe(self, env: PickCube, render: bool) -> dict[str, Any]:
        return {"state": [*env.joint_position(), env.gripper_position()], "cartesian": cartesian(env),
                "frames": {cam: env.render(cam) for cam in env.cameras} if render else None}

    def perturb(self, action: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
        """Gaussian noise (rad/s) on the 7 joint velocities; the gripper as commanded."""
        executed = action.copy()
        executed[:7] += rng.normal(0.0, noise, size=7).astype(np.float32)
        return executed

    def done(self, outcomes: list[Step]) -> bool:
        first = next((t for t, o in enumerate(outcomes) if o.success), None)
        return first is not None and len(outcomes) - 1 >= first + HOLD_STEPS

    def episode(self, env: PickCube, observed: list[dict], actions: list[np.ndarray], outcomes: list[Step],
                seed: int) -> dict[str, Any]:
        states = np.asarray([o["state"] for o in observed], np.float32)
        actions = np.asarray(actions, np.float32)
        next_joints = np.concatenate([states[1:, :7], env.joint_position()[None].astype(np.float32)])
        poses = np.asarray([o["cartesian"] for o in observed])
        next_poses = np.concatenate([poses[1:], cartesian(env)[None]])
        render = observed[0]["frames"] is not None
        return {"state": states, "joint_velocity": actions[:, :7],
                "action": np.concatenate([next_joints, actions[:, 7:]], axis=1),
                "cartesian_state": poses, "cartesian_action": next_poses,
                "frames": {cam: np.stack([o["frames"][cam] for o in observed]) for cam in env.cameras} if render else None,
                "success": any(o.success for o in outcomes), "seed": seed, "target": env.target}

    def columns(self, episode: dict[str, Any], episode_index: int, start_index: int) -> tuple[dict, dict, dict]:
        seed, n = episode["seed"], len(episode["state"])
        columns = droid_columns(episode["state"], episode["action"], episode["joint_velocity"], episode["cartesian_state"],
                                episode["cartesian_action"], list(self.instructions), episode["success"],
                                episode_index=episode_index, start_index=start_index, task_index=0)
        frames = {f"observation.images.{cam}": f for cam, f in episode["frames"].items()}
        return columns, frames, {"episode_index": episode_index, "tasks": [self.instructions[0]], "length": n,
                                 "episode_id": _episode_id(seed)}

    def tasks(self) -> list[str]:
        return [self.instructions[0]]

    def summary(self, tried: list[tuple[dict[str, Any], bool]], noise: float, frames: int) -> dict[str, Any]:
        successes = [ep["success"] for ep, _ in tried]
        summary = {"task": "pick_cube" if self.cubes == 1 else "two_cubes", "instruction": self.instructions[0],
                   "action_noise": noise, "seeds": [ep["seed"] for ep, _ in tried], "success": successes,
                   "expert_success_rate": float(np.mean(successes)), "frames": frames}
        if self.cubes > 1:  # the cube each demonstration went for (0: the red one, y > 0; 1: the blue one, its mirror image)
            summary["target"] = [ep["target"] for ep, _ in tried]
        return summary

    def files(self, summary: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, str]:
        keep = {episode_key(_rel_path(ep["seed"], ep["success"])): [[0, len(ep["state"])]] for ep in kept}
        return {"keep_ranges_1_0_1.json": json.dumps(keep, indent=1), "sim.json": json.dumps(summary, indent=1),
                "episode_id_to_path.json": json.dumps({_episode_id(ep["seed"]): _rel_path(ep["seed"], ep["success"])
                                                       for ep in kept}, indent=1)}


def expert_episode(env: PickCube, seed: int, render: bool = True, noise: float = 0.0) -> dict[str, Any]:
    """One seeded episode of the expert in ``env`` (:func:`slurmvla.sim.record.episode`): per-step arrays, frames per
    camera and whether it succeeded.

    ``noise`` (rad/s): Gaussian noise added to the expert's joint velocities when they are executed (seeded by the
    episode), so the demonstrations visit states off the expert's path and show its corrections (DART, Laskey et al.
    2017). What is recorded is the expert's command, not the noise: a policy that models the action distribution
    (flow matching) would otherwise learn to add the noise."""
    from slurmvla.sim.record import episode

    demos = PickDemonstrations("two_cubes" if len(env._cubes) == 2 else None, env.height, env.width)
    return episode(demos, env, seed, render=render, noise=noise)


def _episode_id(seed: int) -> str:
    return f"SIM+{seed:08d}+2026-11-25-00h-00m-00s"


def _rel_path(seed: int, success: bool) -> str:
    return f"SIM/{'success' if success else 'failure'}/2026-11-25/seed{seed:08d}"
