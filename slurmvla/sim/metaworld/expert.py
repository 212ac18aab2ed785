"""Meta-World's scripted experts (one per task, shipped with the package) under the simulator contract: they read
the full environment state (Meta-World's 39 numbers) and return the next action."""

from __future__ import annotations

import warnings

import numpy as np

from slurmvla.sim.metaworld.env import MetaWorld, check_task


def scripted_policy(task: str):  # noqa: ANN201 - a metaworld.policies.Policy
    """Meta-World's scripted policy for ``task`` (``get_action(env_state) -> action``)."""
    from metaworld.policies import ENV_POLICY_MAP

    return ENV_POLICY_MAP[check_task(task, "task")]()


class Expert:
    """The scripted expert of ``task``: :meth:`action` from the environment state alone (what a server answers when
    it is handed that state), :meth:`act` from the environment (what the recorder asks)."""

    def __init__(self, task: str):
        self.task = check_task(task, "task")
        self.policy = scripted_policy(task)
        # Meta-World's experts warn that their gains exceed the action range, every call; the environment clips.
        warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high", category=UserWarning)

    def action(self, env_state: np.ndarray) -> np.ndarray:
        return np.asarray(self.policy.get_action(np.asarray(env_state)), np.float64)

    def act(self, env: MetaWorld) -> np.ndarray:
        return self.action(env.env_state())
