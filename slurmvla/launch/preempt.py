"""Preemption and time-limit signals. The handler only sets a flag; the trainer acts on it.

SLURM sends the signal ``signal_delay`` before the time limit (``--signal=USR2@120`` on the sbatch
path; submitit asks for USR2 too). USR2 because NCCL may use USR1. At the next step boundary the
ranks agree on the flag (one small all-reduce, see slurmvla.collectives) and save a checkpoint
together. Then the launcher requeues: on the sbatch path the batch script (``python -m
slurmvla.launch requeue``) after the step exits with ``REQUEUE_EXIT_CODE``; on the submitit path
submitit's own handler, which ours replaced and hands over to once the checkpoint is written.
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
        self._previous = {}
        for name in signals:
            sig = getattr(signal, name)
            previous = signal.getsignal(sig)
            if previous is not self._handle:
                self._previous[sig] = previous
            signal.signal(sig, self._handle)

    def hand_over(self) -> None:
        """After the checkpoint: run the handler that was there before ours (submitit's, which
        requeues the job from global rank 0 and exits there), as if the signal arrived now."""
        for sig, previous in getattr(self, "_previous", {}).items():
            if callable(previous):
                log.info("handing %s over to %s", signal.Signals(sig).name, getattr(previous, "__qualname__", previous))
                previous(sig, None)

    def _handle(self, signum: int, frame) -> None:  # noqa: ANN001 - signal's signature
        self.signal_name = signal.Signals(signum).name
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()
