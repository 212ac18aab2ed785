"""The simulator contract: what the closed loop (:mod:`slurmvla.inference.closed_loop`) and the one recorder
(:mod:`slurmvla.sim.record`) ask of a simulated task. A simulator is one folder whose ``config.py`` declares
``ENTRIES = (SimulatorEntry(...),)`` (:mod:`slurmvla.registry`; docs/extending.md, "A new simulator"). Optional
capabilities are declared by the class, never looked up on an instance: :meth:`Environment.diagnostics` returns
``None`` unless the environment says how far a failed episode got."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

if TYPE_CHECKING:
    from slurmvla.data.writer import Layout


@dataclass
class Step:
    """What the environment returns after each action: whether the task has succeeded, and the step's progress
    reward in [0, 1]."""

    success: bool
    reward: float


class Environment(ABC):
    """One simulated task under the closed loop. What the loop reads: :attr:`client_cameras` (a client's key -> the
    camera), :attr:`state_keys`, :attr:`action_dim` and :attr:`action_space` (in words, for errors), :attr:`video_keys`
    (what a rollout's videos show), :attr:`fps`, :attr:`instruction` (the prompt), :attr:`steps` (since the reset)."""

    client_cameras: ClassVar[Mapping[str, str]]
    state_keys: ClassVar[tuple[str, ...]]
    action_dim: ClassVar[int]
    action_space: ClassVar[str]
    video_keys: ClassVar[tuple[str, ...]]
    fps: int
    instruction: str
    steps: int

    @abstractmethod
    def reset(self, seed: int) -> None:
        """Start the episode ``seed`` draws (the same seed, the same episode)."""

    @abstractmethod
    def observe(self, keys: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """The observation under the client's keys: the cameras ``keys`` names (default every one, HxWx3 uint8)
        and every state key."""

    @abstractmethod
    def step(self, action: np.ndarray) -> Step:
        """Apply one action (``action_dim`` finite numbers; anything else is a ValueError naming it) for one control
        period."""

    @abstractmethod
    def rest_action(self) -> np.ndarray:
        """What the arm does before its first chunk arrives."""

    @abstractmethod
    def close(self) -> None:
        """Free the renderer and the simulation."""

    def diagnostics(self) -> dict[str, Any] | None:
        """How far the episode so far got (flags and numbers, summarised over the failures in ``rollout.json``), or
        ``None``: this environment keeps none."""
        return None


class Expert(Protocol):
    """A scripted policy that reads the simulator (anything it likes of it) and returns the next action."""

    def act(self, env: Any) -> np.ndarray: ...


class Recording(ABC):
    """What the one recorder (:func:`slurmvla.sim.record.record`) writes, built as ``cls(task, height, width)``:
    the :meth:`parts` recorded one after the other into one dataset (a single task's :class:`Demonstrations` is
    its own one part; a suite of tasks, e.g. Meta-World's MT50, has one part per task), the dataset's task strings,
    layout, summary and the files beside it."""

    # Demonstrations written into one data file (LeRobot v3.0).
    episodes_per_file: int = 8
    robot_type: str = "sim"

    def __init__(self, task: str | None, height: int, width: int):
        self.task, self.height, self.width = task, height, width

    @abstractmethod
    def parts(self) -> list[Demonstrations]:
        """The demonstrations recorded in turn, ``--episodes`` each, each writing its episodes' task index."""

    @abstractmethod
    def tasks(self) -> list[str]:
        """The dataset's task strings (``meta/tasks``)."""

    def layout(self) -> Layout | None:
        """The dataset's cameras and features (default DROID's: :func:`slurmvla.data.writer.droid_layout`)."""
        return None

    @abstractmethod
    def summary(self, tried: list[tuple[dict[str, Any], bool]], noise: float, frames: int) -> dict[str, Any]:
        """The recording's summary (every episode tried with whether it was kept), written beside the data."""

    @abstractmethod
    def files(self, summary: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, str]:
        """Files beside ``meta/`` (name -> text): the summary, and whatever the data layer reads of this simulator."""


class Demonstrations(Recording):
    """A simulator's scripted demonstrations of one task, built as ``cls(task, height, width)``. The recorder
    (:func:`slurmvla.sim.record.episode`) drives every episode alike: reset to the seed, then per step ``observe``,
    the expert's action, the action executed (``perturb`` under ``--noise``), the step, until ``done`` or ``steps``;
    ``episode`` turns the steps into arrays, ``keep`` decides, ``columns`` and ``files`` write them."""

    # Control steps an episode runs at most (the whole episode when ``done`` never ends it early).
    steps: int

    def parts(self) -> list[Demonstrations]:
        return [self]

    @abstractmethod
    def environment(self) -> Environment:
        """The environment the demonstrations are recorded in."""

    @abstractmethod
    def expert(self, env: Environment) -> Expert:
        """A fresh scripted expert for one episode."""

    @abstractmethod
    def observe(self, env: Environment, render: bool) -> dict[str, Any]:
        """What one step records before the action (``"frames"``: camera -> frame, when ``render``)."""

    @abstractmethod
    def perturb(self, action: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
        """The action executed under ``--noise`` (the expert's command is what is recorded)."""

    def done(self, outcomes: list[Step]) -> bool:
        """Whether the episode ends after these steps (default: it runs all ``steps``)."""
        return False

    @abstractmethod
    def episode(self, env: Environment, observed: list[dict], actions: list[np.ndarray], outcomes: list[Step],
                seed: int) -> dict[str, Any]:
        """The episode as arrays (with ``"success"``, ``"seed"`` and ``"frames"``)."""

    def keep(self, episode: dict[str, Any]) -> bool:
        """Whether the episode becomes a demonstration (default: every one)."""
        return True

    def max_tries(self, episodes: int) -> int:
        """Seeds tried at most for ``episodes`` demonstrations (default: one each, every episode kept)."""
        return episodes

    @abstractmethod
    def columns(self, episode: dict[str, Any], episode_index: int, start_index: int) -> tuple[dict, dict, dict]:
        """One kept episode for :func:`slurmvla.data.writer.write_dataset`: its columns, its frames (video key ->
        frames) and its ``meta/episodes`` row."""
