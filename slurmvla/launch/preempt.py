"""Preemption and time-limit signals. The handler only sets a flag; the trainer acts on it.

SLURM sends the signal ``signal_delay`` before the time limit (``--signal=B:USR2@90`` on the sbatch
path; submitit sends USR2 too). USR2 because NCCL may use USR1. At the next step boundary the
ranks agree on the flag (one small all-reduce, see slurmvla.collectives), save a checkpoint
together and exit with ``REQUEUE_EXIT_CODE``; the launcher requeues the job, which resumes there.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("slurmvla")

# What a run that stopped for a requeue exits with (EX_TEMPFAIL): the launcher requeues on it.
REQUEUE_EXIT_CODE = 75
# Written into the run directory when training reached max_steps: such a run is never requeued.
FINISHED_MARKER = "FINISHED"


class PreemptionFlag:
    """Set by a signal handler; read at step boundaries. Installing it is idempotent."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def install(self, signals: tuple[str, ...] = ("SIGUSR2",)) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for name in signals:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum: int, frame) -> None:  # noqa: ANN001 - signal's signature
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()
