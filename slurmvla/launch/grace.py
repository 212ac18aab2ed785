"""Does a checkpoint fit between SLURM's signal and its kill? Warn when it does not, and say what to change.

Two budgets bound the time from the signal to SIGKILL:

- the time-limit signal's lead, ``signal_delay``: ``#SBATCH --signal=USR2@120`` on the sbatch path
  (the scripts export it as ``SLURMVLA_SIGNAL_DELAY_S``; SLURM does not tell a job its ``--signal``),
  ``hydra.launcher.signal_delay_s`` on the submitit path;
- the partition's preemption ``GraceTime`` (``scontrol show partition``), where the partition can be
  preempted (``PreemptMode`` not OFF).

What a stop costs: up to ``trainer.signal_check_every_steps`` steps until the ranks agree, a
background save still in flight, then the checkpoint itself.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

log = logging.getLogger("slurmvla")

SIGNAL_DELAY_ENV = "SLURMVLA_SIGNAL_DELAY_S"


@dataclass(frozen=True)
class Budget:
    what: str  # e.g. "partition debug's preemption GraceTime"
    seconds: float
    setting: str  # what to change for more time


def partition_grace(partition: str) -> tuple[float, str] | None:
    """(GraceTime seconds, PreemptMode) of a partition, or None when scontrol cannot say."""
    if not partition or shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "partition", partition], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    grace, mode = re.search(r"\bGraceTime=(\d+)", out), re.search(r"\bPreemptMode=(\S+)", out)
    if grace is None:
        return None
    return float(grace.group(1)), (mode.group(1) if mode else "")


def budgets(environ: dict[str, str] | None = None) -> list[Budget]:
    env = os.environ if environ is None else environ
    found = []
    delay = env.get(SIGNAL_DELAY_ENV, "")
    try:
        if delay and float(delay) > 0:
            found.append(Budget(f"the time-limit signal's lead ({SIGNAL_DELAY_ENV}={delay})", float(delay),
                                "ask for the signal earlier: --signal=USR2@SECONDS in the sbatch script (and "
                                f"{SIGNAL_DELAY_ENV} to match), or hydra.launcher.signal_delay_s on the submitit path"))
    except ValueError:
        log.warning("%s=%r is not a number of seconds; ignored", SIGNAL_DELAY_ENV, delay)
    partition = env.get("SLURM_JOB_PARTITION", "")
    grace = partition_grace(partition)
    if grace is not None and grace[1].upper() not in ("", "OFF"):
        found.append(Budget(f"partition {partition}'s preemption GraceTime ({grace[0]:.0f} s, PreemptMode={grace[1]})",
                            grace[0], "submit to a partition with a longer GraceTime (a SLURM administrator sets "
                            "it), or save less state per checkpoint"))
    return found


def shortfalls(save_s: float, step_s: float, check_every: int, background: bool,
               environ: dict[str, str] | None = None) -> list[str]:
    """One warning per budget that a stop does not fit in."""
    need = check_every * step_s + save_s * (2 if background else 1)
    how = (f"{check_every} step(s) of {step_s:.1f} s until the ranks agree + " if step_s else "") + \
          (f"a background save in flight and the checkpoint ({save_s:.1f} s each)" if background
           else f"the checkpoint ({save_s:.1f} s)")
    out = []
    for b in budgets(environ):
        if need > b.seconds:
            out.append(f"a stop for a signal needs about {need:.0f} s ({how}) but {b.what} gives {b.seconds:.0f} s: "
                       f"SIGKILL would come before the checkpoint is complete and the steps since the last one would "
                       f"be lost; {b.setting}")
    return out
