"""Dry runs of the Python entry paths: what would be submitted or run, and nothing is.

    python -m slurmvla.train --dry-run [OVERRIDES]                                   # local / torchrun
    python -m slurmvla.train --dry-run -m hydra/launcher=slurm_cluster [OVERRIDES]   # the sbatch script submitit writes

(The shell paths have their own: ``DRY_RUN=1 bash sbatch/train.sh`` / ``launchers/train.sh``.)
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from slurmvla.launch.distenv import DistEnv

_DIRECT = ("partition", "qos", "comment", "constraint", "exclude", "gres", "cpus_per_gpu", "gpus_per_task",
           "mem_per_gpu", "mem_per_cpu", "account", "signal_delay_s", "array_parallelism", "setup", "nodes",
           "cpus_per_task", "gpus_per_node", "stderr_to_stdout")


def submitit_sbatch(launcher: dict[str, Any], folder: str, command: str) -> str:
    """The sbatch script hydra-submitit-launcher would submit for this launcher config."""
    from submitit.slurm.slurm import _make_sbatch_string

    kwargs = {k: launcher[k] for k in _DIRECT if launcher.get(k) is not None}
    kwargs["time"] = launcher.get("timeout_min", 60)
    kwargs["ntasks_per_node"] = launcher.get("tasks_per_node", 1)
    kwargs["job_name"] = launcher.get("name") or "slurmvla"
    if launcher.get("mem_gb") is not None:
        kwargs["mem"] = f"{launcher['mem_gb']}GB"
    if launcher.get("additional_parameters"):
        kwargs["additional_parameters"] = dict(launcher["additional_parameters"])
    return _make_sbatch_string(command=command, folder=folder, **kwargs)


def describe(cfg: dict[str, Any], hydra_cfg: dict[str, Any], argv: list[str]) -> str:
    launcher = hydra_cfg.get("launcher", {})
    target = str(launcher.get("_target_", ""))
    lines = []
    if "SlurmLauncher" in target:
        folder = str(launcher.get("submitit_folder", "<sweep dir>/.submitit/%j"))
        command = f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(folder)}"
        lines.append(f"submitit would submit (one SLURM task per process, {launcher.get('nodes')} node(s) x "
                     f"{launcher.get('tasks_per_node')} task(s)); sbatch script:")
        lines.append(submitit_sbatch(launcher, folder, command))
        lines.append("each task then runs the training with these overrides: " + " ".join(map(shlex.quote, argv)))
    else:
        env = DistEnv.from_environ()
        lines.append("command: " + " ".join(map(shlex.quote, [sys.executable, "-m", "slurmvla.train", *argv])))
        lines.append(f"distributed environment ({env.source}): " + " ".join(f"{k}={v}" for k, v in env.exports().items()))
    lines.append(f"engine={cfg['engine']['name']} precision={cfg['precision']} policy={cfg['policy']['size']} "
                 f"global_batch_size={cfg['trainer']['global_batch_size']} max_steps={cfg['trainer']['max_steps']} "
                 f"data.root={cfg['data']['root']}")
    return "\n".join(lines)
