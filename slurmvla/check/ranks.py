"""One rank of a multi-rank policy check (``python -m slurmvla.check`` starts these under torchrun).

The spec names one or more modes, run in its order in the same processes (starting them and importing torch
and DeepSpeed costs more than a check). For each mode each rank writes ``<mode>.rank<N>.json`` into the spec's
folder: its figures, or ``{"error": ...}``. A rank that fails a mode runs none after it and leaves the process
group without a barrier, so the checker can stop its peers (and runs the modes left in a job of their own).

- ``fsdp``: every rank shards the policy with FSDP2 (``fsdp_full``) and runs its half of the batch;
  the averaged loss and the full gradients are compared with the unwrapped policy on the whole batch.
- ``zero3``: DeepSpeed ZeRO-3 builds the policy and takes one optimizer step on the halves.
- ``divergent``: as ``fsdp``, but every sample of rank 1's half has an empty instruction (the same fields,
  other values).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from slurmvla.check.subject import grads_rel, halves, rank_result_file, rel
from slurmvla.compose import compose
from slurmvla.config import OptimConfig
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.base import StepSettings
from slurmvla.engine.distributed import init_process_group
from slurmvla.launch import DistEnv
from slurmvla.policy import build_policy
from slurmvla.seeding import seed_everything


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def fsdp(policy: torch.nn.Module, batch: dict, env: DistEnv, empty_text: tuple | None = None) -> dict:
    """``empty_text``: the tokens of an empty instruction, which rank 1's half carries instead of its own
    (divergent mode: the same fields on every rank, as the trainer's first-batch check guarantees, but
    one rank's samples all without an instruction)."""
    from slurmvla.engine.fsdp import FSDPEngine

    reference = copy.deepcopy(policy)
    seed_everything(1)
    ref_loss = reference(batch)["loss"]
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    engine = FSDPEngine(EngineConfig(name="fsdp_full"), env, "fp32", torch.device("cpu"), StepSettings(1, 1, 0.0))
    engine.shard(policy)
    mine = halves(batch)[env.rank]
    if empty_text is not None and env.rank == 1:
        n = len(mine["text"])
        mine = {**mine, "text": empty_text[0].expand(n, -1).clone(), "text_mask": empty_text[1].expand(n, -1).clone()}
    seed_everything(1)
    loss = policy(mine)["loss"]
    loss.backward()
    # FSDP averages gradients over ranks: with a shard-invariant loss, the whole batch's gradients.
    grads = {n: _full(p.grad) for n, p in policy.named_parameters() if p.grad is not None}
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= env.world_size
    return {"ok": True, "loss_rel": rel(mean_loss, ref_loss), "grad_rel": grads_rel(grads, ref_grads)}


def zero3(policy: torch.nn.Module, batch: dict, env: DistEnv) -> dict:
    from slurmvla.engine.zero import DeepSpeedEngine

    mine = halves(batch)[env.rank]
    reference = copy.deepcopy(policy)
    seed_everything(1)
    ref_loss = reference(mine)["loss"].detach()
    engine = DeepSpeedEngine(EngineConfig(name="zero3"), env, "fp32", torch.device("cpu"),
                             StepSettings(len(mine["actions"]), 1, 1.0), stage=3,
                             # Every parameter partitioned and released after its module's forward, as a
                             # large model's are: DeepSpeed keeps a small model's whole by default, which
                             # would hide the bugs this check is for.
                             zero_options={"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
                                           "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0})
    model, _ = engine.prepare(policy, OptimConfig(lr=1e-3))
    before = engine.model_state_dict()
    seed_everything(1)
    loss = model(mine)["loss"]
    engine.backward(loss)
    engine.clip_grad_norm()
    engine.step()
    after = engine.model_state_dict()
    change = max(float((after[k] - before[k]).abs().max()) for k in before if before[k].is_floating_point())
    return {"ok": bool(torch.isfinite(loss)), "loss": float(loss), "loss_rel": rel(loss.detach(), ref_loss),
            "changed": change > 0, "max_change": change}


def run_mode(mode: str, cfg, inputs: dict, env: DistEnv) -> dict:
    seed_everything(0)
    policy = build_policy(cfg.policy, inputs["stats"])
    policy.train()
    if mode == "zero3":
        return zero3(policy, inputs["batch"], env)
    empty = type(policy).sample_spec(cfg.policy).tokenizer("") if mode == "divergent" else None
    return fsdp(policy, inputs["batch"], env, empty_text=empty)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    env = DistEnv.from_environ()
    failed, mode = False, spec["modes"][0]
    try:
        init_process_group(env, torch.device("cpu"), "gloo", spec["timeout_s"])
        cfg = compose(spec["overrides"])
        inputs = torch.load(spec["inputs"], weights_only=True)
        for i, mode in enumerate(spec["modes"]):
            if i and not _peers_done(out, spec["modes"][i - 1], env):
                failed = True  # a peer failed there: the checker runs this mode in a job of its own
                break
            _write(out, mode, env.rank, run_mode(mode, cfg, inputs, env))
    except Exception as e:
        failed = True
        last = traceback.extract_tb(e.__traceback__)[-1]
        _write(out, mode, env.rank, {"error": f"{type(e).__name__}: {e} (at {Path(last.filename).name}:{last.lineno})"})
    if dist.is_initialized():
        if not failed:
            dist.barrier()
        dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def _peers_done(out: Path, mode: str, env: DistEnv) -> bool:
    """Whether every rank finished ``mode`` without an error, waited for through the result files, not a
    collective: a rank left in one of the mode's collectives (the hang a check looks for) would otherwise pair
    it with the next mode's. A peer that never finishes is the checker's to end, at its deadline."""
    files = [rank_result_file(out, mode, r) for r in range(env.world_size)]
    while not all(f.is_file() for f in files):
        time.sleep(0.05)
    return not any("error" in json.loads(f.read_text()) for f in files)


def _write(out: Path, mode: str, rank: int, result: dict) -> None:
    final = rank_result_file(out, mode, rank)
    final.with_suffix(".tmp").write_text(json.dumps(result))
    final.with_suffix(".tmp").rename(final)


if __name__ == "__main__":
    main(sys.argv[1])
