"""Robot-side execution of action chunks: which action runs at each control tick, given a policy that
answers ``infer(obs) -> {"actions": [H, D]}`` (openpi's ``WebsocketClientPolicy``, or any object with that
method). It imports numpy and the standard library only, so it runs on the robot's computer beside
openpi's client.

Modes (docs/serving.md, "Execution modes"):

- ``sync``: run ``replan_steps`` actions of a chunk, ask, and hold the arm until the answer arrives
  (openpi's DROID client); the new chunk then runs from its first action.
- ``async``: ask when the current chunk's index reaches ``replan_steps`` and keep executing it while the
  request is outstanding; on the answer, switch to the new chunk, skipping the actions executed since the
  observation (the new chunk's index i is the observation's step + i).
- ``rtc``: as async, and the request also carries ``prev_actions`` (the current chunk from the
  observation's step on) and ``delay`` (how many of them will run before the switch), so a server with
  real-time chunking guides the new chunk to agree with them.

Holding: DROID's arm is velocity controlled, so "no action" is zero joint velocity with the gripper kept
where it was last commanded (:meth:`Executor.hold`). The arm holds before its first chunk arrives, in sync
mode while a request is outstanding, and when a chunk runs out before its successor arrives.

:class:`Executor` is the deterministic core, on ticks: a request is answered within the tick it is sent (the
call blocks) and its answer takes effect ``delay`` ticks later: a fixed number, or the call's measured wall
time times the control rate. The simulator and the tests run it. :class:`ThreadedExecutor` asks in a
background thread, for a robot whose control loop must not block.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slurmvla.config.serve import EXECUTION_MODES


@dataclass
class Tick:
    """What ran at one control tick: the action, the chunk it came from (1 for the first answer; None while
    holding) and its index in that chunk."""

    action: np.ndarray
    chunk: int | None
    index: int | None


@dataclass
class _Pending:
    request: dict
    sent: int  # the tick the observation was taken at
    ready: int = 0  # the tick the answer takes effect at (the tick-based core)
    executed: int = 0  # actions of the current chunk run since the observation
    actions: np.ndarray | None = None
    future: Future | None = field(default=None, repr=False)


def chunk_of(answer: dict) -> np.ndarray:
    """The action chunk of an answer, as float64 [H, D]."""
    actions = np.asarray(answer["actions"], dtype=np.float64)
    if actions.ndim != 2 or not len(actions):
        raise ValueError(f"the policy returned actions of shape {actions.shape}; an action chunk is [horizon, dim]")
    return actions


class Executor:
    """Run action chunks from ``client`` one control tick at a time: call :meth:`step` at every tick with a
    function returning the current observation (called only when a request is sent); it returns the
    :class:`Tick` to execute.

    ``delay``: the ticks between sending a request and its answer taking effect, an int >= 0 or
    ``"measured"`` (the call's wall time times ``control_hz``, rounded up; the rtc request then carries the
    delay last measured). ``rest``: the action held before the first chunk (default: zeros); ``held``: the
    action dimensions a hold keeps from the last action (DROID's gripper position, the last), the others
    (joint velocities) are zeroed. ``clock``: the wall clock a measured delay is read from.
    """

    def __init__(self, client: Any, mode: str = "sync", replan_steps: int = 4, delay: int | str = 0,
                 control_hz: float = 15.0, rest: np.ndarray | None = None, held: tuple[int, ...] = (-1,),
                 clock: Callable[[], float] = time.perf_counter):
        if mode not in EXECUTION_MODES:
            raise ValueError(f"execution mode {mode!r} is not valid; choose one of {list(EXECUTION_MODES)}")
        if replan_steps < 1:
            raise ValueError(f"replan_steps={replan_steps} is not valid; it must be >= 1")
        if not (delay == "measured" or (isinstance(delay, int) and delay >= 0)):
            raise ValueError(f"delay={delay!r} is not valid; give an int >= 0 or 'measured'")
        if delay == "measured" and not control_hz > 0:
            raise ValueError(f"control_hz={control_hz!r} is not valid; a measured delay needs a control rate > 0")
        self.client, self.mode, self.replan, self.delay = client, mode, replan_steps, delay
        self.control_hz, self.held, self.clock = control_hz, tuple(held), clock
        self.reset(rest)

    def reset(self, rest: np.ndarray | None = None) -> None:
        """A new episode: no chunk, nothing outstanding, tick 0."""
        self.tick, self.requests, self.chunk_id, self.pos = 0, 0, 0, 0
        self.chunk: np.ndarray | None = None
        self.pending: _Pending | None = None
        self.last = None if rest is None else np.asarray(rest, dtype=np.float64)
        # The delay a rtc request announces: the fixed one, or the last measured.
        self.estimate = 0 if self.delay == "measured" else self.delay

    # -- the control tick -----------------------------------------------------------------------
    def step(self, observe: Callable[[], dict]) -> Tick:
        """The action for this tick; sends a request (with ``observe()``) when one is due."""
        if self.pending is not None and self._arrived(self.pending):
            self._switch()
        # Due when the chunk's index reaches replan_steps: at once after a switch that landed there (a delay
        # of replan_steps or more), in the tick the answer of a request without delay is used.
        if self.pending is None and (self.chunk is None or self.pos >= min(self.replan, len(self.chunk))):
            self._send(self._request(observe()))
            if self._arrived(self.pending):
                self._switch()
        running = self.pending is None or self.mode != "sync"
        if running and self.chunk is not None and self.pos < len(self.chunk):
            tick = Tick(self.chunk[self.pos], self.chunk_id, self.pos)
            self.pos += 1
            if self.pending is not None:
                self.pending.executed += 1
        else:
            tick = Tick(self.hold(), None, None)
        self.last = tick.action
        self.tick += 1
        return tick

    def hold(self) -> np.ndarray:
        """Zero velocity, the held dimensions (the gripper) as last commanded."""
        if self.last is None:
            width = self.pending.actions.shape[1] if self.pending is not None and self.pending.actions is not None \
                else None
            if width is None:
                raise ValueError("the arm must hold before the first chunk arrives: give the executor rest=ACTION")
            self.last = np.zeros(width)
        action = np.zeros_like(self.last)
        action[list(self.held)] = self.last[list(self.held)]
        return action

    # -- requests ------------------------------------------------------------------------------
    def _request(self, obs: dict) -> dict:
        request = dict(obs)
        if self.mode == "rtc" and self.chunk is not None and self.pos < len(self.chunk):
            prev = self.chunk[self.pos:]
            # The server accepts 0 <= delay <= len(prev_actions) and delay < horizon.
            request["prev_actions"] = prev.copy()
            request["delay"] = int(min(self.estimate, len(prev), len(self.chunk) - 1))
        return request

    def _send(self, request: dict) -> None:
        self.requests += 1
        self.pending = _Pending(request, self.tick)
        start = self.clock()
        self.pending.actions = chunk_of(self.client.infer(request))
        if self.delay == "measured":
            self.estimate = math.ceil((self.clock() - start) * self.control_hz)
        self.pending.ready = self.tick + self.estimate

    def _arrived(self, pending: _Pending) -> bool:
        return self.tick >= pending.ready

    def _switch(self) -> None:
        pending, self.pending = self.pending, None
        self.chunk, self.chunk_id = pending.actions, self.chunk_id + 1
        # The actions run since the observation are skipped (none in sync mode: the arm held).
        self.pos = pending.executed


class ThreadedExecutor(Executor):
    """:class:`Executor` for a robot's control loop: the request runs in a background thread, :meth:`step`
    never waits for it, and the answer takes effect at the first tick after it arrived (call ``step`` at
    the control rate). The delay a rtc request announces is the one last seen, in ticks."""

    def __init__(self, client: Any, mode: str = "sync", replan_steps: int = 4, rest: np.ndarray | None = None,
                 held: tuple[int, ...] = (-1,)):
        if rest is None:
            raise ValueError("a threaded executor holds before its first chunk arrives: give it rest=ACTION")
        super().__init__(client, mode, replan_steps, 0, rest=rest, held=held)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmvla-infer")

    def _send(self, request: dict) -> None:
        self.requests += 1
        self.pending = _Pending(request, self.tick, future=self._pool.submit(self.client.infer, request))

    def _arrived(self, pending: _Pending) -> bool:
        if not pending.future.done():
            return False
        pending.actions = chunk_of(pending.future.result())
        self.estimate = self.tick - pending.sent
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def switch_metrics(ticks: list[Tick]) -> dict:
    """The jumps |a_t - a_{t-1}| (Euclidean) of an episode's executed actions: at chunk switches (the
    source changed; a hold counts as its own source) against within a chunk (same chunk, consecutive
    steps); steps between two holds are neither. Also the ticks spent holding."""
    switch, within = [], []
    for prev, cur in zip(ticks, ticks[1:]):
        jump = float(np.linalg.norm(np.asarray(cur.action) - np.asarray(prev.action)))
        if cur.chunk != prev.chunk:
            switch.append(jump)
        elif cur.chunk is not None:
            within.append(jump)
    return {"switches": len(switch), "switch_jump_mean": float(np.mean(switch)) if switch else 0.0,
            "switch_jump_max": max(switch, default=0.0), "within_steps": len(within),
            "within_jump_mean": float(np.mean(within)) if within else 0.0, "within_jump_max": max(within, default=0.0),
            "hold_steps": sum(t.chunk is None for t in ticks)}
