"""Small decisions the shell wrappers ask for, so that no script computes anything that can be wrong.

    python -m slurmvla.launch master-addr       # first host of the job's node list
    python -m slurmvla.launch master-port       # MASTER_PORT if set, else derived from the job id
    python -m slurmvla.launch nproc-per-node    # NPROC_PER_NODE / GPUS_PER_NODE / SLURM GPUs / CUDA devices / 1
    python -m slurmvla.launch requeue RUN_DIR EXIT_CODE   # after the job step: finished, requeue, or fail
    python -m slurmvla.launch check-file NAME PATH        # fail at once when a configured file is missing
    python -m slurmvla.launch check-budget                # at job start: fail when restarts exceed the budget
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurmvla.errors import USAGE, one_line
from slurmvla.launch.distenv import SlurmJob
from slurmvla.launch.preempt import FINISHED_MARKER

DEFAULT_MAX_RESTARTS = 3


def nproc_per_node(env: dict[str, str], sys_root: Path = Path("/sys"), dev: Path = Path("/dev")) -> int:
    for name in ("NPROC_PER_NODE", "GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    if not gpus_may_be_present(sys_root, dev):
        return 1  # a CPU node answers without importing torch (~3 CPU-s on every node of every launch)
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


# PCI vendors whose display controllers torch.cuda counts (CUDA; ROCm's HIP), and the device files of their
# drivers (NVIDIA's, its Jetson boards', ROCm's kernel driver, WSL's GPU paravirtualisation).
GPU_VENDORS = ("0x10de", "0x1002")
GPU_DEVICE_FILES = ("nvidia[0-9]*", "nvmap", "kfd", "dxg")


def gpus_may_be_present(sys_root: Path = Path("/sys"), dev: Path = Path("/dev")) -> bool:
    """False only where this node certainly has no GPU torch could count: no GPU driver's device file, and the
    PCI bus readable and without an NVIDIA or AMD display controller (PCI class 0x03...). Anything it cannot
    tell (no PCI bus to read) is True: torch counts then."""
    if any(any(dev.glob(pattern)) for pattern in GPU_DEVICE_FILES):
        return True
    try:
        devices = list((sys_root / "bus" / "pci" / "devices").iterdir())
        if not devices:
            return True
        for d in devices:
            if (d / "vendor").read_text().strip() in GPU_VENDORS and (d / "class").read_text().startswith("0x03"):
                return True
    except OSError:
        return True
    return False


def requeue_decision(run_dir: Path, exit_code: int, env: dict[str, str]) -> tuple[str, int]:
    """('finished' | 'requeue' | 'failed', exit code for the batch script)."""
    if (run_dir / FINISHED_MARKER).is_file():
        return "finished", 0
    job = SlurmJob.from_environ(env)
    if not job.in_job:
        return "failed", exit_code or 1
    if job.restart_count >= restart_budget(env):
        return "failed", exit_code or 1
    return "requeue", 0


def restart_budget(env: dict[str, str]) -> int:
    """SLURMVLA_MAX_RESTARTS (default 3); a ValueError names a value that is not a whole number >= 0."""
    value = env.get("SLURMVLA_MAX_RESTARTS", str(DEFAULT_MAX_RESTARTS))
    if not value.strip().isdigit():
        raise ValueError(f"SLURMVLA_MAX_RESTARTS={value!r} is not a number of restarts; give a whole number >= 0 "
                         f"(default {DEFAULT_MAX_RESTARTS})")
    return int(value)


COMMANDS = {"master-addr": [], "master-port": [], "nproc-per-node": [], "requeue": ["RUN_DIR", "EXIT_CODE"],
            "check-file": ["NAME", "PATH"], "check-budget": []}


def main(argv: list[str]) -> int:
    try:
        return _main(argv)
    except ValueError as e:  # a value the caller (a wrapper script, its environment) gave wrongly
        print(f"error: {one_line(e)}", file=sys.stderr)
        return USAGE


def _main(argv: list[str]) -> int:
    env = dict(os.environ)
    cmd = argv[0] if argv else "help"
    if cmd in COMMANDS and len(argv) - 1 != len(COMMANDS[cmd]):
        usage = " ".join([cmd, *COMMANDS[cmd]])
        raise ValueError(f"{cmd} takes {len(COMMANDS[cmd])} argument(s), got {len(argv) - 1}: "
                         f"python -m slurmvla.launch {usage}")
    if cmd not in COMMANDS and cmd not in ("help", "-h", "--help"):
        raise ValueError(f"unknown command {cmd!r}; choose one of {list(COMMANDS)} (python -m slurmvla.launch help)")
    job = SlurmJob.from_environ(env)
    if cmd == "master-addr":
        print(env.get("MASTER_ADDR") or job.master_addr or "127.0.0.1")
    elif cmd == "master-port":
        print(env.get("MASTER_PORT") or job.master_port or 29500)
    elif cmd == "nproc-per-node":
        print(nproc_per_node(env))
    elif cmd == "check-file":
        name, path = argv[1], argv[2]
        if not Path(path).is_file():
            what = "is a directory, not a file" if Path(path).is_dir() else "does not exist (or is not a file)"
            print(f"error: {name}={path!r} {what}; fix it or unset {name}", file=sys.stderr)
            return 2
    elif cmd == "check-budget":
        # SLURM itself requeues a --requeue job after a node failure; the budget holds for those too.
        budget = restart_budget(env)
        if job.restart_count > budget:
            print(f"error: job {job.job_id} was requeued {job.restart_count} times, more than its budget "
                  f"SLURMVLA_MAX_RESTARTS={budget}; not starting again", file=sys.stderr)
            return 1
    elif cmd == "requeue":
        run_dir, code = Path(argv[1]), argv[2]
        if not code.lstrip("-").isdigit():
            raise ValueError(f"requeue: EXIT_CODE={code!r} is not an exit code (a whole number, e.g. $? of the job step)")
        code = int(code)
        decision, rc = requeue_decision(run_dir, code, env)
        restarts = job.restart_count
        if decision == "requeue":
            print(f"slurmvla: run not finished (exit {code}); requeueing job {job.job_id} (restart {restarts})")
            subprocess.run(["scontrol", "requeue", job.job_id], check=True)
        elif decision == "failed":
            print(f"slurmvla: run not finished (exit {code}) and not requeued (restarts so far: {restarts}, "
                  f"budget SLURMVLA_MAX_RESTARTS={env.get('SLURMVLA_MAX_RESTARTS', DEFAULT_MAX_RESTARTS)})", file=sys.stderr)
        else:
            print(f"slurmvla: run finished ({run_dir / FINISHED_MARKER})")
        return rc
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
