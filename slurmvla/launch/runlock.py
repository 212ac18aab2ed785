"""One run per run directory: a lock file that names its holder, kept fresh while the run lives.

Two runs writing one run directory (a job resubmitted while the old one still runs) would
interleave checkpoints and metrics and resume from each other's half-finished state. Rank 0 takes
``RUN_DIR/.slurmvla.lock`` (created atomically) holding the host, PID, SLURM job id and start time,
and touches it every ``HEARTBEAT_S`` from a daemon thread. A second run refuses at start-up, naming
the holder, unless the holder is gone, judged in this order:

1. the same SLURM job id: a requeued job (SLURM never runs two instances of one job);
2. the same host: its PID is no longer alive (or is this process: the lock is ours);
3. a SLURM job id and ``squeue`` reachable: the job is no longer running;
4. otherwise the lock has not been touched for ``STALE_S``.

A stale lock is taken over, and the take-over is said. The lock is removed when the run closes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from slurmvla.launch.distenv import SlurmJob

LOCK_FILE = ".slurmvla.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


class RunDirInUse(ValueError):
    """Another live run holds this run directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) holds nothing.
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True


def _job_running(job_id: str) -> bool | None:
    """True / False from ``squeue``; None when SLURM cannot be asked from here."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        # squeue exits non-zero for a job id it no longer knows.
        return False if "Invalid job id" in res.stderr else None
    return res.stdout.strip() in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED")


def describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"host {holder.get('host')}, pid {holder.get('pid')}{job}, started {started}"


class RunLock:
    def __init__(self, run_dir: str | Path, job: SlurmJob | None = None):
        self.path = Path(run_dir) / LOCK_FILE
        self.job = job or SlurmJob.from_environ()
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": self.job.job_id,
                   "restart": self.job.restart_count, "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock, or raise RunDirInUse naming the live holder. Returns a sentence when a stale
        lock was taken over (for the log), else None."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        taken_over = None
        for _ in range(3):  # another run may take or release it between our reads
            if self._create():
                break
            holder = self._read()
            if holder is None:
                continue
            reason = self._gone(holder)
            if reason is None:
                raise RunDirInUse(
                    f"run directory {self.path.parent} is in use by another run ({describe(holder)}); wait for "
                    f"it to end{self._cancel_hint(holder)}, or set hydra.run.dir to another directory "
                    f"(lock file: {self.path})")
            if holder.get("pid") != self.me["pid"] or holder.get("host") != self.me["host"]:
                taken_over = f"took over the lock on {self.path.parent} left by {describe(holder)}: {reason}"
            self.path.unlink(missing_ok=True)
        else:
            raise RunDirInUse(f"could not take the lock {self.path}: other runs keep taking it")
        self._thread = threading.Thread(target=self._beat, name="slurmvla-runlock", daemon=True)
        self._thread.start()
        return taken_over

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        holder = self._read()
        if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            self.path.unlink(missing_ok=True)

    # -- internals --------------------------------------------------------------------------------

    def _create(self) -> bool:
        """Written whole under a private name, then linked into place: a reader never sees a
        half-written lock, and link fails if the lock exists (atomic, also on NFS)."""
        private = self.path.with_name(f"{LOCK_FILE}.{self.me['host']}.{self.me['pid']}")
        with open(private, "w") as fh:
            json.dump(self.me, fh)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(private, self.path)
        except FileExistsError:
            return False
        finally:
            private.unlink(missing_ok=True)
        return True

    def _read(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            # Half-written by a run that died while creating it.
            return {"host": "?", "pid": None, "job_id": None, "started": 0, "unreadable": True}
        holder["age_s"] = time.time() - self.path.stat().st_mtime if self.path.exists() else 0.0
        return holder

    def _gone(self, holder: dict[str, Any]) -> str | None:
        """Why the holder no longer runs, or None when it may still."""
        if holder.get("unreadable"):
            return "the lock file is unreadable"
        if self.job.job_id and holder.get("job_id") == self.job.job_id:
            return f"the same SLURM job {self.job.job_id}, requeued"
        if holder.get("host") == self.me["host"]:
            if holder.get("pid") == self.me["pid"]:
                return "this process"
            pid = holder.get("pid")
            if not isinstance(pid, int) or pid <= 0 or not _pid_alive(pid):
                return f"pid {holder.get('pid')} is no longer running on this host"
            return None
        if holder.get("job_id"):
            running = _job_running(str(holder["job_id"]))
            if running is False:
                return f"SLURM job {holder['job_id']} is no longer running"
            if running is True:
                return None
        if holder.get("age_s", 0.0) > STALE_S:
            return f"not touched for {holder['age_s']:.0f} s (a live run touches it every {HEARTBEAT_S:.0f} s)"
        return None

    @staticmethod
    def _cancel_hint(holder: dict[str, Any]) -> str:
        return f" (or scancel {holder['job_id']})" if holder.get("job_id") else ""

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away; nothing to keep fresh
