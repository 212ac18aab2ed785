"""The scripted expert for :class:`slurmvla.sim.env.PickCube`: it reads the cube's pose from the
simulator and acts in DROID's action space (joint velocities from damped least-squares inverse
kinematics of the gripper's pose error, and the gripper position).

Phases: over the cube with the fingers across its faces, down around it, close, lift. Each phase ends
when the gripper is within tolerance of its target (or its time is up); the actions are smooth, so a
policy trained on them learns a smooth motion.
"""

from __future__ import annotations

import mujoco
import numpy as np

from slurmvla.sim.env import CUBE_HALF, JOINT_VELOCITY_LIMIT, TABLE_Z, PickCube

GAIN_POS = 4.0  # 1/s: the commanded gripper speed per metre of position error
GAIN_ROT = 3.0
DAMPING = 0.05
MAX_SPEED = 0.35  # m/s, the gripper's speed limit
PRE_GRASP = 0.10  # m above the grasp height
GRASP_Z = TABLE_Z + CUBE_HALF + 0.004
LIFT_Z = TABLE_Z + 0.22
CLOSE_STEPS = 7


class Expert:
    """Call ``act(env)`` once per control step after ``env.reset``; it returns the 8-D action."""

    def __init__(self) -> None:
        self.phase = "approach"
        self.phase_steps = 0
        self.yaw = None

    def _target(self, env: PickCube) -> tuple[np.ndarray, float]:
        cube = env.cube_position()
        if self.yaw is None:  # the finger axis across the cube's faces, the nearest of the four ways
            hand_y = env.data.xmat[env._hand].reshape(3, 3)[:, 1]
            current = np.arctan2(hand_y[1], hand_y[0])
            options = env.cube_yaw() + np.arange(-4, 5) * np.pi / 2
            self.yaw = float(options[np.argmin(np.abs(np.angle(np.exp(1j * (options - current)))))])
        above = np.array([cube[0], cube[1], GRASP_Z + PRE_GRASP])
        if self.phase == "approach":
            return above, 0.0
        if self.phase in ("descend", "close"):
            return np.array([cube[0], cube[1], GRASP_Z]), float(self.phase == "close")
        return np.array([env.tcp_position()[0], env.tcp_position()[1], LIFT_Z]), 1.0

    def act(self, env: PickCube) -> np.ndarray:
        target, gripper = self._target(env)
        error = target - env.tcp_position()
        self.phase_steps += 1
        if self.phase == "approach" and (np.linalg.norm(error) < 0.01 or self.phase_steps > 60):
            self.phase, self.phase_steps = "descend", 0
        elif self.phase == "descend" and (abs(error[2]) < 0.006 or self.phase_steps > 40):
            self.phase, self.phase_steps = "close", 0
        elif self.phase == "close" and self.phase_steps >= CLOSE_STEPS:
            self.phase, self.phase_steps = "lift", 0
        velocity = _joint_velocity(env, target, self.yaw)
        return np.concatenate([velocity, [gripper]]).astype(np.float32)


def _joint_velocity(env: PickCube, target: np.ndarray, yaw: float) -> np.ndarray:
    """Joint velocities moving the gripper toward ``target`` pointing down with its fingers along ``yaw``."""
    m, d = env.model, env.data
    linear = GAIN_POS * (target - env.tcp_position())
    speed = np.linalg.norm(linear)
    if speed > MAX_SPEED:
        linear *= MAX_SPEED / speed
    current = d.xmat[env._hand].reshape(3, 3)
    want_y = np.array([np.cos(yaw), np.sin(yaw), 0.0])
    want_z = np.array([0.0, 0.0, -1.0])
    want = np.stack([np.cross(want_y, want_z), want_y, want_z], axis=1)
    angular = GAIN_ROT * 0.5 * sum(np.cross(current[:, i], want[:, i]) for i in range(3))
    jacp, jacr = np.zeros((3, m.nv)), np.zeros((3, m.nv))
    mujoco.mj_jacSite(m, d, jacp, jacr, env._tcp)
    jac = np.concatenate([jacp, jacr])[:, env._arm_dof]
    twist = np.concatenate([linear, angular])
    velocity = jac.T @ np.linalg.solve(jac @ jac.T + DAMPING**2 * np.eye(6), twist)
    # Pull the redundant joints toward the middle of their ranges in the Jacobian's null space.
    null = np.eye(7) - np.linalg.pinv(jac) @ jac
    middle = np.array([0.0, -0.3, 0.0, -2.2, 0.0, 2.0, 0.8])
    velocity += null @ (0.5 * (middle - env.joint_position()))
    return np.clip(velocity, -JOINT_VELOCITY_LIMIT, JOINT_VELOCITY_LIMIT)
