"""A point mass on the plane [-1, 1]^2 that moves by the action (a velocity, 2 numbers in [-1, 1]) towards a goal
drawn from the episode's seed; it succeeds within ``REACH`` of the goal. One camera looks down on it: the mass a red
square, the goal a green one. The expert heads straight for the goal at full speed."""

from __future__ import annotations

import numpy as np

from slurmvla.sim.base import Environment, Step

IMAGE_KEY, STATE_KEY = "observation/image", "observation/state"
SPEED, REACH = 0.1, 0.08


class PointMass(Environment):
    client_cameras = {IMAGE_KEY: "top"}
    state_keys = (STATE_KEY,)
    action_dim = 2
    action_space = "2 numbers in [-1, 1]: the mass's velocity along x and y"
    video_keys = (IMAGE_KEY,)
    fps = 10
    instruction = "move to the green square"

    def __init__(self, height: int, width: int):
        self.height, self.width, self.steps = height, width, 0
        self.position, self.goal = np.zeros(2), np.zeros(2)

    def reset(self, seed: int) -> None:
        rng = np.random.default_rng([11, seed])
        self.position, self.goal = rng.uniform(-0.8, 0.8, 2), rng.uniform(-0.8, 0.8, 2)
        self.steps = 0

    def step(self, action: np.ndarray) -> Step:
        action = np.asarray(action, np.float64).reshape(-1)
        if action.shape != (2,) or not np.isfinite(action).all():
            raise ValueError(f"a point mass's action is {self.action_space}; got {action.tolist()}")
        self.position = np.clip(self.position + SPEED * np.clip(action, -1.0, 1.0), -1.0, 1.0)
        self.steps += 1
        distance = float(np.linalg.norm(self.position - self.goal))
        return Step(success=distance < REACH, reward=float(np.exp(-distance)))

    def render(self) -> np.ndarray:
        image = np.zeros((self.height, self.width, 3), np.uint8)
        for point, colour in ((self.goal, (0, 255, 0)), (self.position, (255, 0, 0))):
            row, col = ((1 - point[1]) / 2 * (self.height - 3)).astype(int), ((point[0] + 1) / 2 * (self.width - 3)).astype(int)
            image[row:row + 3, col:col + 3] = colour
        return image

    def observe(self, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        obs = {IMAGE_KEY: self.render()} if keys is None or IMAGE_KEY in keys else {}
        return {**obs, STATE_KEY: self.position.astype(np.float32)}

    def rest_action(self) -> np.ndarray:
        return np.zeros(2)

    def close(self) -> None:
        pass


class Expert:
    def act(self, env: PointMass) -> np.ndarray:
        return np.clip((env.goal - env.position) / SPEED, -1.0, 1.0).astype(np.float32)


def make(task: str | None, height: int, width: int, max_steps: int) -> PointMass:
    return PointMass(height, width)
