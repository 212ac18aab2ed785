"""Meta-World's environment (``pip install -e '.[sim]'``: metaworld 3.1.1 on MuJoCo 3.3.0) as a second embodiment of the closed
loop: a Sawyer arm acting in end-effector space, one camera.

The regime is 3D Diffusion Policy's (Ze et al., RSS 2024; its ``metaworld_wrapper.py``), on the v3 tasks the
package now ships where DP3 used v2:

- the goal-observable task with its object and goal drawn anew at each reset (DP3: ``_freeze_rand_vec = False``),
  here from the episode's seed (the environment's own generator seeded with it), so an episode is reproducible
  and training seeds are disjoint from evaluation seeds;
- one camera, ``corner2``, moved to [0.6, 0.295, 0.8] as DP3 moves it, at 128 x 128 (``rollout.height`` /
  ``width``); rendered without shadows (four times faster through Mesa's llvmpipe, which a CPU evaluation of
  20 x 200 frames per checkpoint needs), the same for the demonstrations and the evaluation;
- the state is DP3's ``agent_pos``: the end effector's position and both fingertips' (9 numbers);
- the action is Meta-World's: the end effector's displacement (x, y, z, scaled by the environment) and the
  gripper's effort, each in [-1, 1];
- 200 control steps an episode; an episode succeeds when the task's ``success`` flag is raised at any step.

``regime=LEROBOT`` (``rollout.env=mt50``, :mod:`slurmvla.sim.metaworld.mt50`) observes and runs a task as LeRobot's
Meta-World benchmark does (LeRobot 0.6.1's ``envs/metaworld.py``), the regime the VLA field's MT50 table is measured
in: corner2 moved to [0.75, 0.075, 0.7] and its frame flipped on both axes (it renders upside down), the state
Meta-World's first 4 numbers (the hand's position and the gripper's opening), episodes of up to 500 steps, each task
asked with LeRobot's instruction.

Under openpi's client the observation is ``observation/image`` (the camera), ``observation/state`` (the 9 numbers)
and the prompt (openpi's LIBERO client's names, the nearest published single-arm layout). The full environment
state (Meta-World's 39 numbers: hand, gripper opening, objects, goal) is offered as ``observation/env_state`` for
a policy that asks for it in its metadata: the scripted experts (:mod:`slurmvla.sim.metaworld.expert`), served through
the same server and client, check every convention here without learning anything (tests/sim/test_metaworld.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco  # slurmvla.sim (imported first) chose the offscreen backend
import numpy as np

from slurmvla.sim.base import Environment, Step

CAMERA = "corner2"
# DP3's corner2 (metaworld_wrapper.py: cam_pos[2] = [0.6, 0.295, 0.8]).
CAMERA_POSITION = (0.6, 0.295, 0.8)
# Its orientation and vertical field of view, Meta-World's own (xyz_base.xml: euler 3.9 2.3 0.6, fovy 60): the
# rotation's columns are the camera's x, y and z axes in the world (it looks along -z), as MuJoCo computes them.
# tests/sim/test_metaworld.py checks all three against the rendering model's camera.
CAMERA_ROTATION = ((-0.5499013297225573, 0.3762077406192429, 0.7457052121767203),
                   (-0.8331827568227445, -0.30954914217001317, -0.45824210011200406),
                   (0.058438183601257465, -0.8732966646449378, 0.48367128736096404))
CAMERA_FOVY = 60.0
# The camera's frame (rollout.height x rollout.width in experiment=metaworld), DP3's 128 x 128.
IMAGE_SIZE = 128
IMAGE_KEY = "observation/image"
STATE_KEY = "observation/state"
ENV_STATE_KEY = "observation/env_state"
STATE_DIM = 9
# Where the state's fingertips are (MetaWorld.state): the right one's x, y, z, then the left one's.
FINGERTIPS = (slice(3, 6), slice(6, 9))
ACTION_DIM = 4
EPISODE_STEPS = 200
# Meta-World's control rate: 5 physics steps of 2.5 ms an action (MetaWorld.fps reads it off the model).
FPS = 80
# Meta-World's 39 numbers: the first object's position, and the goal's (the goal-observable tasks'; last three).
OBJECT = slice(4, 7)
GOAL = slice(36, 39)
# An object carried this far from where the reset put it counts as moved (MetaWorld.diagnostics).
MOVED_M = 0.02
# The table's seven tasks (docs/benchmarks.md#meta-world), with the instruction each episode is recorded and
# asked with; any other Meta-World v3 task runs with its name as the instruction.
INSTRUCTIONS = {
    "assembly-v3": "put the nut on the peg",
    "disassemble-v3": "pick the nut up off the peg",
    "stick-push-v3": "use the stick to push the thermos to the goal",
    "hammer-v3": "hammer the nail into the wall",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "coffee-pull-v3": "pull the coffee mug out of the machine",
    "button-press-v3": "press the button",
}




@dataclass(frozen=True)
class Regime:
    """How a task is observed and run: where the corner2 camera stands, whether its frame is flipped on both axes,
    the state's numbers (9: DP3's hand and fingertips; 4: Meta-World's own first four, the hand and the gripper's
    opening), an episode's steps at most, and which instruction each task is asked with."""

    name: str
    camera_position: tuple[float, float, float]
    flip: bool
    state_dim: int
    steps: int


# 3D Diffusion Policy's (the v2 table's, ``rollout.env=metaworld``).
DP3 = Regime("dp3", CAMERA_POSITION, flip=False, state_dim=STATE_DIM, steps=EPISODE_STEPS)
# LeRobot's Meta-World benchmark (``rollout.env=mt50``): envs/metaworld.py moves corner2 there and flips its frame.
LEROBOT = Regime("lerobot", (0.75, 0.075, 0.7), flip=True, state_dim=4, steps=500)


def tasks() -> list[str]:
    """Every Meta-World v3 task this package ships."""
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

    return sorted(k.removesuffix("-goal-observable") for k in ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE)


def check_task(task: str | None, where: str = "rollout.task") -> str:
    """``task`` if Meta-World has it, else a ValueError naming it and the choices."""
    names = tasks()
    if task not in names:
        raise ValueError(f"{where}={task!r} is not a Meta-World v3 task; choose one of {names}")
    return task


def instruction(task: str, regime: Regime = DP3) -> str:
    """What ``task`` is asked with: LeRobot's instruction in its regime, else the v2 table's (or the task's name)."""
    if regime.name == LEROBOT.name:
        from slurmvla.sim.metaworld.mt50 import INSTRUCTIONS as LEROBOT_INSTRUCTIONS

        return LEROBOT_INSTRUCTIONS[task]
    return INSTRUCTIONS.get(task, task.removesuffix("-v3").replace("-", " "))


class MetaWorld(Environment):
    """One Meta-World task under the closed loop's interface: ``reset(seed)``, ``observe(keys)``, ``step(action)``
    (a 4-D action), ``close()``; what it sends and takes as class facts (:data:`client_cameras`, ...)."""

    # The closed loop's facts about this embodiment.
    client_cameras = {IMAGE_KEY: CAMERA}
    state_keys = (STATE_KEY, ENV_STATE_KEY)
    action_dim = ACTION_DIM
    action_space = "4 numbers in [-1, 1]: the end effector's x, y, z displacement and the gripper's effort"
    video_keys = (IMAGE_KEY,)

    def __init__(self, task: str, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE,
                 max_steps: int = EPISODE_STEPS, regime: Regime = DP3):
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE

        self.task = check_task(task)
        self.regime = regime
        self.instruction = instruction(task, regime)
        self.env = ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{task}-goal-observable"](seed=0)
        # A new object and goal at each reset, drawn from the environment's generator (seeded per episode).
        self.env._freeze_rand_vec = False
        self.env.seeded_rand_vec = True
        # Meta-World's own limit (500) would end an episode early with a truncation; the loop keeps the count.
        self.env.max_path_length = max(max_steps, self.env.max_path_length)
        model = self.env.model
        model.cam_pos[model.camera(CAMERA).id] = regime.camera_position
        self.fps = round(1.0 / (self.env.frame_skip * model.opt.timestep))  # 80 Hz
        self.height, self.width = height, width
        self._renderer: mujoco.Renderer | None = None
        self._obs: np.ndarray | None = None
        self.steps = 0

    def reset(self, seed: int) -> None:
        self.env.seed(int(seed))
        self._obs, _ = self.env.reset()
        # Some tasks move a body by its model's position at reset (assembly's and peg-insert-side's) and leave the
        # world's kinematics to the next step: without this the first frame shows it elsewhere (assembly: 9 cm).
        mujoco.mj_forward(self.env.model, self.env.data)
        self.steps = 0
        self._start = self._obs[OBJECT].copy()
        to_goal = self._to_goal()
        self._diagnostics = {"near_object": False, "grasped": False, "moved_object": False,
                             "start_to_goal_m": to_goal, "closest_to_goal_m": to_goal}

    def rest_action(self) -> np.ndarray:
        """What the arm does before its first chunk arrives: stay, the gripper relaxed."""
        return np.zeros(ACTION_DIM)

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (ACTION_DIM,) or not np.isfinite(action).all():
            raise ValueError(f"a Meta-World action is {self.action_space}; got {action.tolist()}")
        self._obs, reward, _, _, info = self.env.step(np.clip(action, -1.0, 1.0).astype(np.float32))
        self.steps += 1
        self._follow(info)
        # Meta-World's reward is in [0, 10]; the loop's return counts progress in [0, 1] a step.
        return Step(success=bool(info["success"]), reward=float(reward) / 10.0)

    def _to_goal(self) -> float:
        return float(np.linalg.norm(self._obs[OBJECT] - self._obs[GOAL]))

    def _follow(self, info: dict) -> None:
        d = self._diagnostics
        # Meta-World's own flags (each task defines them: near_object is a reward in [0, 1] on some, a flag on
        # others; grasp_success likewise), counted from one half.
        d["near_object"] |= float(info["near_object"]) >= 0.5
        d["grasped"] |= float(info["grasp_success"]) >= 0.5
        d["moved_object"] |= bool(np.linalg.norm(self._obs[OBJECT] - self._start) >= MOVED_M)
        d["closest_to_goal_m"] = min(d["closest_to_goal_m"], self._to_goal())

    def diagnostics(self) -> dict:
        """How far the episode so far got, for telling failures apart (``rollout.json``'s ``failures``): whether
        the hand came near the task's object and grasped it (Meta-World's ``near_object`` and ``grasp_success``
        at any step), whether the object moved ``MOVED_M`` from where the reset put it, and the object's distance to
        the goal at the reset and at its closest (m; Meta-World's own success rule differs per task)."""
        return dict(self._diagnostics)

    def state(self) -> np.ndarray:
        """DP3's ``agent_pos``: the end effector's position, then the right and the left fingertip's; in LeRobot's
        regime Meta-World's own first 4 numbers (the hand's position, the gripper's opening)."""
        if self.regime.state_dim == 4:
            return np.asarray(self._obs[:4], np.float32).copy()
        env = self.env
        return np.concatenate([env.get_endeff_pos(), env._get_site_pos("rightEndEffector"),
                               env._get_site_pos("leftEndEffector")]).astype(np.float32)

    def env_state(self) -> np.ndarray:
        """Meta-World's own observation (39 numbers), what its scripted experts act on."""
        return np.asarray(self._obs, np.float64).copy()

    def observe(self, keys: tuple[str, ...] | None = None) -> dict:
        """The observation under the client's keys (``keys``: the cameras rendered; default every one)."""
        keys = tuple(self.client_cameras) if keys is None else keys
        obs = {key: self.render(self.client_cameras[key]) for key in keys if key in self.client_cameras}
        obs[STATE_KEY] = self.state()
        obs[ENV_STATE_KEY] = self.env_state()
        return obs

    def render(self, camera: str = CAMERA) -> np.ndarray:
        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.env.model, self.height, self.width)
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
        self._renderer.update_scene(self.env.data, camera)
        frame = self._renderer.render()
        return np.ascontiguousarray(frame[::-1, ::-1]) if self.regime.flip else frame.copy()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self.env.close()


def make(task: str | None, height: int, width: int, max_steps: int) -> MetaWorld:
    """Meta-World's ``task`` as the closed loop runs it, the camera at ``height`` x ``width``."""
    return MetaWorld(task, height=height, width=width, max_steps=max_steps)


def make_lerobot(task: str | None, height: int, width: int, max_steps: int) -> MetaWorld:
    """Meta-World's ``task`` in LeRobot's regime (:data:`LEROBOT`), as ``rollout.env=mt50`` runs each task."""
    return MetaWorld(task, height=height, width=width, max_steps=max_steps, regime=LEROBOT)
