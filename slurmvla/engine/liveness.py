"""Which rank stopped: a heartbeat per rank in the job's rendezvous store, read when a collective fails.

A collective that times out says only that *it* timed out (gloo: "Timed out waiting 10000ms for
recv operation"), not which peer never came. Every rank therefore publishes ``(time, step, host,
pid)`` to the rendezvous store from a daemon thread every ``period_s``, over its own client
connection (the process group's is never shared with a thread). A process stopped by SIGSTOP, frozen
by its node or cut off from the network stops publishing; one stuck in its own code keeps
publishing but stops counting steps. After a failure, :meth:`Heartbeats.diagnose` names both.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import threading
import time

import torch.distributed as dist

from slurmvla.errors import Failure
from slurmvla.launch import DistEnv

log = logging.getLogger("slurmvla")

PREFIX = "slurmvla/alive/"


class CollectiveFailure(Failure):
    """A collective failed (timed out, or a peer went away); the message names the ranks to blame."""


def is_collective_failure(error: BaseException) -> bool:
    """A collective or the rendezvous failed (a timeout, a peer gone), as opposed to a bug."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                            "Broken pipe", "gloo/transport"))


class Heartbeats:
    def __init__(self, env: DistEnv, period_s: float = 2.0, connect_timeout_s: float = 30.0):
        self.env, self.period_s = env, period_s
        self.step = 0  # set by the trainer after every step; read by the thread
        self._stop = threading.Event()
        host, port = os.environ.get("MASTER_ADDR", env.master_addr), int(os.environ.get("MASTER_PORT", env.master_port))
        self.where = f"{host}:{port}"
        # A client of the store the process group rendezvoused through (torchrun's agent, or rank 0's).
        self._store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=connect_timeout_s))
        self._me = {"host": socket.gethostname(), "pid": os.getpid()}
        self._publish()
        self._thread = threading.Thread(target=self._run, name="slurmvla-heartbeat", daemon=True)
        self._thread.start()

    def _publish(self) -> None:
        self._store.set(f"{PREFIX}{self.env.rank}", json.dumps({**self._me, "time": time.time(), "step": self.step}))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._publish()
            except Exception:  # the store is gone: the job is ending; nothing left to report to
                return

    def stop(self) -> None:
        """End the thread and drop the store connection (before the process group goes)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s)
        self._store = None

    def _read(self, timeout_s: float) -> tuple[float, dict[int, dict], list[int]]:
        self._store.set_timeout(datetime.timedelta(seconds=timeout_s))
        beats, missing = {}, []
        for rank in range(self.env.world_size):
            key = f"{PREFIX}{rank}"
            if self._store.check([key]):
                beats[rank] = json.loads(self._store.get(key))
            else:
                missing.append(rank)
        return time.time(), beats, missing

    def diagnose(self, timeout_s: float = 5.0) -> str:
        """One sentence on the other ranks: those that stopped publishing (stopped, frozen, or their
        node lost) and those whose step lags the rest (hung in their own code). A peer that died a
        moment ago (connection reset) still looks fresh: wait up to three periods for it to go stale."""
        if self._store is None:
            return "no heartbeats (stopped)"
        stale_after = 3 * self.period_s
        try:
            end = time.monotonic() + stale_after + self.period_s
            while True:
                now, beats, missing = self._read(timeout_s)
                stale = any(r != self.env.rank and now - b["time"] > stale_after for r, b in beats.items())
                if stale or missing or time.monotonic() > end:
                    break
                time.sleep(0.5)
        except Exception as e:
            return f"the rendezvous store at {self.where} cannot be read ({type(e).__name__}): its node may be lost"
        said = []
        for rank, beat in sorted(beats.items()):
            age = now - beat["time"]
            if rank != self.env.rank and age > stale_after:
                said.append(f"rank {rank} (host {beat['host']}, pid {beat['pid']}) last seen {age:.0f} s ago at step "
                            f"{beat['step']}: stopped, frozen, or its node lost")
        steps = {rank: beat["step"] for rank, beat in beats.items()}
        ahead = max(steps.values(), default=0)
        behind = [r for r, s in steps.items() if s < ahead and now - beats[r]["time"] <= stale_after]
        if behind:
            said.append("ranks " + ", ".join(f"{r} (step {steps[r]})" for r in behind)
                        + f" are alive but behind step {ahead}: hung in their own code")
        if missing:
            said.append(f"ranks {missing} never reported")
        return "; ".join(said) or f"every rank is alive (steps {sorted(set(steps.values()))}): a network fault"
