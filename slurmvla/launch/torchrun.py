"""``python -m slurmvla.launch.torchrun [TORCHRUN ARGS]``: torchrun (``torch.distributed.run``, run in this
process), except for a run that stopped for a requeue.

When every failed worker exited with ``REQUEUE_EXIT_CODE`` (the ranks checkpointed together and stopped for
a preemption or the time limit), torchrun's failure report (its "failed (exitcode: 75)" and "closing signal"
log lines and the ``ChildFailedError`` traceback naming each rank) reads as a crash. This says instead, in one line, at which step the run
stopped, and exits with ``REQUEUE_EXIT_CODE`` (torchrun would exit 1): the batch script requeues on it. Any
other failure, a worker's own code or a signal among them, keeps torchrun's full report and exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from slurmvla.launch.preempt import REQUEUE_EXIT_CODE, STOP_REPORT_ENV


class _HeldToTheEnd(logging.Filter):
    """Holds the agent's lines about workers that ended ("failed (exitcode: 75) local_rank: ...", "Sending
    process ... closing signal SIGTERM" to the ranks still exiting) until the run's outcome is known: dropped
    when every worker stopped for a requeue, else logged (``release``) before torchrun's report, as they came."""

    HELD = ("failed (exitcode", "Sending process")

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self.passing = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.passing or not str(record.msg).startswith(self.HELD):
            return True
        self.held.append(record)
        return False

    def release(self, logger: logging.Logger) -> None:
        self.passing = True
        for record in self.held:
            logger.handle(record)
        self.held = []


def requeue_line(step: str | None) -> str:
    where = f"at step {step} " if step else ""
    return (f"slurmvla: run stopped {where}for requeue (exit {REQUEUE_EXIT_CODE}); its checkpoint is saved and "
            "the same command resumes it")


def main(argv: list[str]) -> int:
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    held = _HeldToTheEnd()
    agent_log.addFilter(held)
    stopped_for_requeue = False
    try:
        with tempfile.TemporaryDirectory(prefix="slurmvla-torchrun-") as tmp:
            report = Path(tmp) / "stopped_at_step"
            os.environ[STOP_REPORT_ENV] = str(report)  # the workers inherit it (slurmvla.launch.preempt.report_stop)
            try:
                run.main(argv)
            except ChildFailedError as e:
                if not e.failures or any(f.exitcode != REQUEUE_EXIT_CODE for f in e.failures.values()):
                    raise
                stopped_for_requeue = True
                step = report.read_text().strip() if report.is_file() else None
                print(requeue_line(step), file=sys.stderr, flush=True)
                return REQUEUE_EXIT_CODE
        return 0
    finally:
        if not stopped_for_requeue:
            held.release(agent_log)
        agent_log.removeFilter(held)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
