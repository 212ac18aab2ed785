"""The training application: compose the config -> build the Trainer -> fit -> close.

    python -m slurmvla.train                                  # debug mode: one process, GPU or CPU
    python -m slurmvla.train experiment=demo trainer.max_steps=50
    torchrun --nproc_per_node=K -m slurmvla.train engine=...  # several processes
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from slurmvla import collector
from slurmvla.compose import HydraRun, check_overrides, config_dir, to_config
from slurmvla.errors import FAILED, Failure, boundary, exit_code, exit_with
from slurmvla.launch.grace import SIGNAL_DELAY_ENV
from slurmvla.launch.preempt import REQUEUE_EXIT_CODE, PreemptionFlag, report_stop

__all__ = ["cli", "config_dir", "main", "run"]


def run(cfg: DictConfig) -> float | None:
    """One training run of a composed config: the Trainer built, fitted and closed (the task Hydra runs)."""
    # torch's import and the build without the garbage collector walking them (slurmvla.collector).
    with collector.paused():
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
            if config.trainer.rollout_every_steps:
                from slurmvla.inference.closed_loop import in_training, require_sim

                require_sim()  # at start-up, not after the first N steps
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


# Hydra's own command line: flags (-m, --cfg, --help, ...) and a config asking for a multirun.
main = hydra.main(version_base=None, config_path=str(config_dir()), config_name="config")(run)


def dry_run(overrides: list[str]) -> None:
    """Compose exactly what a run would, print what would be submitted or run, and stop."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from slurmvla.launch.dryrun import describe

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    launcher = {}
    for key in cfg.hydra.launcher:
        value = OmegaConf.select(cfg, f"hydra.launcher.{key}", throw_on_missing=False, throw_on_resolution_failure=False)
        launcher[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    launcher.setdefault("name", cfg.name)
    hydra_cfg = {"launcher": launcher}
    job = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    to_config(OmegaConf.create(job))  # every validation rule, as at start-up
    print(describe(job, hydra_cfg, [o for o in overrides if not o.startswith("hydra")]))


# Hydra's own flags (python -m slurmvla.train --help) and ours.
FLAGS = ("--dry-run", "-m", "--multirun", "-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-p", "--package",
         "-i", "--info", "--resolve", "-r", "--run", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
         "--config-name", "-cd", "--config-dir", "--experimental-rerun")


# Hydra's flags that take the next argument as their value (--cfg job, -cn NAME, ...).
VALUE_FLAGS = ("-c", "--cfg", "-p", "--package", "-i", "--info", "-cp", "--config-path", "-cn", "--config-name", "-cd",
               "--config-dir", "--experimental-rerun", "-sc", "--shell-completion")


def overrides_of(args: list[str]) -> list[str]:
    """The key=value overrides of a command line: not its flags, nor a flag's value."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in VALUE_FLAGS
        else:
            out.append(arg)
    return out


def check_command_line(args: list[str], overrides: list[str]) -> None:
    """An unknown flag, or several values for a key without -m: one line instead of Hydra's usage block."""
    for arg in args:
        if arg.startswith("-") and arg.split("=", 1)[0] not in FLAGS:
            raise ValueError(f"unknown option {arg!r}; the options are {', '.join(FLAGS)} (overrides are key=value)")
    if {"-m", "--multirun"} & set(args):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return  # check_overrides says what is wrong with it
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps:
        raise ValueError(f"{sweeps[0]} gives several values: add -m (--multirun) to run one job per value, or give "
                         "one value (a comma inside a value: quote it, key='a,b')")


def cli() -> None:
    """Entry point: a misspelled key fails here with the valid keys listed, before Hydra starts;
    ``--dry-run`` prints what would be run or submitted and runs nothing."""
    # From the first moment: a stop signal during imports and composition is kept for the trainer
    # (which takes this flag over), not fatal (slurmvla.launch.preempt). Not in a multirun's
    # submitting process, which trains nothing.
    if not {"-m", "--multirun"} & set(sys.argv[1:]):
        PreemptionFlag().install()
    overrides = overrides_of(sys.argv[1:])
    composed = None
    try:
        check_command_line(sys.argv[1:], overrides)
        if overrides == sys.argv[1:]:
            # Overrides alone (no flag): composed once, checked on that composition, run by Hydra's run_job.
            composed = HydraRun(run, overrides)
        else:
            check_overrides(overrides)
            if "--dry-run" in sys.argv:
                dry_run(overrides)
                return
    except ValueError as e:
        exit_with(e, exit_code(e))
    if composed is not None and not composed.multirun:
        composed.run()
    else:
        main()


if __name__ == "__main__":
    cli()
