"""The training application: compose the config -> build the Trainer -> fit -> close.

    python -m slurmvla.train                                  # debug mode: one process, GPU or CPU
    python -m slurmvla.train experiment=demo trainer.max_steps=50
    torchrun --nproc_per_node=K -m slurmvla.train engine=...  # several processes
"""

from __future__ import annotations

import dataclasses
import os
import sys

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from slurmvla import garbage_collector
from slurmvla.compose import HydraApp, config_dir, to_config
from slurmvla.errors import FAILED, Failure, boundary, exit_with
from slurmvla.launch.grace import SIGNAL_DELAY_ENV
from slurmvla.launch.preempt import REQUEUE_EXIT_CODE, PreemptionFlag, report_stop

__all__ = ["cli", "config_dir", "run"]


def run(cfg: DictConfig) -> float | None:
    """One training run of a composed config: the Trainer built, fitted and closed (the task Hydra runs)."""
    # torch's import and the build without the garbage collector walking them (slurmvla.garbage_collector).
    with garbage_collector.paused():
        # After Hydra has parsed the command line: --help stays fast.
        from slurmvla.trainer import Trainer

        # The submitit path's signal lead, for the check that a checkpoint fits in it (slurmvla.launch.grace).
        delay = HydraConfig.get().launcher.get("signal_delay_s")
        if delay and SIGNAL_DELAY_ENV not in os.environ:
            os.environ[SIGNAL_DELAY_ENV] = str(delay)
        # A user's mistake found at start-up (a bad value, a policy class that cannot be imported, data that does
        # not fit the policy) is one line; every rank finds the same one.
        with boundary():
            config = to_config(cfg)
            closed_loop = None
            if config.trainer.rollout_every_steps and not config.rollout_array.enabled:  # else: job arrays
                from slurmvla.inference.closed_loop import in_training, require_sim

                require_sim(config.rollout.env)  # at start-up, not after the first N steps
                closed_loop = in_training
            trainer = Trainer(config, HydraConfig.get().runtime.output_dir, closed_loop=closed_loop)
    try:
        metrics = trainer.fit()
    except BaseException as e:
        trainer.close(failed=True)
        if not isinstance(e, Failure):
            raise
        # The disk filled, a peer stopped answering or a dataset file turned out damaged: one line naming it
        # (checkpoints written so far are kept). The trainer holds the data loader, whose workers outlive stop
        # signals: let it go before exiting, not at exit.
        del trainer
        exit_with(e, FAILED)
    if trainer.stopped_for_requeue:
        trainer.preempt.ignore_further()  # before close gives the signals back: a late one would take the exit
    trainer.close()
    if trainer.stopped_for_requeue:
        # Checkpoint written. Under submitit its handler requeues now (and exits on rank 0); on the
        # sbatch path the batch script requeues on this exit code (SystemExit passes Hydra).
        trainer.preempt.hand_over()
        report_stop(trainer.step)
        sys.exit(REQUEUE_EXIT_CODE)
    return metrics.get("loss")


def dry_run(cfg: DictConfig, overrides: list[str]) -> None:
    """What a run of the composed ``cfg`` would run or submit, printed (every validation rule run first, as at
    start-up); nothing runs."""
    from omegaconf import OmegaConf

    from slurmvla.launch.dryrun import describe

    config = to_config(cfg)
    launcher = {}
    for key in cfg.hydra.launcher:
        value = OmegaConf.select(cfg, f"hydra.launcher.{key}", throw_on_missing=False, throw_on_resolution_failure=False)
        launcher[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    launcher.setdefault("name", config.name)
    print(describe(dataclasses.asdict(config), {"launcher": launcher}, [o for o in overrides if not o.startswith("hydra")]))


def cli() -> None:
    """Entry point: Hydra's command line (``-m``, ``--cfg job``, ``--help``, overrides) and ``--dry-run`` (print what
    would be run or submitted, run nothing), composed once (:meth:`slurmvla.compose.HydraApp.start`); a misspelled
    key fails before any composition, with the valid keys listed."""
    # From the first moment: a stop signal during imports and composition is kept for the trainer
    # (which takes this flag over), not fatal (slurmvla.launch.preempt). Not in a multirun's
    # submitting process, which trains nothing.
    if not {"-m", "--multirun"} & set(sys.argv[1:]):
        PreemptionFlag().install()
    with HydraApp("train") as hydra:
        hydra.start(sys.argv[1:], run, dry_run=dry_run)


if __name__ == "__main__":
    cli()
