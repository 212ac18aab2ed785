"""The latency-tail report of benchmarks/jitter.py (``sample_latency.py --jitter``): its attribution of the slowest
calls against hand-computed figures, its collector watch, and its timing wrappers on a real runner (the same
actions, every stage accounted, the runner restored)."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.inference.load import Loaded
from slurmvla.inference.runner import PolicyRunner
from slurmvla.policy import build_policy

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def jitter():
    spec = importlib.util.spec_from_file_location("jitter", BENCHMARKS / "jitter.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["jitter"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("jitter", None)


def synthetic(jitter, n: int = 200):
    """``n`` calls of preprocess 1 ms, h2d 0.5, launch 10, sync 4.5 (16 ms in all); call 17's launch 8 ms longer
    with a generation-2 collector pass of 7.5 ms in it; call 150's preprocess 4 ms longer, no pass; call 60 has a
    generation-0 pass but is not slow."""
    rec = jitter.Records.empty(n)
    S = {name: i for i, name in enumerate(jitter.STAGES)}
    rec.stages[:, S["preprocess"]] = 1.0
    rec.stages[:, S["h2d"]] = 0.5
    rec.stages[:, S["launch"]] = 10.0
    rec.stages[:, S["sync"]] = 4.5
    rec.stages[17, S["launch"]] += 8.0
    rec.stages[150, S["preprocess"]] += 4.0
    rec.total[:] = rec.stages.sum(axis=1)
    rec.gc_ms[17], rec.gc_gen[17] = 7.5, 2
    rec.gc_ms[60], rec.gc_gen[60] = 0.1, 0
    return rec


def test_slowest_calls_attributed_to_the_stage_that_grew_and_to_the_collector(jitter):
    rec = synthetic(jitter)
    w = jitter.slowest(rec)
    # 1 % of 200 calls: the 2 slowest, 24 ms (call 17) and 20 ms (call 150) against a median of 16.
    assert w["calls"] == 2 and w["index"] == [17, 150]
    assert w["stage_grew"] == {"launch": 1, "preprocess": 1}
    assert w["excess_ms"] == pytest.approx((8 + 4) / 2)
    assert w["stage_excess_ms"]["launch"] == pytest.approx(4.0) and w["stage_excess_ms"]["preprocess"] == pytest.approx(2.0)
    assert w["with_gc"] == 1 and w["with_gc_gen2"] == 1 and w["gc_ms"] == pytest.approx(7.5 / 2)
    assert w["with_alloc_retry"] == 0 and "device_excess_ms" not in w and "with_lower_clock" not in w


def test_summary_percentiles_by_hand(jitter):
    s = jitter.summary(synthetic(jitter))
    # Sorted totals: 198 x 16, 20, 24. p99 (linear): position 0.99 * 199 = 197.01, 16 + 0.01 * (20 - 16).
    assert s["total"] == pytest.approx({"p50": 16.0, "p99": 16.04, "max": 24.0})
    assert s["p99_over_p50"] == pytest.approx(16.04 / 16)
    # launch: 199 x 10 and one 18: p99 at 197.01 is 10, the max 18.
    assert s["stages"]["launch"] == pytest.approx({"p50": 10.0, "p99": 10.0, "max": 18.0})
    assert s["gc"]["calls_with_pass"] == 2 and s["gc"]["by_generation"] == {0: 1, 1: 0, 2: 1}


def test_verdict_names_the_variant_that_removes_the_tail(jitter):
    assert jitter.verdict({"full": 1.6, "nogc": 1.05, "act": 1.5, "replay": 1.04}).startswith("Python's garbage collector")
    assert jitter.verdict({"full": 1.6, "nogc": 1.5, "act": 1.1, "replay": 1.04}).startswith("the host preprocessing")
    assert jitter.verdict({"full": 1.6, "nogc": 1.5, "act": 1.5, "replay": 1.04}).startswith("the runner's per-call")
    assert jitter.verdict({"full": 1.6, "nogc": 1.5, "act": 1.5, "replay": 1.5}).startswith("the sampler itself")
    assert jitter.verdict({"full": 1.1, "replay": 1.5}).startswith("p99/p50 1.10 <= 1.15")


def test_collector_pass_counted_in_the_call_it_runs_in(jitter):
    """A pass inside a call is that call's (with its generation); one between calls is counted apart."""
    clock = jitter.StageClock()
    enabled = gc.isenabled()
    gc.disable()  # only the passes asked for below
    try:
        with jitter.GcWatch(clock) as watch:
            gc.collect(0)  # between calls
            watch.reset()
            clock.begin()
            gc.collect(1)
            clock.end()
            assert watch.top == 1 and watch.count == 1 and watch.ms > 0 and watch.outside == 1
        assert watch not in gc.callbacks
    finally:
        if enabled:
            gc.enable()


def test_stage_clock_charges_the_innermost_stage(jitter, monkeypatch):
    now = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0])
    monkeypatch.setattr(jitter.time, "perf_counter", lambda: next(now))
    c = jitter.StageClock()
    c.begin()               # 0: other
    c.push(jitter.H2D)      # 1: other += 1
    c.push(jitter.LAUNCH)   # 3: h2d += 2
    c.pop()                 # 6: launch += 3
    c.switch(jitter.SYNC)   # 10: h2d += 4, h2d becomes sync
    c.pop()                 # 15: sync += 5
    c.end()                 # 21: other += 6
    assert c.acc[jitter.OTHER] == 7 and c.acc[jitter.H2D] == 6 and c.acc[jitter.LAUNCH] == 3 and c.acc[jitter.SYNC] == 5


@pytest.mark.parametrize("policy", ["tiny", "pi05_tiny"])
def test_instrumented_runner_gives_the_same_actions_and_accounts_every_stage(jitter, policy):
    cameras = "observation/exterior_image_1_left,observation/exterior_image_2_left,observation/wrist_image_left"
    cfg = compose([f"policy={policy}", f"serve.cameras=[{cameras}]", "serve.seed=0", "policy.num_inference_steps=2"])
    torch.manual_seed(0)
    runner = PolicyRunner(Loaded(build_policy(cfg.policy).eval(), cfg, 0, "test"))
    g = np.random.default_rng(0)
    obs = {k: g.integers(0, 256, (180, 320, 3), dtype=np.uint8) for k in cameras.split(",")}
    obs |= {"observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
            "prompt": "put the marker in the cup"}
    plain = runner.infer(obs)["actions"]
    clock = jitter.StageClock()
    with jitter.Instrumented(runner, clock, cuda=False) as inst:
        assert np.array_equal(runner.infer(obs)["actions"], plain)
        session = runner.session()
        rec = jitter.measure(lambda: session.infer(obs), 4, clock, False, inst, warmup=1)
    np.testing.assert_allclose(rec.stages.sum(axis=1), rec.total)
    for stage in ("preprocess", "prompt", "h2d", "launch", "sync", "post"):
        assert (rec.stages[:, jitter.STAGES.index(stage)] > 0).all(), stage
    # The wrappers are gone: the runner, its policy and its spec are as they were.
    assert not {"read", "read_rtc", "batch", "act", "absolute"} & set(vars(runner))
    assert not {"sample_actions", "_text"} & set(vars(runner.policy)) and runner.spec == type(runner.policy).sample_spec(cfg.policy)
    assert np.array_equal(runner.infer(obs)["actions"], plain)


def test_sm_clock_reads_nothing_without_a_gpu(jitter):
    """No NVML and no GPU (this CPU): no source, a reason, and reads that give nothing rather than fail."""
    if torch.cuda.is_available():
        pytest.skip("a GPU: the clock may be readable")
    sm = jitter.SmClock(torch.device("cpu"))
    assert sm.source is None and sm.why and sm.read() == (None, -1)
