"""A policy for runs that must last, not compute: the sound control of tests/broken_policies.py, each forward
holding the step for ``pace_s`` of wall time while the process sleeps.

The long SLURM runs (a preemption decided within a scheduling interval has to land in their middle; a node
has to be lost mid-run) need about fifteen seconds of training on two nodes; with the reference policy those
seconds were its computation (29 ms of CPU a step on one process against this policy's 5 ms). Everything they
test (signals, checkpoints, requeue, resume to the weights of an uninterrupted run) is the trainer's and the
launcher's, whatever the policy; the reference policy trains on SLURM in the other tests there.
"""

from __future__ import annotations

import time

from tests.broken_policies import Sound


class Paced(Sound):
    def __init__(self, cfg, stats=None, width: int = 32, pace_s: float = 0.03):  # noqa: ANN001
        super().__init__(cfg, stats, width)
        self.pace_s = pace_s

    def forward(self, batch: dict) -> dict:
        time.sleep(self.pace_s)
        return super().forward(batch)
