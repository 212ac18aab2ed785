"""A policy server in a thread of this process: the closed loop's local server, the benchmarks and the tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from slurmvla.inference.server import PolicyServer


@contextlib.contextmanager
def serving_in_thread(server: PolicyServer, timeout_s: float = 60.0):
    """Run ``server`` in a thread of this process (the closed loop's local server, the tests); yields its
    port once it listens and stops it and its thread on the way out, also on failure. A server that
    cannot listen is a ValueError naming why."""
    ready, loop, stop, failure = threading.Event(), asyncio.new_event_loop(), [], []

    def run() -> None:
        try:
            stop.append(asyncio.Event())
            loop.run_until_complete(server.run(ready, stop[0]))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            failure.append(e)
            ready.set()

    thread = threading.Thread(target=run, name="slurmvla-serve-thread", daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout_s) or failure:
            raise ValueError(f"the policy server did not start on {server.host}:{server.port}: "
                             f"{failure[0] if failure else f'not listening after {timeout_s:g} s'}")
        yield server.port
    finally:
        if stop:
            loop.call_soon_threadsafe(stop[0].set)
        thread.join(timeout_s)
        loop.close()

