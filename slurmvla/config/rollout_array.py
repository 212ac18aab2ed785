"""The periodic closed loop off the training job (``rollout_array.*``): each checkpoint due for evaluation
(``trainer.rollout_every_steps``) is evaluated by a SLURM job array while training goes on (slurmvla.launch.eval_array,
``python -m slurmvla.eval_array``). A schema module of ``slurmvla.config``: it imports no torch and nothing of
``slurmvla`` above the configuration (layer 1; docs/architecture.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slurmvla.validators import check_positive

# SLURM's --time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
TIME_FORMATS = ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS")
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
# sbatch options the array sets itself, refused in rollout_array.sbatch_args: option -> where its value comes from.
_SETTING = {"--partition": "rollout_array.partition", "-p": "rollout_array.partition", "--time": "rollout_array.time",
            "-t": "rollout_array.time", "--cpus-per-task": "rollout_array.cpus_per_task",
            "-c": "rollout_array.cpus_per_task", "--gpus-per-task": "rollout_array.gpus_per_task",
            "--array": "rollout_array.shards", "-a": "rollout_array.shards"}
_FIXED = ("--requeue", "--no-requeue", "--output", "-o", "--error", "-e", "--open-mode", "--wrap", "--parsable",
          "--job-name", "-J")


@dataclass
class RolloutArrayConfig:
    """trainer.rollout_every_steps as SLURM job arrays: at each evaluation step the trainer saves the checkpoint and
    submits ``sbatch --array=0-(shards-1) --requeue``; element I runs ``python -m slurmvla.eval_array element
    CHECKPOINT --shards N --out STEP_DIR`` (python -m slurmvla.rollout's --shard I/N of the run's rollout.* episodes);
    the trainer gathers the shards and logs rollout/* at the checkpoint's step."""

    # false: the closed loop runs inside the training job (trainer.rollout_every_steps, as before); true: as a job
    # array per evaluated checkpoint, training going on meanwhile.
    enabled: bool = False
    # Elements of each array: element I runs the episodes I, I+N, I+2N, ... of rollout.episodes.
    shards: int = 4
    # sbatch --partition of the elements; null: the cluster's default.
    partition: str | None = None
    # sbatch --time of each element (SLURM's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS).
    time: str = "01:00:00"
    cpus_per_task: int = 4
    # sbatch --gpus-per-task; 0: none (the policy is served on the element's CPU; serve.device=auto picks a GPU
    # when the element has one).
    gpus_per_task: int = 0
    # More sbatch options, each one word, e.g. ["--mem=16G", "--account=robotics", "--qos=eval"].
    sbatch_args: list[str] = field(default_factory=list)
    # Overrides of the run's config for the elements (e.g. serve.device=cpu, rollout.videos=0).
    overrides: list[str] = field(default_factory=list)
    # The Python the elements run; null: the training's own (sys.executable, on a filesystem the nodes share).
    python: str | None = None
    # At the end of training, how long the trainer waits for the arrays still running before it exits, naming them
    # (python -m slurmvla.eval_array gather RUN_DIR logs them later); 0: it does not wait.
    wait_s: float = 3600.0
    # How often the trainer asks squeue about elements whose shard has not appeared (at its log steps, and while it
    # waits at the end): an element gone from the queue without its shard failed for good.
    poll_s: float = 30.0

    def __post_init__(self) -> None:
        check_positive("rollout_array.shards", self.shards)
        check_positive("rollout_array.cpus_per_task", self.cpus_per_task)
        check_positive("rollout_array.gpus_per_task", self.gpus_per_task, allow_zero=True)
        check_positive("rollout_array.wait_s", self.wait_s, allow_zero=True)
        check_positive("rollout_array.poll_s", self.poll_s)
        if not _TIME.match(str(self.time)):
            raise ValueError(f"rollout_array.time={self.time!r} is not a SLURM time; write it as one of "
                             f"{list(TIME_FORMATS)} (e.g. 01:00:00)")
        if self.partition is not None and (not self.partition or any(c.isspace() for c in self.partition)):
            raise ValueError(f"rollout_array.partition={self.partition!r} is not a partition name; give one word "
                             "(sinfo lists them), or null for the cluster's default")
        for arg in self.sbatch_args:
            option = str(arg).split("=", 1)[0]
            if not str(arg).startswith("-") or any(c.isspace() for c in str(arg)):
                raise ValueError(f"rollout_array.sbatch_args: {arg!r} is not one sbatch option; give each as one word, "
                                 "e.g. ['--mem=16G', '--account=robotics']")
            if option in _SETTING:
                raise ValueError(f"rollout_array.sbatch_args: {arg!r}: set {_SETTING[option]} instead")
            if option in _FIXED:
                raise ValueError(f"rollout_array.sbatch_args: {arg!r} is the array's own (each element requeues, "
                                 "logs to STEP_DIR/slurm-%A_%a.out and runs python -m slurmvla.eval_array); choose "
                                 f"other options than {list(_FIXED)}")
        for item in self.overrides:
            if "=" not in str(item):
                raise ValueError(f"rollout_array.overrides: {item!r} is not key=value (e.g. serve.device=cpu)")
