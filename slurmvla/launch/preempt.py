"""Preemption and time-limit signals: "checkpoint and stop". The handler only sets a flag; the
trainer acts on it.

What real clusters send (measured on the test cluster, tests/slurm/test_slurm.py):

- **Time limit**: the user's ``--signal=USR2@120`` (submitit: ``signal_delay_s``) 120 s before it,
  to every process of the job's steps; SIGTERM at the limit itself, SIGKILL ``KillWait`` later.
- **Preemption** (``PreemptMode=REQUEUE`` or ``CANCEL`` with a partition ``GraceTime``): SIGCONT +
  SIGTERM to every process of the job's steps at once (the batch script is not signalled), or
  SIGCONT + the user's signal instead where the site sets ``SlurmctldParameters=
  preempt_send_user_signal``; SIGTERM again when the grace time ends, SIGKILL ``KillWait`` after.
  SLURM requeues the job itself only if it is still running when the grace time ends: a job whose
  step stops within the grace time ends COMPLETED and is never requeued by SLURM. So the launcher
  always requeues a run that stopped for a signal (``REQUEUE_EXIT_CODE``) and is not finished,
  once, while the job is still running (``python -m slurmvla.launch requeue``; under submitit its
  own handler, see ``hand_over``).

Every such signal (``STOP_SIGNALS``, plus submitit's ``SUBMITIT_PREEMPT_SIGNAL`` and the names in
``SLURMVLA_STOP_SIGNALS``) sets the flag. The ranks agree on it (one small all-reduce, see
slurmvla.collectives) every ``trainer.signal_check_every_steps`` steps and at every validation
batch, finish a background save in flight, save a checkpoint together and exit with
``REQUEUE_EXIT_CODE``. The torchrun agent ignores these signals (launchers/train.sh) and the data
loader's workers too (slurmvla.data.loader), so the signal that reaches every process of the step
never kills a step before its save.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger("slurmvla")

# What a run that stopped for a requeue exits with (EX_TEMPFAIL): the launcher requeues on it.
REQUEUE_EXIT_CODE = 75
# Written into the run directory when training reached max_steps: such a run is never requeued.
FINISHED_MARKER = "FINISHED"
# Set by slurmvla.launch.torchrun for its workers: the file a stopping run writes its step into (``report_stop``).
STOP_REPORT_ENV = "SLURMVLA_STOP_REPORT"
# SIGTERM: preemption (and the time limit itself); SIGUSR2: the --signal the launchers ask for
# (USR2 because NCCL may use USR1).
STOP_SIGNALS = ("SIGTERM", "SIGUSR2")


def signal_name(raw: str) -> str:
    """``usr2``, ``USR2`` or ``SIGUSR2`` -> ``SIGUSR2`` (a ValueError for a name that is no signal)."""
    name = raw.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not isinstance(getattr(signal, name, None), signal.Signals):
        raise ValueError(f"SLURMVLA_STOP_SIGNALS / SUBMITIT_PREEMPT_SIGNAL names {raw!r}, which is not a signal "
                         "(e.g. USR1, USR2, TERM)")
    return name


def stop_signals(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The signals that mean "checkpoint and stop" in this job: SIGTERM, SIGUSR2, submitit's
    preemption signal, and any named (comma-separated) in ``SLURMVLA_STOP_SIGNALS``."""
    env = os.environ if environ is None else environ
    names = list(STOP_SIGNALS)
    extra = [env.get("SUBMITIT_PREEMPT_SIGNAL", ""), *env.get("SLURMVLA_STOP_SIGNALS", "").split(",")]
    for raw in extra:
        if not raw.strip():
            continue
        name = signal_name(raw)
        if name not in names:
            names.append(name)
    return tuple(names)


def report_stop(step: int) -> None:
    """Tell the torchrun wrapper (slurmvla.launch.torchrun) the step this run stopped at for a requeue, for its
    one line. Every rank writes the same step (each node's wrapper reads its own file); nothing without it."""
    path = os.environ.get(STOP_REPORT_ENV)
    if not path:
        return
    part = f"{path}.{os.getpid()}"
    try:
        with open(part, "w") as f:
            f.write(f"{step}\n")
        os.replace(part, path)
    except OSError:
        pass  # the wrapper's line then names no step


def ignore_stop_signals(*_: object) -> None:
    """For helper processes (data loader workers): the stop signals reach every process of a SLURM
    step, and a worker that dies of one fails the step before its checkpoint. They end with their
    parent instead (torch's workers watch it)."""
    for name in stop_signals():
        signal.signal(getattr(signal, name), signal.SIG_IGN)


class PreemptionFlag:
    """Set by a signal handler; read at the trainer's agreement points. Installing it is idempotent."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.elsewhere = False  # the signal was another rank's (``adopt``): this rank's own had not come
        self._previous: dict[int, object] = {}

    def install(self, signals: tuple[str, ...] | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for name in signals or stop_signals():
            sig = getattr(signal, name)
            previous = signal.getsignal(sig)
            if previous == self._handle:
                continue
            earlier = getattr(previous, "__self__", None)
            if isinstance(earlier, PreemptionFlag):
                # A flag installed earlier in this process (the entry point's, during imports): take
                # over what it caught, and the handlers it replaced.
                if earlier.is_set() and self.signal_name is None:
                    self.signal_name, self.received_at = earlier.signal_name, earlier.received_at
                    self._event.set()
                previous = earlier._previous.get(sig, signal.SIG_DFL)
            self._previous[sig] = previous
            signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals back to the handlers that were there before (a second trainer in the
        same process installs its own flag); ``hand_over`` still finds them."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def hand_over(self) -> None:
        """After the checkpoint: give the signal to the launcher's requeue handler, if one was there
        before ours — submitit's (``checkpoint_and_try_requeue``: it requeues the job from global rank
        0 and exits there). submitit only bypasses SIGTERM, which preemption sends where the site
        does not send the user's signal: its requeue handler gets that signal too. A rank that stopped
        for another rank's signal (``adopt``) hands that one over: the requeue does not wait on its own.
        The entry point has called ``ignore_further`` already (before the trainer closed)."""
        if self.signal_name is None:
            return
        came = getattr(signal, self.signal_name, None)  # None for a stop asked without a signal
        requeue_sig = getattr(signal, signal_name(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")))
        for sig in (came, requeue_sig):
            previous = self._previous.get(sig) if sig is not None else None
            if callable(previous) and getattr(previous, "__name__", "") != "bypass":
                log.info("handing %s over to %s", self.signal_name, getattr(previous, "__qualname__", previous))
                previous(came if came is not None else requeue_sig, None)
                return

    def ignore_further(self) -> None:
        """The run stops for this signal and its process exits next: from here the stop signals are ignored.
        SLURM's later ones (a rank's own, arriving after the agreement; the second SIGTERM at the end of
        the grace time) must neither kill the exit (a SIGTERM would turn ``REQUEUE_EXIT_CODE`` into 143)
        nor, once ``uninstall`` gave them back, reach the requeue handler before or after ``hand_over``
        does (submitit's would requeue and exit twice). ``uninstall`` leaves them ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in stop_signals():
            signal.signal(getattr(signal, name), signal.SIG_IGN)

    def report(self) -> tuple[str, float] | None:
        """``(signal name, seconds since it came)`` on this rank, None before any: what ``adopt`` takes."""
        if self.received_at is None or self.signal_name is None:
            return None
        return self.signal_name, time.monotonic() - self.received_at

    def adopt(self, reports: list[tuple[str, float] | None]) -> None:
        """Take the earliest of the ranks' ``report``s when this rank has none of its own. SLURM signals
        every task at once, but a rank may reach the agreement before its own signal arrives; it then
        stops, says how long ago, and hands over (``hand_over``) the other rank's signal."""
        seen = [r for r in reports if r is not None]
        if self.received_at is not None or not seen:
            return
        name, age = max(seen, key=lambda r: r[1])
        self.signal_name, self.received_at, self.elsewhere = name, time.monotonic() - age, True
        self._event.set()

    def _handle(self, signum: int, frame) -> None:  # noqa: ANN001 - signal's signature
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.received_at = time.monotonic()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, name: str = "request") -> None:
        """Ask for a stop without a signal (tests, a watchdog)."""
        if self.signal_name is None:
            self.signal_name, self.received_at = name, time.monotonic()
        self._event.set()
