"""The scripted expert for :class:`slurmvla.sim.pick.env.PickCube`: it reads the cube's pose from the
simulator and acts in DROID's action space (joint velocities from damped least-squares inverse
kinematics of the gripper's pose error, and the gripper position).

Its action is a function of the current state alone (no phase counter, no memory), so what a policy
must learn is a function of what it observes: the gripper moves over the cube and descends as it
closes in (a funnel), closes once it is around the cube, and lifts once the fingers hold the cube
(the gripper's position stops short of closed, the cube between the fingers); a grasp that closes on
nothing, or a cube that slips, opens the gripper and tries again. The fingers turn to the nearest of the cube's four
faces; the speed is bounded, so the actions are smooth.
"""

from __future__ import annotations

import mujoco
import numpy as np

from slurmvla.sim.pick.env import CUBE_HALF, FINGER_OPEN, JOINT_VELOCITY_LIMIT, TABLE_Z, PickCube

GAIN_POS = 4.0  # 1/s: the commanded gripper speed per metre of position error
GAIN_ROT = 3.0
DAMPING = 0.05
MAX_SPEED = 0.35  # m/s, the gripper's speed limit
PRE_GRASP = 0.10  # m above the grasp height while far from the cube
FUNNEL = 0.06  # m: the horizontal distance over which the gripper descends to the grasp height
GRASP_Z = TABLE_Z + CUBE_HALF + 0.004
LIFT_Z = TABLE_Z + 0.22
# Gripper positions (0 open, 1 closed): closed on the cube the fingers stop at 1 - CUBE_HALF / FINGER_OPEN.
HOLDING = 0.9 * (1 - CUBE_HALF / FINGER_OPEN)
CLOSED = 0.9  # closed on nothing
CLOSING = 0.05  # the fingers have started to close
BETWEEN = 0.025  # m: the cube's centre this near the gripper's is between the fingers
# Close when the gripper is this near its grasp pose: the fingers open to 10 cm around a 4 cm cube, so
# 1.5 cm off centre still grasps it.
AROUND_XY, AROUND_Z = 0.015, 0.01


class Expert:
    """``act(env)`` returns the 8-D action for the environment's current state."""

    def act(self, env: PickCube) -> np.ndarray:
        cube, tcp, gripper = env.cube_position(), env.tcp_position(), env.gripper_position()
        xy_error = float(np.linalg.norm(cube[:2] - tcp[:2]))
        between = np.linalg.norm(cube - tcp) < BETWEEN
        if HOLDING < gripper < CLOSED and between:  # the fingers hold the cube: lift
            target, close = np.array([tcp[0], tcp[1], LIFT_Z]), 1.0
        elif gripper < CLOSED and ((xy_error < AROUND_XY and tcp[2] - GRASP_Z < AROUND_Z)  # around the cube: close
                                   or (gripper > CLOSING and between)):  # closing already: go on (no flicker)
            target, close = np.array([cube[0], cube[1], GRASP_Z]), 1.0
        else:  # over the cube, lower as the gripper closes in (opening it if it closed on nothing: a retry)
            height = GRASP_Z + PRE_GRASP * float(np.clip((xy_error - 0.6 * AROUND_XY) / FUNNEL, 0.0, 1.0))
            target, close = np.array([cube[0], cube[1], height]), 0.0
        velocity = _joint_velocity(env, target, _finger_yaw(env))
        return np.concatenate([velocity, [close]]).astype(np.float32)


def _finger_yaw(env: PickCube) -> float:
    """The finger axis across the cube's faces: of the four ways, the nearest to the hand's now."""
    hand_y = env.data.xmat[env._hand].reshape(3, 3)[:, 1]
    current = np.arctan2(hand_y[1], hand_y[0])
    options = env.cube_yaw() + np.arange(-4, 5) * np.pi / 2
    return float(options[np.argmin(np.abs(np.angle(np.exp(1j * (options - current)))))])


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
