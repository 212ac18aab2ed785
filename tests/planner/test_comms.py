"""The communication the plan counts is what a training step issues, collective for collective.

Each engine runs under torchrun (gloo, CPU) at world 2 and 4 on the reference policy at tiny size
(tests/planner/comm_driver.py: one job per world size, case after case); the third optimizer step of each case is
recorded (tests/planner/comm_recorder.py: every c10d collective through torch's dispatcher, DTensor's functional
ones included) and must equal :func:`slurmvla.planner.comms.step_collectives`'s list as a multiset of (phase,
kind, group size, dtype, bytes), exactly; every rank must issue the same list. Step 3: DDP's first step
all-reduces one bucket and its second broadcasts the rebuilt bucket order (``first_steps``); ZeRO-3 traces its
modules in the first.

Beyond the engines' defaults, cases whose options make the bucketing show: DDP with 0.1 MiB buckets (the
rebuilt order of ready gradients), ZeRO-1 / 2 with 50,000-element gradient buckets (group order; ready order),
ZeRO-3 with nothing persistent and small prefetch buckets (the coordinator's prefetch) or none and nothing kept for
backward (every module gathered again in backward), a frozen backbone
(FSDP's reduce-scatters skip frozen parameters; DDP's buckets hold trainable ones), gradient accumulation (FSDP
and ZeRO-3 gather per micro-batch, ZeRO-2 reduces per micro-batch), a 7-dimensional action (odd sizes: FSDP's
and DeepSpeed's padding) and hsdp as 2 x 2.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from slurmvla.compose import compose
from slurmvla.planner.comms import CommOptions, layout_of, step_collectives

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
DRIVER = Path(__file__).with_name("comm_driver.py")
SMALL_ZERO = {"reduce_bucket_size": 50_000}
ZERO3_GATHER = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 40_000,
                "reduce_bucket_size": 50_000}
ODD = ["policy.action_dim=7"]
# Nothing persistent, nothing prefetched, nothing kept for backward: every module gathered in forward and again in
# backward (the ZeRO paper's 1.5x; test_scaling.py).
ZERO3_REGATHER = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0,
                  "stage3_max_reuse_distance": 0}

# name -> (engine, precision, overrides, options for the engine, DDP bucket_cap_mb)
CASES_TWO = {
    "ddp.fp32": ("ddp", "fp32", [], {}, None),
    "ddp.bf16.small-buckets": ("ddp", "bf16", [], {}, 0.1),
    "ddp.bf16.frozen.small-buckets": ("ddp", "bf16", ["policy.train_expert_only=true"], {}, 0.1),
    "fsdp_full.bf16": ("fsdp_full", "bf16", [], {}, None),
    "fsdp_full.bf16.frozen.accum": ("fsdp_full", "bf16", ["policy.train_expert_only=true",
                                                          "trainer.grad_accum_steps=2"], {}, None),
    "fsdp_grad_op.fp32.odd": ("fsdp_grad_op", "fp32", ODD, {}, None),
    "hsdp.bf16": ("hsdp", "bf16", [], {}, None),
    "zero1.bf16.small-buckets": ("zero1", "bf16", ODD, {"zero_options": SMALL_ZERO}, None),
    "zero2.fp32.small-buckets.accum": ("zero2", "fp32", ["trainer.grad_accum_steps=2"],
                                       {"zero_options": SMALL_ZERO}, None),
    "zero3.bf16": ("zero3", "bf16", [], {}, None),
    "zero3.bf16.gather.accum": ("zero3", "bf16", ["trainer.grad_accum_steps=2"],
                                {"zero_options": ZERO3_GATHER}, None),
    "zero3.fp32.regather": ("zero3", "fp32", [], {"zero_options": ZERO3_REGATHER}, None),
}
CASES_FOUR = {
    "ddp.bf16": ("ddp", "bf16", [], {}, None),
    "fsdp_full.bf16.odd": ("fsdp_full", "bf16", ODD, {}, None),
    "fsdp_grad_op.bf16": ("fsdp_grad_op", "bf16", [], {}, None),
    "hsdp.bf16.2x2": ("hsdp", "bf16", ["engine.replicate_degree=2", "engine.shard_degree=2"], {}, None),
    "zero1.bf16": ("zero1", "bf16", [], {}, None),
    "zero2.bf16.odd": ("zero2", "bf16", ODD, {}, None),
    "zero3.fp32.odd": ("zero3", "fp32", ODD, {}, None),
    "zero3.bf16.gather": ("zero3", "bf16", [], {"zero_options": ZERO3_GATHER}, None),
}
WORLDS = {2: CASES_TWO, 4: CASES_FOUR}
RECORD_STEP = 3


def _cfg(world: int, case: tuple):
    engine, precision, overrides, _, _ = case
    return compose([f"engine={engine}", f"precision={precision}", f"trainer.global_batch_size={world * 2}",
                    *overrides])


_LAYOUTS: dict[tuple, object] = {}


def planned(world: int, case: tuple) -> Counter:
    """The plan's list. The layout's pass runs with the CPU's autocast lists, as the recorded run does (they decide
    which of a norm's weight and bias has its gradient first, and so where DDP's and DeepSpeed's buckets are cut)."""
    _, precision, overrides, options, bucket_mb = case
    cfg = _cfg(world, case)
    key = (precision, *(o for o in overrides if o.startswith("policy.")))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = layout_of(cfg, autocast="cpu")
    plan = step_collectives(cfg, _LAYOUTS[key], world, world,
                            CommOptions(ddp_bucket_cap_mb=bucket_mb, zero=options.get("zero_options", {})))
    return Counter(c.key() for c in plan)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One torchrun job per world size, every case of it; the records by (world, case) -> per-rank lists."""
    jobs: dict[int, Path | str] = {}

    def get(world: int) -> Path:
        if world not in jobs:
            out = tmp_path_factory.mktemp(f"comms{world}")
            cases = [{"name": n, "engine": c[0], "precision": c[1], "record": RECORD_STEP,
                      "overrides": [f"trainer.global_batch_size={world * 2}", *c[2]], "options": c[3],
                      "ddp_bucket_cap_mb": c[4]}
                     # DeepSpeed's engines last: nothing it sets up may be what the others find.
                     for n, c in sorted(WORLDS[world].items(), key=lambda kv: kv[1][0].startswith("zero"))]
            (out / "spec.json").write_text(json.dumps({"out": str(out), "cases": cases}))
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc_per_node={world}", str(DRIVER), str(out / "spec.json")],
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                log, _ = proc.communicate(timeout=420)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                log, _ = proc.communicate()
            jobs[world] = out if proc.returncode == 0 else f"the world-{world} job failed:\n{log[-5000:]}"
            print(f"comms job, world {world}: {time.perf_counter() - t0:.1f} s")
        if isinstance(jobs[world], str):
            pytest.fail(jobs[world], pytrace=False)
        return jobs[world]

    return get


def _records(out: Path, name: str, world: int) -> list[list[tuple]]:
    ranks = []
    for r in range(world):
        rows = json.loads((out / f"{name}.rank{r}.json").read_text())
        ranks.append([(x["phase"], x["kind"], x["group"], x["dtype"], x["bytes"]) for x in rows])
    return ranks


CELLS = [(w, n) for w, cases in WORLDS.items() for n in cases]


@pytest.mark.parametrize(("world", "name"), CELLS, ids=[f"world{w}-{n}" for w, n in CELLS])
def test_step_collectives_are_exactly_what_the_engine_issues(world, name, recorded):
    case = WORLDS[world][name]
    ranks = _records(recorded(world), name, world)
    assert all(r == ranks[0] for r in ranks), f"ranks issued different collectives: {ranks}"
    got, want = Counter(ranks[0]), planned(world, case)
    missing, extra = want - got, got - want
    print(f"comms {name} world {world}: {sum(got.values())} collectives, {sum(b * n for (*_, b), n in got.items())} "
          f"bytes; planned {sum(want.values())}, {sum(b * n for (*_, b), n in want.items())}")
    assert not missing and not extra, (f"planned but not issued: {sorted(missing.items())}\n"
                                       f"issued but not planned: {sorted(extra.items())}")
