"""Records the collectives of one steady-state training step per engine, in one torchrun job.

    torchrun --standalone --nproc_per_node=N tests/planner/comm_driver.py SPEC.json

SPEC: {"out": DIR, "cases": [{"name", "engine", "precision", "overrides": [...], "options": {...},
"ddp_bucket_cap_mb": X, "record": K}...]}. Each case composes its config (the reference policy unless the
overrides say otherwise; global batch = the world, so a micro-batch of 1), builds the policy and the engine
as the trainer does (``options``: over the registry entry's, e.g. ``zero_options``; ``ddp_bucket_cap_mb``: DDP
built with that ``bucket_cap_mb``), and makes K optimizer steps on one fake batch as ``Trainer.train_step``
makes them (forward under the engine's autocast, backward, clip, step); the K-th is recorded
(tests/planner/comm_recorder.py), its phases labelled. Every rank writes OUT/<case>.rank<R>.json. No data
set is read: the collectives do not depend on the batch's values. Importing torch and DeepSpeed costs more
than a case, hence one job for all.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from slurmvla.compose import compose
from slurmvla.engine.base import StepSettings
from slurmvla.engine.distributed import init_process_group
from slurmvla.launch import DistEnv
from slurmvla.planner.activations import fake_batch
from slurmvla.policy import build_policy
from slurmvla.registry import ENGINES
from slurmvla.seeding import seed_everything

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.planner.comm_recorder import CollectiveRecorder  # noqa: E402


def run_case(case: dict, env: DistEnv, out: Path) -> None:
    import slurmvla.engine.ddp as ddp_module

    world = env.world_size
    overrides = case.get("overrides", [])
    batch = [] if any(o.startswith("trainer.global_batch_size=") for o in overrides) else \
        [f"trainer.global_batch_size={world}"]
    cfg = compose([f"engine={case['engine']}", f"precision={case.get('precision', 'fp32')}", *batch,
                   "logging.wandb.mode=disabled", *overrides])
    entry = ENGINES.get(cfg.engine.name)
    seed_everything(0)
    policy = build_policy(cfg.policy, None, on_meta=entry.deferred_init)
    micro = cfg.trainer.micro_batch_size(world)
    settings = StepSettings(micro, cfg.trainer.grad_accum_steps, cfg.trainer.max_grad_norm)
    original_ddp = ddp_module.DistributedDataParallel
    if case.get("ddp_bucket_cap_mb") is not None:
        ddp_module.DistributedDataParallel = functools.partial(original_ddp, bucket_cap_mb=case["ddp_bucket_cap_mb"])
    try:
        engine = entry.load()(cfg.engine, env, cfg.precision, torch.device("cpu"), settings,
                              **{**entry.options, **case.get("options", {})})
        model, _ = engine.prepare(policy, cfg.optim)
    finally:
        ddp_module.DistributedDataParallel = original_ddp
    sample = fake_batch(cfg, policy, micro, (64, 64))
    rec = CollectiveRecorder()
    record = case.get("record", 3)
    accum = cfg.trainer.grad_accum_steps
    for step in range(1, record + 1):
        if step == record:
            rec.__enter__()
        try:
            for i in range(accum):  # as Trainer.train_step: no_sync around every micro-batch but the last
                with contextlib.nullcontext() if i == accum - 1 else engine.no_sync():
                    rec.phase = "forward"
                    with engine.autocast():
                        loss = model(dict(sample))["loss"]
                    rec.phase = "backward"
                    engine.backward(loss / accum)
            rec.phase = "clip"
            engine.clip_grad_norm()
            rec.phase = "step"
            engine.step()
        finally:
            if step == record:
                rec.__exit__(None, None, None)
    (out / f"{case['name']}.rank{env.rank}.json").write_text(json.dumps(rec.records))
    del engine, model, policy
    dist.barrier()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    env = DistEnv.from_environ()
    init_process_group(env, torch.device("cpu"), "gloo", 600)
    for case in spec["cases"]:
        if env.rank == 0:
            print(f"comm_driver: case {case['name']}", flush=True)
        run_case(case, env, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
