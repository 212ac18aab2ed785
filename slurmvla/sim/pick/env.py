"""A DROID-shaped pick-and-lift task in MuJoCo: one 7-joint arm with a parallel gripper, a cube on a
table at a seeded random place, two exterior cameras and a wrist camera.

Why this and not robosuite / LIBERO / gym-aloha: MuJoCo itself installs from the package index with
nothing else, renders offscreen on a CPU through Mesa's EGL (Debian's ``libegl1`` + ``libgl1-mesa-dri``:
llvmpipe), and lets the scene speak DROID's interface exactly: the arm is a Franka-like 7-joint chain
acting in joint velocity plus gripper position at 15 Hz (DROID's action space and rate), observed as
joint positions, gripper position and DROID's three cameras (``exterior_1_left``, ``exterior_2_left``,
``wrist_left``). The packaged suites act in end-effector space (robosuite, gymnasium-robotics' Fetch),
are bimanual (ALOHA), or pin older MuJoCo releases and ship hundreds of MB of assets.

The episode succeeds when the cube is lifted ``LIFT_HEIGHT`` above the table; the initial cube place,
its yaw and the arm's start (a few degrees around home) are drawn from the episode's seed.

``PickCube(cubes=2)`` (``rollout.task=two_cubes``) puts two cubes on the table, a red and a blue one of the same
size and mass at mirror places across the arm's plane, and succeeds when either is lifted: two equally good paths
from one observation, the multimodal case real-time chunking is about (a policy that hesitates between them loses
time; one that switches cube between chunks loses the grasp). The expert's cube (``target``) is drawn from the seed,
so the demonstrations go to either one half of the time each, and nothing the cameras or the state show tells which.
They differ in colour because a spatial softmax (the keypoint policies' encoder: one expected position per feature
map) puts two identical cubes' keypoint between them, and the policy then grasps at neither.
"""

from __future__ import annotations

import mujoco  # slurmvla.sim (imported first) chose the offscreen backend
import numpy as np

from slurmvla.droid_features import DROID_CLIENT_CAMERAS
from slurmvla.sim.base import Environment, Step
from slurmvla.sim.pick.config import CUBES

FPS = 15  # DROID's control rate
PHYSICS_DT = 0.002
SUBSTEPS = round(1 / (FPS * PHYSICS_DT))
HOME = np.array([0.0, -0.6, 0.0, -2.4, 0.0, 1.8, 0.785])
JOINT_VELOCITY_LIMIT = 1.5  # rad/s, each joint (the actions are clipped to it)
TABLE_Z = 0.0
CUBE_HALF = 0.025
CUBE_CENTER = np.array([0.5, 0.0])
CUBE_RANGE = 0.10  # the cube's x and y are drawn uniformly within +-CUBE_RANGE of CUBE_CENTER
LIFT_HEIGHT = 0.08  # success: the cube's bottom this far above the table
FINGER_OPEN = 0.05  # each finger's travel (m): 0 = closed, 0.05 = a 10 cm opening
INSTRUCTION = "pick up the red cube"
TWO_CUBES_INSTRUCTION = "pick up the red cube or the blue cube"
MIN_MIRROR_Y = 0.05  # m: two cubes stand at y and -y with |y| at least this (their centres 10 cm apart or more)
CAMERAS = ("exterior_1_left", "exterior_2_left", "wrist_left")
# The keys openpi's DROID client sends each camera under.
CLIENT_CAMERAS = dict(zip(DROID_CLIENT_CAMERAS, CAMERAS, strict=True))

def _look(pos: tuple, target: tuple) -> str:
    """A fixed camera at ``pos`` looking at ``target``, image upright: MJCF's pos and xyaxes."""
    pos, target = np.asarray(pos, float), np.asarray(target, float)
    forward = (target - pos) / np.linalg.norm(target - pos)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    return " ".join(f"{v:.4f}" for v in pos) + '" xyaxes="' + " ".join(f"{v:.4f}" for v in (*right, *up))


_LINK = 'rgba=".92 .92 .92 1" contype="0" conaffinity="0" mass="1"'
_CUBE = f"""<body name="{{name}}" pos="{CUBE_CENTER[0]} {{y}} {CUBE_HALF}">
      <freejoint name="{{name}}"/>
      <geom name="{{name}}" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" rgba="{{rgba}}" mass="0.05" friction="2 0.01 0.001" condim="4"/>
    </body>"""
_SCENE = f"""
<mujoco model="slurmvla_pick">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{PHYSICS_DT}" integrator="implicitfast" cone="elliptic" impratio="10"/>
  <visual><global offwidth="640" offheight="480"/><quality shadowsize="1024"/></visual>
  <default>
    <joint damping="2" armature="0.1"/>
    <geom solref="0.01 1" solimp="0.95 0.99 0.001"/>
  </default>
  <asset>
    <texture name="grid" type="2d" builtin="checker" rgb1=".55 .45 .35" rgb2=".5 .4 .3" width="256" height="256"/>
    <material name="table" texture="grid" texrepeat="6 6"/>
    <texture name="sky" type="skybox" builtin="gradient" rgb1=".6 .7 .8" rgb2=".2 .25 .3" width="64" height="64"/>
  </asset>
  <worldbody>
    <light pos="0.4 -0.4 1.5" dir="0 0.3 -1" diffuse=".8 .8 .8" castshadow="true"/>
    <light pos="0.4 0.6 1.2" dir="0 -0.4 -1" diffuse=".3 .3 .3" castshadow="false"/>
    <geom name="table" type="box" pos="0.45 0 -0.02" size="0.45 0.6 0.02" material="table" friction="1 0.005 0.0001"/>
    <geom name="base" type="cylinder" pos="0 0 0.05" size="0.08 0.05" rgba=".25 .25 .25 1" contype="0" conaffinity="0"/>
    <camera name="exterior_1_left" pos="{_look((0.5, -0.5, 0.4), (0.5, 0.0, 0.06))}" fovy="45"/>
    <camera name="exterior_2_left" pos="{_look((0.5, 0.5, 0.4), (0.5, 0.0, 0.06))}" fovy="45"/>
    <body name="link1" pos="0 0 0.333" gravcomp="1">
      <joint name="joint1" axis="0 0 1" range="-2.9 2.9"/>
      <geom type="capsule" fromto="0 0 -0.23 0 0 0" size="0.06" {_LINK}/>
      <body name="link2" quat="1 -1 0 0" gravcomp="1">
        <joint name="joint2" axis="0 0 1" range="-1.76 1.76"/>
        <geom type="capsule" fromto="0 0 0 0 -0.316 0" size="0.055" {_LINK}/>
        <body name="link3" pos="0 -0.316 0" quat="1 1 0 0" gravcomp="1">
          <joint name="joint3" axis="0 0 1" range="-2.9 2.9"/>
          <geom type="capsule" fromto="0 0 0 0.0825 0 0" size="0.05" {_LINK}/>
          <body name="link4" pos="0.0825 0 0" quat="1 1 0 0" gravcomp="1">
            <joint name="joint4" axis="0 0 1" range="-3.07 -0.07"/>
            <geom type="capsule" fromto="0 0 0 -0.0825 0.384 0" size="0.05" {_LINK}/>
            <body name="link5" pos="-0.0825 0.384 0" quat="1 -1 0 0" gravcomp="1">
              <joint name="joint5" axis="0 0 1" range="-2.9 2.9"/>
              <geom type="capsule" fromto="0 0 0 0 0 -0.1" size="0.045" {_LINK}/>
              <body name="link6" quat="1 1 0 0" gravcomp="1">
                <joint name="joint6" axis="0 0 1" range="-0.0175 3.75"/>
                <geom type="capsule" fromto="0 0 0 0.088 0 0" size="0.045" rgba=".3 .3 .3 1" contype="0" conaffinity="0" mass="1"/>
                <body name="link7" pos="0.088 0 0" quat="1 1 0 0" gravcomp="1">
                  <joint name="joint7" axis="0 0 1" range="-2.9 2.9"/>
                  <geom type="cylinder" fromto="0 0 0 0 0 0.06" size="0.04" {_LINK}/>
                  <body name="hand" pos="0 0 0.107" quat="0.9238795 0 0 -0.3826834" gravcomp="1">
                    <geom type="box" size="0.025 0.1 0.02" pos="0 0 0.0" rgba=".3 .3 .3 1" contype="0" conaffinity="0" mass="0.5"/>
                    <camera name="wrist_left" pos="0.07 0 0" xyaxes="0 1 0 1 0 0.3" fovy="75"/>
                    <site name="tcp" pos="0 0 0.095"/>
                    <body name="finger_left" pos="0 0 0.0584" gravcomp="1">
                      <joint name="finger_left" type="slide" axis="0 1 0" range="0 {FINGER_OPEN}" damping="10" armature="0"/>
                      <geom type="box" size="0.012 0.006 0.025" pos="0 0.006 0.03" rgba=".15 .15 .15 1" friction="2 0.01 0.001" mass="0.05" condim="4"/>
                    </body>
                    <body name="finger_right" pos="0 0 0.0584" gravcomp="1">
                      <joint name="finger_right" type="slide" axis="0 -1 0" range="0 {FINGER_OPEN}" damping="10" armature="0"/>
                      <geom type="box" size="0.012 0.006 0.025" pos="0 -0.006 0.03" rgba=".15 .15 .15 1" friction="2 0.01 0.001" mass="0.05" condim="4"/>
                    </body>
                  </body>
                </body>
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>
    {{cubes}}
  </worldbody>
  <equality>
    <joint joint1="finger_left" joint2="finger_right" polycoef="0 1 0 0 0"/>
  </equality>
  <actuator>
    {"".join(f'<intvelocity name="joint{i}" joint="joint{i}" kp="{kp}" kv="{kv}" actrange="{lo} {hi}" forcerange="-{f} {f}"/>'
             for i, kp, kv, lo, hi, f in [(1, 800, 40, -2.9, 2.9, 87), (2, 800, 40, -1.76, 1.76, 87), (3, 600, 30, -2.9, 2.9, 87),
                                          (4, 600, 30, -3.07, -0.07, 87), (5, 300, 15, -2.9, 2.9, 12), (6, 300, 15, -0.0175, 3.75, 12),
                                          (7, 200, 10, -2.9, 2.9, 12)])}
    <position name="gripper" joint="finger_left" kp="300" kv="10" ctrlrange="0 {FINGER_OPEN}" forcerange="-30 30"/>
  </actuator>
</mujoco>
"""


def cube_names(cubes: int) -> tuple[str, ...]:
    """The cubes' body (and free joint) names: ``cube`` alone (red), or ``cube`` and ``cube2`` (red and blue)."""
    return ("cube", "cube2")[:cubes]


def scene(cubes: int = 1) -> str:
    """The MJCF of the scene with one cube or two."""
    if cubes not in (1, 2):
        raise ValueError(f"cubes={cubes}: the pick task has one cube or two")
    colors = (".85 .1 .1 1", ".1 .25 .85 1")  # red, blue
    return _SCENE.replace("{cubes}", "\n    ".join(_CUBE.format(name=n, y=0.1 * i, rgba=colors[i])
                                                   for i, n in enumerate(cube_names(cubes))))


SCENE = scene(1)


class PickCube(Environment):
    """The task. ``reset(seed)`` draws the episode; ``observe()`` gives DROID's observation keys;
    ``step(action)`` applies an 8-D action (7 joint velocities in rad/s, then the gripper position in
    [0, 1], 1 = closed) for one 1/15 s control period. ``cubes=2``: a red and a blue cube, either one lifted
    succeeds; ``target`` is the one the episode's expert goes for."""

    # The closed loop's facts about this embodiment (slurmvla.sim.base.Environment).
    client_cameras = CLIENT_CAMERAS
    state_keys = ("observation/joint_position", "observation/gripper_position")
    action_dim = 8
    action_space = "DROID's: 7 joint velocities (rad/s) and the gripper position (0 open, 1 closed)"
    video_keys = ("observation/exterior_image_1_left", "observation/wrist_image_left")
    fps = FPS

    def rest_action(self) -> np.ndarray:
        """What the arm does before its first chunk arrives: hold still, the gripper where it is."""
        return np.array([0.0] * 7 + [self.gripper_position()])

    def __init__(self, height: int = 180, width: int = 320, cameras: tuple[str, ...] = CAMERAS, cubes: int = 1):
        unknown = [c for c in cameras if c not in CAMERAS]
        if unknown:
            raise ValueError(f"sim cameras {unknown} are not in this scene; choose from {list(CAMERAS)}")
        self.model = mujoco.MjModel.from_xml_string(scene(cubes))
        self.instruction = INSTRUCTION if cubes == 1 else TWO_CUBES_INSTRUCTION
        self.model.vis.global_.offwidth = max(width, 640)
        self.model.vis.global_.offheight = max(height, 480)
        self.data = mujoco.MjData(self.model)
        self.cameras = tuple(cameras)
        self.height, self.width = height, width
        self._renderer = None
        m = self.model
        self._arm_qpos = np.array([m.jnt_qposadr[m.joint(f"joint{i}").id] for i in range(1, 8)])
        self._arm_dof = np.array([m.jnt_dofadr[m.joint(f"joint{i}").id] for i in range(1, 8)])
        self._finger_qpos = m.jnt_qposadr[m.joint("finger_left").id]
        self._cubes_qpos = [m.jnt_qposadr[m.joint(n).id] for n in cube_names(cubes)]
        self._cubes = [m.body(n).id for n in cube_names(cubes)]
        self._tcp = m.site("tcp").id
        self._hand = m.body("hand").id
        self.target = 0
        self.steps = 0

    # -- episode ------------------------------------------------------------------------------
    def reset(self, seed: int) -> None:
        rng = np.random.default_rng([20261125, seed])
        mujoco.mj_resetData(self.model, self.data)
        arm = HOME + rng.uniform(-0.05, 0.05, size=7)
        self.data.qpos[self._arm_qpos] = arm
        self.data.act[:7] = arm  # the velocity integrators hold the start pose
        self.data.qpos[self._finger_qpos : self._finger_qpos + 2] = FINGER_OPEN
        if len(self._cubes) == 1:
            places = [CUBE_CENTER + rng.uniform(-CUBE_RANGE, CUBE_RANGE, size=2)]
            yaws = [rng.uniform(-np.pi / 8, np.pi / 8)]
            self.target = 0
        else:  # mirror images across the arm's plane (y = 0), each with its own yaw; the expert's cube by a coin
            x = CUBE_CENTER[0] + rng.uniform(-CUBE_RANGE, CUBE_RANGE)
            y = rng.uniform(MIN_MIRROR_Y, CUBE_RANGE)
            places = [np.array([x, CUBE_CENTER[1] + y]), np.array([x, CUBE_CENTER[1] - y])]
            yaws = list(rng.uniform(-np.pi / 8, np.pi / 8, size=2))
            self.target = int(rng.integers(2))
        for adr, xy, yaw in zip(self._cubes_qpos, places, yaws, strict=True):
            self.data.qpos[adr : adr + 7] = [*xy, TABLE_Z + CUBE_HALF, np.cos(yaw / 2), 0, 0, np.sin(yaw / 2)]
        self.data.ctrl[7] = FINGER_OPEN
        mujoco.mj_forward(self.model, self.data)
        self.steps = 0

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (8,) or not np.isfinite(action).all():
            raise ValueError(f"an action is 7 joint velocities and a gripper position (8 finite numbers), got {action.tolist()}")
        self.data.ctrl[:7] = np.clip(action[:7], -JOINT_VELOCITY_LIMIT, JOINT_VELOCITY_LIMIT)
        self.data.ctrl[7] = FINGER_OPEN * (1.0 - float(np.clip(action[7], 0.0, 1.0)))
        mujoco.mj_step(self.model, self.data, nstep=SUBSTEPS)
        self.steps += 1
        return Step(success=self.success(), reward=self.reward())

    # -- state --------------------------------------------------------------------------------
    def joint_position(self) -> np.ndarray:
        return self.data.qpos[self._arm_qpos].copy()

    def gripper_position(self) -> float:
        """DROID's convention: 0 open, 1 closed."""
        return float(1.0 - self.data.qpos[self._finger_qpos] / FINGER_OPEN)

    def cube_position(self, cube: int | None = None) -> np.ndarray:
        """The position of cube ``cube`` (default: the expert's, ``target``)."""
        return self.data.xpos[self._cubes[self.target if cube is None else cube]].copy()

    def cube_yaw(self, cube: int | None = None) -> float:
        w, _, _, z = self.data.xquat[self._cubes[self.target if cube is None else cube]]
        return float(2 * np.arctan2(z, w))

    def tcp_position(self) -> np.ndarray:
        return self.data.site_xpos[self._tcp].copy()

    def lifted(self, cube: int) -> float:
        """How far cube ``cube``'s bottom is above the table (m)."""
        return float(self.cube_position(cube)[2] - CUBE_HALF - TABLE_Z)

    def success(self) -> bool:
        """A cube, any of them, lifted ``LIFT_HEIGHT`` above the table."""
        return any(self.lifted(c) > LIFT_HEIGHT for c in range(len(self._cubes)))

    def reward(self) -> float:
        """Dense progress in [0, 1]: reach a cube, then lift it (1 at success); the best over the cubes."""
        def progress(c: int) -> float:
            reach = np.exp(-10 * np.linalg.norm(self.tcp_position() - self.cube_position(c)))
            return float(0.5 * reach + 0.5 * np.clip(self.lifted(c) / LIFT_HEIGHT, 0, 1))

        return max(progress(c) for c in range(len(self._cubes)))

    def observe(self, cameras: tuple[str, ...] | None = None) -> dict:
        """The observation under the keys openpi's DROID client sends (images HxWx3 uint8); ``cameras``
        (client keys, default every camera of this environment) picks the cameras rendered."""
        keys = [k for k, cam in CLIENT_CAMERAS.items() if cam in self.cameras] if cameras is None else cameras
        obs = {key: self.render(CLIENT_CAMERAS[key]) for key in keys}
        obs["observation/joint_position"] = self.joint_position()
        obs["observation/gripper_position"] = np.array([self.gripper_position()])
        return obs

    def render(self, camera: str) -> np.ndarray:
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.model, self.height, self.width)
        self._renderer.update_scene(self.data, camera)
        return self._renderer.render().copy()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None


def make(task: str | None, height: int, width: int, max_steps: int) -> PickCube:
    """The pick task as the closed loop runs it (``rollout.task``: null, one cube, or ``two_cubes``), every camera
    rendered at ``height`` x ``width``; the loop counts the steps (``max_steps``)."""
    return PickCube(height=height, width=width, cameras=CAMERAS, cubes=CUBES.get(task, 1) if task else 1)
