"""Runs several trainings in one torchrun job (one process group), for the distributed tests.

    torchrun --standalone --nproc_per_node=N tests/dist_driver.py SPEC.json
    python tests/dist_driver.py SPEC.json    # one plain process: no process group (tests/test_gpu.py's resume)

SPEC: {"out": DIR, "base": [overrides...], "runs": [{"name", "overrides", "dir", "stop_at"}...]} (a run's folder:
OUT/<dir>, by default OUT/<name>; "stop_at": the step its fit stops at).
A run may start from an earlier run's checkpoint: "start_from": [RUN DIR, STEP] copies that checkpoint into
its own folder first (rank 0, then a barrier), so it resumes from there.
A run may also say "kill_before_commit": STEP (fault injection): the moment rank 0 is about to commit
checkpoint STEP (every rank's part written, nothing renamed yet) the whole job is SIGKILLed, torchrun
included, as a lost node or ``scancel --signal=KILL`` would; put it in a job's last run.
For each run, rank 0 writes OUT/<name>.safetensors (the full fp32 weights, gathered through the
engine), OUT/<name>.ema.safetensors (their moving average, with trainer.ema_decay) and OUT/<name>.json (optimizer parameter and state dtypes, the last metrics).
Starting processes and importing torch / DeepSpeed costs more than a tiny training, hence one job. Rank 0
composes each run's config and sends it to the others (what every rank of a job gets alike), so the
composition is paid once a job, not once a rank; a plain process (no process group) composes for itself.
"""

from __future__ import annotations

import gc

# The collector off while torch, DeepSpeed and transformers import (a full collection walks all they make, again
# and again as it grows); main() freezes what they left and turns it back on (slurmvla.garbage_collector measures it).
gc.disable()

# ruff: noqa: E402 (the imports after it, on purpose)
import copy
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from slurmvla.compose import compose
from slurmvla.engine.distributed import init_process_group
from slurmvla.launch import DistEnv
from slurmvla.trainer import Trainer


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    # What the imports left is never garbage: frozen, the collection after each run skips it (a full
    # collection over torch, DeepSpeed and transformers costs about 0.3 s a run, a tenth of a tiny run).
    # This process's own freeze, not slurmvla.garbage_collector.paused(): each run's close thaws what the collector
    # froze, and this freeze must outlast every run of the job.
    gc.collect()
    gc.freeze()
    gc.enable()
    env = DistEnv.from_environ()
    init_process_group(env, torch.device("cpu"), "gloo", 600)  # the trainers find it and keep it
    configs: dict[tuple[str, ...], object] = {}  # runs that differ only in where they stop compose alike
    for run in spec["runs"]:
        rank0 = env.rank == 0
        if rank0:
            print(f"dist_driver: run {run['name']}", flush=True)  # a failed job's log names its run
        overrides = (*spec["base"], *run.get("overrides", []))
        if overrides not in configs:
            configs[overrides] = composed_on_rank0(list(overrides), rank0)
        run_dir = out / run.get("dir", run["name"])
        if "start_from" in run:
            source, step = run["start_from"]
            if rank0:
                shutil.copytree(out / source / "checkpoints" / f"step_{step:08d}",
                                run_dir / "checkpoints" / f"step_{step:08d}")
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
        trainer = Trainer(copy.deepcopy(configs[overrides]), run_dir)
        if "kill_before_commit" in run:
            kill_before_commit(trainer, run["kill_before_commit"])
        try:
            metrics = trainer.fit(stop_at=run.get("stop_at"))
            weights = trainer.engine.model_state_dict()
            ema = trainer.ema.state_dict() if trainer.ema is not None else None  # a collective, like the weights
            dtypes = sorted({str(p.dtype) for g in trainer.optimizer.param_groups for p in g["params"]})
            state = sorted({f"{k}:{v.dtype}" for s in trainer.optimizer.state.values() for k, v in s.items()
                            if torch.is_tensor(v)})
        except BaseException:
            trainer.close(failed=True)
            raise
        if trainer.env.is_main:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(out / f"{run['name']}.safetensors"))
            if ema is not None:
                save_file({k: v.contiguous() for k, v in ema.items()}, str(out / f"{run['name']}.ema.safetensors"))
            report = {"engine": type(trainer.engine).__name__ + ":" + trainer.engine.name,
                      "param_dtypes": dtypes, "state_dtypes": state, "metrics": metrics, "step": trainer.step,
                      "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None}
            (out / f"{run['name']}.json").write_text(json.dumps(report))
        trainer.close(keep_process_group=True)
        # The engine's wrappers hold the process group: they go before it does. What survives the
        # collection (compiled caches, the configs) is frozen too, so that the next run's collection
        # reads only that run's objects.
        del trainer
        gc.collect()
        gc.freeze()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def composed_on_rank0(overrides: list[str], rank0: bool):
    """Rank 0's composition, on every rank; an error composing is raised on every rank (none waits). A plain
    process (``python tests/dist_driver.py``: one rank, no process group to broadcast over) is rank 0 alone."""
    if not torch.distributed.is_initialized():
        return compose(overrides)
    box: list = [None]
    if rank0:
        try:
            box = [compose(overrides)]
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, raised below on every rank
            box = [e]
    torch.distributed.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def kill_before_commit(trainer: Trainer, step: int) -> None:
    """SIGKILL the job (torchrun, every rank, this one last) when rank 0 is about to commit ``step``."""
    commit = trainer.checkpoints._commit

    def killing_commit(tmp: Path, *args, **kwargs):
        if tmp.name == f".step_{step:08d}.tmp":
            import psutil

            agent = psutil.Process(os.getppid())
            for proc in agent.children(recursive=True):
                if proc.pid != os.getpid():
                    proc.kill()
            agent.kill()
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(tmp, *args, **kwargs)

    trainer.checkpoints._commit = killing_commit


if __name__ == "__main__":
    main()
