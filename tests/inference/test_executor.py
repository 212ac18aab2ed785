"""The robot-side chunk executor on a fake clock: which action runs at each control tick in the sync, async and
rtc modes, what each request carried, the measured delay, holding, and the switch metrics.

References: hand-written tick-by-tick sequences; a copy of the closed loop as it ran before execution modes
(execute ``replan_steps`` actions, ask, wait)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from slurmvla.config.serve import EXECUTION_MODES
from slurmvla.inference.executor import Executor, ThreadedExecutor, Tick, switch_metrics

H = 8  # the fake policy's action horizon
H_ = "hold"


class FakeClient:
    """Chunk n (1 for the first answer) is [10 n + i, n] at index i: the first dimension codes chunk and
    index, the second (the "gripper", held on a hold) the chunk. Records every request; ``clock`` (if given)
    advances ``call_s`` per call."""

    def __init__(self, horizon: int = H, clock: list[float] | None = None, call_s: float = 0.0):
        self.horizon, self.requests, self.clock, self.call_s = horizon, [], clock, call_s

    def infer(self, obs: dict) -> dict:
        self.requests.append(obs)
        if self.clock is not None:
            self.clock[0] += self.call_s
        n = len(self.requests)
        return {"actions": np.stack([np.arange(self.horizon) + 10.0 * n, np.full(self.horizon, float(n))], axis=1)}


def run(mode: str, delay, ticks: int, replan: int = 4, horizon: int = H, **kw) -> tuple[list, FakeClient, list]:
    """Executed first dimensions ("hold" while holding), the client, and the ticks at which requests went out."""
    client = kw.pop("client", None) or FakeClient(horizon)
    ex = Executor(client, mode, replan, delay, rest=np.zeros(2), **kw)
    out, sent = [], []
    for k in range(ticks):
        tick = ex.step(lambda k=k: sent.append(k) or {"tick": k})
        out.append(H_ if tick.chunk is None else int(tick.action[0]))
        if tick.chunk is not None:
            assert tick.action[0] == 10 * tick.chunk + tick.index
    assert ex.requests == len(client.requests) == len(sent)
    return out, client, sent


# (mode, d) -> (executed actions over 16 ticks, ticks at which requests were sent); replan_steps = 4, H = 8.
EXPECTED = {
    ("sync", 0): ([10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41, 42, 43], [0, 4, 8, 12]),
    # The arm holds d ticks per request.
    ("sync", 1): ([H_, 10, 11, 12, 13, H_, 20, 21, 22, 23, H_, 30, 31, 32, 33, H_], [0, 5, 10, 15]),
    ("sync", 3): ([H_, H_, H_, 10, 11, 12, 13, H_, H_, H_, 20, 21, 22, 23, H_, H_], [0, 7, 14]),
    ("async", 0): ([10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33, 40, 41, 42, 43], [0, 4, 8, 12]),
    # Asked at index 4, the chunk runs on (14) until the answer, which starts at index 1.
    ("async", 1): ([H_, 10, 11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34, 41, 42], [0, 5, 9, 13]),
    ("async", 3): ([H_, H_, H_, 10, 11, 12, 13, 14, 15, 16, 23, 24, 25, 26, 33, 34], [0, 7, 11, 15]),
}
EXPECTED.update({("rtc", d): EXPECTED[("async", d)] for d in (0, 1, 3)})


def test_a_delay_of_replan_steps_asks_again_as_the_answer_lands():
    # d = 4 = replan_steps: each answer starts at index 4, where the next request is due: no hold after the first.
    actions, _, sent = run("async", 4, 20)
    assert actions == [H_] * 4 + list(range(10, 18)) + [24, 25, 26, 27, 34, 35, 36, 37]
    assert sent == [0, 8, 12, 16]


@pytest.mark.parametrize("mode, d", sorted(EXPECTED))
def test_each_mode_executes_the_hand_written_sequence(mode, d):
    actions, _, sent = run(mode, d, 16)
    assert (actions, sent) == EXPECTED[(mode, d)]


@pytest.mark.parametrize("d", [1, 3])
def test_while_a_request_is_outstanding_async_runs_the_old_chunk_and_sync_holds(d):
    for mode, during in (("async", [14, 15, 16][:d]), ("sync", [H_] * d)):
        actions, _, sent = run(mode, d, 16)
        second = sent[1]  # the first request after a chunk ran
        assert actions[second : second + d] == during, mode


def test_the_rtc_request_carries_the_rest_of_the_old_chunk_and_the_delay():
    # d = 3: the second request (tick 7) is sent at chunk 1's index 4, the third (tick 11) at chunk 2's index 4.
    _, client, _ = run("rtc", 3, 16)
    first, second, third = client.requests[:3]
    assert "prev_actions" not in first and "delay" not in first  # nothing to agree with yet
    np.testing.assert_array_equal(second["prev_actions"], [[14, 1], [15, 1], [16, 1], [17, 1]])
    np.testing.assert_array_equal(third["prev_actions"], [[24, 2], [25, 2], [26, 2], [27, 2]])
    assert second["delay"] == third["delay"] == 3 and second["tick"] == 7 and third["tick"] == 11
    # d = 1 and d = 0: the same rest of the chunk, the delay as configured.
    for d, tick in ((1, 5), (0, 4)):
        _, client, _ = run("rtc", d, 8)
        np.testing.assert_array_equal(client.requests[1]["prev_actions"][:, 0], [14, 15, 16, 17])
        assert client.requests[1]["delay"] == d and client.requests[1]["tick"] == tick
    # async and sync send the observation alone.
    for mode in ("async", "sync"):
        _, client, _ = run(mode, 3, 16)
        assert all(set(r) == {"tick"} for r in client.requests)


def test_the_announced_delay_never_exceeds_the_old_chunk_left():
    # H = 6, replan 4: 2 actions are left when asking; d = 3 announces 2, runs them and holds one tick.
    actions, client, _ = run("rtc", 3, 12, horizon=6)
    assert client.requests[1]["delay"] == 2 and len(client.requests[1]["prev_actions"]) == 2
    assert actions == [H_, H_, H_, 10, 11, 12, 13, 14, 15, H_, 22, 23]


def test_a_hold_is_zero_velocity_with_the_gripper_as_last_commanded():
    ex = Executor(FakeClient(horizon=5), "async", 4, 3, rest=np.array([0.0, 0.5]))
    ticks = [ex.step(dict) for _ in range(11)]
    np.testing.assert_array_equal(ticks[0].action, [0.0, 0.5])  # the rest's gripper before any chunk
    # Chunk 1 runs out after index 4 (tick 7); ticks 8 and 9 hold its gripper; the answer starts at index 1.
    assert [t.chunk for t in ticks] == [None, None, None, 1, 1, 1, 1, 1, None, None, 2]
    np.testing.assert_array_equal(ticks[8].action, [0.0, 1.0])
    assert ticks[10].index == 1


def _before(client, replan: int, steps: int) -> list[np.ndarray]:
    """The closed loop as it ran before execution modes: execute replan actions of a chunk, then ask and wait."""
    plan, out = [], []
    for k in range(steps):
        if not plan:
            plan = list(np.asarray(client.infer({"tick": k})["actions"])[:replan])
        out.append(plan.pop(0))
    return out


@pytest.mark.parametrize("replan", [1, 3, 4, 8])
def test_sync_without_delay_is_the_closed_loop_as_before(replan):
    before, now = FakeClient(), FakeClient()
    want = _before(before, replan, 30)
    ex = Executor(now, "sync", replan, 0)
    got = [ex.step(lambda: {"tick": ex.tick}) for _ in range(30)]
    np.testing.assert_array_equal([t.action for t in got], want)
    assert [r["tick"] for r in now.requests] == [r["tick"] for r in before.requests]
    assert all(t.chunk is not None for t in got)


def test_a_measured_delay_is_the_calls_wall_time_at_the_control_rate_rounded_up():
    clock = [0.0]
    client = FakeClient(clock=clock, call_s=0.19)  # 0.19 s at 15 Hz: 2.85 ticks -> 3
    actions, client, sent = run("rtc", "measured", 16, client=client, control_hz=15.0, clock=lambda: clock[0])
    assert (actions, sent) == EXPECTED[("async", 3)]
    assert client.requests[1]["delay"] == 3  # the delay last measured


def test_threaded_executor_keeps_executing_until_the_answer_arrives():
    gates, done = [threading.Event(), threading.Event()], []

    class Gated(FakeClient):
        def infer(self, obs):
            gates[len(self.requests)].wait(10)  # request n waits for gate n
            out = super().infer(obs)
            done.append(len(self.requests))
            return out

    def answered(n):
        while len(done) < n:
            time.sleep(0.01)

    ex = ThreadedExecutor(Gated(), "rtc", 4, rest=np.zeros(2))
    try:
        ticks = [ex.step(dict)]  # tick 0: asked, holding
        gates[0].set()
        answered(1)
        # Ticks 1-5: chunk 1 from index 0 (the answer seen 1 tick after asking); the second request goes out at
        # index 4 (tick 5) and indices 4-6 run while it is outstanding.
        ticks += [ex.step(dict) for _ in range(7)]
        gates[1].set()
        answered(2)
        ticks.append(ex.step(dict))  # tick 8: 3 ticks after asking, chunk 2 from index 3
    finally:
        ex.close()
    assert [(t.chunk, t.index) for t in ticks] == [(None, None), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
                                                   (1, 6), (2, 3)]
    assert ex.client.requests[1]["delay"] == 1 and ex.estimate == 3  # announced the last seen, then saw 3


def test_switch_metrics_separate_switches_within_chunks_and_holds():
    def t(a, chunk):
        return Tick(np.array([a, 0.0]), chunk, 0)

    ticks = [t(0, None), t(1, 1), t(2, 1), t(4, 1), t(10, 2), t(0, None), t(0, None), t(7, 3)]
    m = switch_metrics(ticks)
    # Switches: hold->1 (1), 1->2 (6), 2->hold (10), hold->3 (7); within: 1, 2; hold->hold: neither.
    assert (m["switches"], m["switch_jump_mean"], m["switch_jump_max"]) == (4, 6.0, 10.0)
    assert (m["within_steps"], m["within_jump_mean"], m["within_jump_max"]) == (2, 1.5, 2.0)
    assert m["hold_steps"] == 3


def test_bad_settings_are_one_line():
    with pytest.raises(ValueError, match=r"execution mode 'rtx' is not valid; choose one of \['sync', 'async', 'rtc'\]"):
        Executor(FakeClient(), "rtx")
    with pytest.raises(ValueError, match="delay=-1"):
        Executor(FakeClient(), "async", 4, -1)
    with pytest.raises(ValueError, match="rest=ACTION"):
        ThreadedExecutor(FakeClient(), "sync", 4)
    # The tick-based core holds zeros of the answer's width before its first chunk.
    np.testing.assert_array_equal(Executor(FakeClient(), "sync", 4, 2).step(dict).action, [0.0, 0.0])


def test_the_config_offers_the_executors_modes_and_refuses_others():
    from slurmvla.config.rollout import RolloutConfig

    assert RolloutConfig(execution="rtc", delay_steps=2).delay_steps == 2
    for mode in EXECUTION_MODES:
        RolloutConfig(execution=mode)
    with pytest.raises(ValueError, match=r"^rollout.execution='rtx' is not valid; choose one of \['sync', 'async', 'rtc'\]$"):
        RolloutConfig(execution="rtx")
    with pytest.raises(ValueError, match=r"^rollout.delay='wall' is not valid"):
        RolloutConfig(delay="wall")
    with pytest.raises(ValueError, match=r"^rollout.delay_steps=-1 is not valid; it must be >= 0$"):
        RolloutConfig(delay_steps=-1)


def test_the_executor_imports_without_torch():
    code = "import sys, slurmvla.inference.executor; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_closed_loops_replanning_defaults_to_half_the_chunk(caplog):
    """rollout.replan_steps null: half the chunk in every mode (4 of 8: what docs/benchmarks.md measured best);
    a number is kept, one above the policy's horizon replans every horizon with a warning naming both."""
    from slurmvla.config.rollout import RolloutConfig
    from slurmvla.inference.closed_loop import replan_of

    assert RolloutConfig().replan_steps is None
    assert [replan_of(RolloutConfig(execution=m), 8) for m in ("sync", "async", "rtc")] == [4, 4, 4]
    assert [replan_of(RolloutConfig(execution=m), 1) for m in ("sync", "async", "rtc")] == [1, 1, 1]
    assert replan_of(RolloutConfig(execution="rtc", replan_steps=3), 10) == 3
    assert replan_of(RolloutConfig(replan_steps=12), 10) == 10
    assert "rollout.replan_steps=12 is more than the policy's action_horizon=10" in caplog.text
    # A server that does not say its horizon: the number given, or every step, with a warning.
    assert replan_of(RolloutConfig(replan_steps=5), None) == 5
    assert replan_of(RolloutConfig(execution="async"), None) == 1
    assert "gives no action_horizon: replanning every step" in caplog.text
    with pytest.raises(ValueError, match="rollout.replan_steps"):
        RolloutConfig(replan_steps=0)
