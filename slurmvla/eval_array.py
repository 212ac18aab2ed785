"""A checkpoint's closed loop as a SLURM job array, off the training job (``rollout_array.enabled=true``).

    python -m slurmvla.eval_array element CHECKPOINT --shards N --out STEP_DIR [--index I] [overrides ...]
    python -m slurmvla.eval_array gather RUN_DIR [--wait SECONDS] [--resubmit]

``element`` is what each element of an evaluation array runs (the trainer submits ``sbatch --array=0-(N-1)
--requeue --wrap "python -m slurmvla.eval_array element ..."``): shard I (``--index``, default the element's
``SLURM_ARRAY_TASK_ID``) of the run's ``rollout.*`` episodes, through ``python -m slurmvla.rollout CHECKPOINT --shard
I/N``, its summary renamed into ``STEP_DIR/rollout_shardIofN.json`` once whole. A shard already there is not run again
(a requeued element, a rerun); the element that completes the set merges them into ``STEP_DIR/rollout.json``.

``gather`` is the trainer's gathering, for a run no trainer holds any more (training ended before its last arrays, or
was stopped): every evaluation whose shards are all there is merged and logged at its step (``rollout/*`` in the
run's ``metrics.jsonl`` and wandb); ``--wait`` waits for the arrays still running; ``--resubmit`` submits the missing
elements of an incomplete evaluation again (as a new array of those indices). It prints where each evaluation
stands. (slurmvla.launch.eval_array has the whole story.)
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

from slurmvla.cli import ArgumentParser, program
from slurmvla.errors import boundary
from slurmvla.launch.eval_array import (
    DONE,
    INCOMPLETE,
    STATE_FILE,
    ArraySettings,
    EvalArrays,
    run_element,
    shard_name,
)

log = logging.getLogger("slurmvla")


def element(checkpoint: str, shards: int, out: str, index: int | None, overrides: list[str]) -> None:
    if index is None:
        task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
        if not task.isdigit():
            raise ValueError("no --index and no SLURM_ARRAY_TASK_ID: give --index I (0..N-1) outside a job array")
        index = int(task)
    if shards < 1 or not 0 <= index < shards:
        raise ValueError(f"--index {index} --shards {shards}: the index must be in 0..{shards - 1}")
    if not Path(checkpoint).exists():
        raise ValueError(f"checkpoint {checkpoint} does not exist (pruned by checkpoint.keep, or moved)")
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    where = f"array job {job}, restart {os.environ.get('SLURM_RESTART_COUNT', '0')}, " if job else ""
    print(f"slurmvla: element {index} of {shards} ({where}{socket.gethostname()}): {checkpoint} -> {out}", flush=True)
    did = run_element(Path(checkpoint), Path(out), index, shards, overrides)
    final = Path(out) / shard_name(index, shards)
    print(f"slurmvla: element {index}: shard {'already there, not run again' if did == 'skipped' else 'written'}: "
          f"{final}{'; merged: ' + str(Path(out) / 'rollout.json') if (Path(out) / 'rollout.json').is_file() else ''}",
          flush=True)


def gather(run_dir: str, wait_s: float, resubmit: bool) -> None:
    from omegaconf import OmegaConf

    from slurmvla.checkpoint import CheckpointManager
    from slurmvla.config import WandbConfig
    from slurmvla.launch.runlock import RunLock
    from slurmvla.logger import MetricLogger

    run = Path(run_dir)
    if not (run / STATE_FILE).is_file():
        raise ValueError(f"{run} holds no evaluation arrays ({STATE_FILE}): its run did not set rollout_array.enabled=true")
    cfg = OmegaConf.load(run / "config.resolved.yaml")
    lock = RunLock(run)
    lock.acquire()  # a live trainer gathers its own: refused, naming it
    try:
        wandb = WandbConfig(**OmegaConf.to_container(cfg.logging.wandb))
        logger = MetricLogger(run, wandb, str(cfg.name), OmegaConf.to_container(cfg), enabled=True)
        logger.start(None)
        try:
            out_root = Path(cfg.rollout.out) if cfg.rollout.get("out") else None
            arrays = EvalArrays(run, ArraySettings.of(cfg.rollout_array), str(cfg.name), logger.log_at, out_root)
            # An incomplete evaluation's elements may have been rerun by hand since: looked at again first.
            arrays.poll()
            if resubmit:
                for step in [s for s, e in sorted(arrays.entries.items()) if e["status"] == INCOMPLETE]:
                    job = arrays.resubmit(step)
                    print(f"step {step}: missing elements resubmitted as array job {job}" if job else
                          f"step {step}: not resubmitted (see the log above)", flush=True)
            if wait_s > 0:
                arrays.wait(wait_s, tick_s=min(1.0, arrays.settings.poll_s))
            # The checkpoints released (their evaluations complete) leave as checkpoint.keep says.
            checkpoints = CheckpointManager(run, int(cfg.checkpoint.keep), None, None, None)
            checkpoints.protected = arrays.pinned
            checkpoints.prune()
            for step, e in sorted(arrays.entries.items()):
                how = {DONE: f"logged ({Path(e['out']) / 'rollout.json'})",
                       INCOMPLETE: f"incomplete: elements {e.get('missing')} of array job {e['job']} wrote no shard "
                                   f"(see {Path(e['out']) / 'missing.json'}; --resubmit runs them again)"}.get(
                    e["status"], f"{e['status']}" + (f" (array job {e['job']})" if e.get("job") else ""))
                print(f"step {step}: {how}", flush=True)
        finally:
            logger.close()
    finally:
        lock.release()


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    commands = ("element", "gather")
    if not argv or argv[0] not in commands:
        parser = ArgumentParser(prog=program("slurmvla.eval_array"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("command", choices=commands)
        parser.parse_args(argv[:1])  # --help, or the error naming the choices
        return
    name = f"{program('slurmvla.eval_array')} {argv[0]}"
    parser = ArgumentParser(prog=name, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if argv[0] == "element":
        parser.add_argument("checkpoint", help="the checkpoint folder (RUN_DIR/checkpoints/step_N)")
        parser.add_argument("overrides", nargs="*", help="overrides of the run's config, e.g. serve.device=cpu")
        parser.add_argument("--shards", type=int, required=True, help="N: the array's elements")
        parser.add_argument("--out", required=True, help="the step's folder (RUN_DIR/rollout/step_N)")
        parser.add_argument("--index", type=int, help="I in 0..N-1 (default: SLURM_ARRAY_TASK_ID)")
    else:
        parser.add_argument("run_dir", help="the run directory")
        parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                            help="wait this long for the arrays still running (default 0)")
        parser.add_argument("--resubmit", action="store_true",
                            help="submit the missing elements of incomplete evaluations again")
    args = parser.parse_intermixed_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with boundary():
        if argv[0] == "element":
            element(args.checkpoint, args.shards, args.out, args.index, list(args.overrides))
        else:
            gather(args.run_dir, args.wait, args.resubmit)


if __name__ == "__main__":
    main()
