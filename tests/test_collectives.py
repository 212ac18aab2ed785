"""Rank-uniform decisions over real gloo process groups (ranks from a fork server, under a deadline)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmvla.collectives import agree, check_same_fields
from slurmvla.config import OptimConfig
from slurmvla.engine.precision import MasterWeightOptimizer, check_fp32_master_state
from slurmvla.optim import build_adamw
from slurmvla.policy import build_policy
from slurmvla.policy.flow_vla.config import FlowVLAConfig

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank)
    except Exception as e:  # reported to the test, which asserts on it
        result = f"{type(e).__name__}: {e}"
    torch.save(result, f"{out_dir}/{rank}.pt")
    # Without a barrier gloo ranks that leave early sometimes abort at exit.
    dist.barrier()
    dist.destroy_process_group()


# The ranks start from a fork server (one clean, single-threaded process per test process that imported torch and
# the test modules once): a fresh interpreter per rank spent ~3.5 CPU-seconds importing them, more than most of
# these tests compute; forking the test process itself would copy its threads' held locks.
PRELOAD = ["torch", "torch.distributed", "tests.test_collectives", "tests.test_validation"]


def run_spawned(fn, world: int, tmp_path, deadline_s: float = 60.0) -> list:
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts, the first call
    ctx = mp.start_processes(_worker, args=(world, _free_port(), fn, str(tmp_path)), nprocs=world, join=False,
                             start_method="forkserver")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ranks did not finish within {deadline_s}s (a hang)")
    return [torch.load(f"{tmp_path}/{r}.pt", weights_only=False) for r in range(world)]


def _flags(rank):
    return agree({"text": rank == 1, "subgoal": False}, fields=["images", "state"])


def _mismatch(rank):
    fields = ["images", "state"] + (["subgoal_images"] if rank == 0 else [])
    return agree({"text": True}, fields=fields)


def test_flags_are_ored_across_ranks_in_one_call(tmp_path):
    assert run_spawned(_flags, 2, tmp_path) == [{"subgoal": False, "text": True}] * 2


def test_a_field_on_some_ranks_only_is_an_error_not_a_hang(tmp_path):
    results = run_spawned(_mismatch, 3, tmp_path)
    for r in results:
        assert r.startswith("RuntimeError") and "'subgoal_images' only on ranks [0]" in r


def _first_batch_fields(rank):
    """The trainer's first-batch check: rank 0's batch has instruction tokens, rank 1's none at all."""
    check_same_fields(["images", "state", "actions"] + (["text", "text_mask"] if rank == 0 else []))
    return "no error"


def _same_fields(rank):
    check_same_fields(["images", "state"])
    return "no error"


def test_a_field_on_some_ranks_stops_every_rank_with_the_same_value_error(tmp_path):
    """Models read the fields they were built for without a collective; the trainer checks the first
    batch's fields across ranks before the first forward: a clear error on every rank, not a hang."""
    results = run_spawned(_first_batch_fields, 2, tmp_path)
    assert results[0] == results[1] and results[0].startswith("ValueError: batch fields differ between ranks"), results
    assert "'text' only on ranks [0]" in results[0] and "'text_mask' only on ranks [0]" in results[0]
    assert run_spawned(_same_fields, 2, tmp_path) == ["no error"] * 2


def test_single_process_needs_no_group():
    assert agree({"a": True, "b": False}, fields=["x"]) == {"a": True, "b": False}


def test_negative_control_bf16_model_with_plain_adamw_is_detected():
    """The broken recipe (cast to bf16, then torch.optim.AdamW) fails the check the trainer runs."""
    torch.manual_seed(0)
    from tests.policy.test_policy import make_batch

    policy = build_policy(FlowVLAConfig()).to(torch.bfloat16)
    groups = policy.param_groups(0.01, 1e-3)
    broken = build_adamw(groups, OptimConfig(), torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        policy(make_batch())["loss"].backward()
    broken.step()
    with pytest.raises(RuntimeError, match="bfloat16 parameter"):
        check_fp32_master_state(broken)
    # The master-weight optimizer over the same bf16 model passes the same check.
    fixed = MasterWeightOptimizer(policy.param_groups(0.01, 1e-3), lambda g: build_adamw(g, OptimConfig(), torch.device("cpu")))
    fixed.step()
    check_fp32_master_state(fixed)
    # Moments alone in bf16 are caught too.
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p])
    opt.state[p] = {"exp_avg": torch.zeros(3, dtype=torch.bfloat16)}
    with pytest.raises(RuntimeError, match="exp_avg.*bfloat16"):
        check_fp32_master_state(opt)


def test_no_process_group_outlives_destroy_process_group():
    """The cause of a rare SIGABRT at exit ("terminate called without an active exception"): a group
    kept alive by a module global past destroy_process_group is torn down during interpreter
    shutdown, where gloo's threads can abort the process. After destroy, nothing of ours holds it."""
    import gc
    import weakref

    from slurmvla import collectives

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        world = weakref.ref(dist.group.WORLD)
        collectives._control_group()
        assert collectives._control is not None
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert world() is None, "a process group outlived destroy_process_group"
