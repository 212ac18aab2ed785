"""Rank-uniform decisions over real gloo process groups (spawned, under a deadline)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slurmvla.collectives import agree
from slurmvla.config import OptimConfig, PolicyConfig
from slurmvla.engine.precision import MasterWeightOptimizer, check_fp32_master_state
from slurmvla.optim import build_adamw
from slurmvla.policy import build_policy

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


def run_spawned(fn, world: int, tmp_path, deadline_s: float = 60.0) -> list:
    ctx = mp.start_processes(_worker, args=(world, _free_port(), fn, str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
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


def _policy_forward(rank):
    """Rank 0's batch has instruction tokens and rank 1's none at all: a clear error, not a hang.
    Both without them: both skip the text tower; both with them (rank 1's empty): both run it."""
    torch.manual_seed(0)
    cfg = PolicyConfig()
    policy = build_policy(cfg)
    from tests.test_policy import make_batch

    seen = []
    policy.text_embed.register_forward_hook(lambda *a: seen.append(True))
    out = {}
    batch = make_batch(2, cfg)
    no_text = {k: v for k, v in batch.items() if k not in ("text", "text_mask")}
    policy(no_text)
    out["none"] = len(seen)
    if rank == 1:
        batch["text_mask"][:, 2:] = False
    policy(batch)
    out["all"] = len(seen)
    try:
        policy(batch if rank == 0 else no_text)
    except RuntimeError as e:
        out["mixed"] = str(e)
    return out


def test_policy_agrees_on_optional_instruction_tokens(tmp_path):
    for r in run_spawned(_policy_forward, 2, tmp_path, deadline_s=120):
        assert r["none"] == 0 and r["all"] == 1
        assert "'text' only on ranks [0]" in r["mixed"] and "'text_mask' only on ranks [0]" in r["mixed"]


def test_single_process_needs_no_group():
    assert agree({"a": True, "b": False}, fields=["x"]) == {"a": True, "b": False}


def test_negative_control_bf16_model_with_plain_adamw_is_detected():
    """The broken recipe (cast to bf16, then torch.optim.AdamW) fails the check the trainer runs."""
    torch.manual_seed(0)
    from tests.test_policy import make_batch

    policy = build_policy(PolicyConfig()).to(torch.bfloat16)
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
