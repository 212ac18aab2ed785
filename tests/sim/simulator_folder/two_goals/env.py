"""A point mass on the plane [-1, 1]^2 with a green and a blue goal, both drawn from the episode's seed (at least
``APART`` from each other): the task (green or blue) decides which one is to be reached, and only the instruction
says which; the camera and the state (the mass's position, then both goals') are the same for either task.
It succeeds within ``REACH`` of its own goal."""

from __future__ import annotations

import numpy as np

from slurmvla.sim.base import Environment, Step

IMAGE_KEY, STATE_KEY = "observation/image", "observation/state"
SPEED, REACH, APART = 0.1, 0.08, 0.8
COLOURS = {"green": (0, 255, 0), "blue": (0, 0, 255)}
GROUPS = {"colours": ["green", "blue"]}


def suite(task: str | None, key: str = "rollout.task") -> list[str]:
    if task is None:
        return list(COLOURS)
    if task not in COLOURS:
        raise ValueError(f"{key}={task!r} is not a goal; choose one of {list(COLOURS)} or null")
    return [task]


class TwoGoals(Environment):
    client_cameras = {IMAGE_KEY: "top"}
    state_keys = (STATE_KEY,)
    action_dim = 2
    action_space = "2 numbers in [-1, 1]: the mass's velocity along x and y"
    video_keys = (IMAGE_KEY,)
    fps = 10

    def __init__(self, task: str, height: int, width: int):
        self.task, self.height, self.width, self.steps = task, height, width, 0
        self.instruction = f"move to the {task} square"
        self.position, self.goals = np.zeros(2), {}

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng([13, seed])
        self.position = rng.uniform(-0.8, 0.8, 2)
        while True:
            green, blue = rng.uniform(-0.8, 0.8, 2), rng.uniform(-0.8, 0.8, 2)
            if np.linalg.norm(green - blue) >= APART:
                break
        self.goals, self.steps = {"green": green, "blue": blue}, 0

    @property
    def goal(self) -> np.ndarray:
        return self.goals[self.task]

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, np.float64).reshape(-1)
        if action.shape != (2,) or not np.isfinite(action).all():
            raise ValueError(f"a point mass's action is {self.action_space}; got {action.tolist()}")
        self.position = np.clip(self.position + SPEED * np.clip(action, -1.0, 1.0), -1.0, 1.0)
        self.steps += 1
        distance = float(np.linalg.norm(self.position - self.goal))
        return Step(success=distance < REACH, reward=float(np.exp(-distance)))

    def state(self) -> np.ndarray:
        return np.concatenate([self.position, self.goals["green"], self.goals["blue"]]).astype(np.float32)

    def render(self) -> np.ndarray:
        image = np.zeros((self.height, self.width, 3), np.uint8)
        points = [(self.goals["green"], COLOURS["green"]), (self.goals["blue"], COLOURS["blue"]),
                  (self.position, (255, 0, 0))]
        for point, colour in points:
            row = int((1 - point[1]) / 2 * (self.height - 3))
            col = int((point[0] + 1) / 2 * (self.width - 3))
            image[row:row + 3, col:col + 3] = colour
        return image

    def observe(self, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        obs = {IMAGE_KEY: self.render()} if keys is None or IMAGE_KEY in keys else {}
        return {**obs, STATE_KEY: self.state()}

    def rest_action(self) -> np.ndarray:
        return np.zeros(2)

    def close(self) -> None:
        pass


class Expert:
    def act(self, env: TwoGoals) -> np.ndarray:
        return np.clip((env.goal - env.position) / SPEED, -1.0, 1.0).astype(np.float32)


def make(task: str | None, height: int, width: int, max_steps: int) -> TwoGoals:
    return TwoGoals(task, height, width)
