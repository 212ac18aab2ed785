"""Process-level defaults and the run's reproducibility snapshot (launch layer: no engine imports)."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

log = logging.getLogger("slurmvla")

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_DEFAULT = "expandable_segments:True"
# Environment variables kept in the snapshot: the job's shape, never credentials.
_KEEP = re.compile(r"^(SLURM_|SUBMITIT_|TORCHELASTIC_|MASTER_|NCCL_|CUDA_VISIBLE|NNODES$|NODE_RANK$|RANK$|"
                   r"LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|OMP_NUM_THREADS$|PYTORCH_CUDA_ALLOC_CONF$|"
                   r"EXTRA_TAIL_OVERRIDES$|KEEP_RANGES_PATH$|EPISODE_ID_TO_PATH$|DROID_ROOT$|RUN_DIR$)")
_SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.IGNORECASE)


def apply_process_defaults(is_main: bool, environ: dict[str, str] | None = None) -> None:
    """Before CUDA initialises: expandable segments cut fragmentation for variable-length batches."""
    env = os.environ if environ is None else environ
    if ALLOC_CONF not in env:
        env[ALLOC_CONF] = ALLOC_DEFAULT
        if is_main:
            log.info("%s=%s (set by slurmvla; set it yourself to choose another)", ALLOC_CONF, ALLOC_DEFAULT)


def job_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if _KEEP.match(k) and not _SECRET.search(k)}


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else None


def write_snapshot(run_dir: Path, dist_env: dict, restart: int | None = None) -> Path:
    """``run_dir/environment.json``: job environment (no secrets), versions, git commit, hosts."""
    versions = {}
    for pkg in ("slurmvla", "torch", "hydra-core", "submitit", "deepspeed", "av", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    snapshot = {
        "argv": sys.argv, "host": socket.gethostname(), "python": platform.python_version(),
        "git_commit": _git_commit(), "versions": versions, "dist_env": dist_env, "environment": job_environment(),
    }
    path = run_dir / ("environment.json" if not restart else f"environment.restart{restart}.json")
    path.write_text(json.dumps(snapshot, indent=2))
    return path
