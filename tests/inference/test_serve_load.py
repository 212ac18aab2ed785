"""The policy server under several clients at once, driven by openpi's published client: every request gets
exactly one reply, in order, equal to what the policy computes for that observation alone; clients that
disconnect mid-request or send garbage do not disturb the others; overload gets an explicit answer
(``serve.max_connections``: HTTP 503; ``serve.max_pending``: a text frame and close code 1013), never a wait.

Invariants only, no timings. Each server runs in a thread of this process (``serving_in_thread``), stopped on
the way out, also on failure; a policy that holds a request is released in ``finally`` first.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from slurmvla.inference.harness import serving_in_thread
from slurmvla.inference.server import PolicyServer
from slurmvla.inference.wire import packb

wcp = pytest.importorskip("openpi_client.websocket_client_policy", reason="pip install --no-deps openpi-client")
websockets = pytest.importorskip("websockets")

WAIT_S = 30  # the most any step waits for the server (a bound against hanging, not a timing)


class Echo:
    """A policy whose answer encodes its input: row 0 is (client, seq, sum of x), the rest a fixed function
    of x; so a reply can only equal ``infer`` of the observation it answers. An observation with ``hold``
    waits for :attr:`release` (set by the test) after signalling :attr:`held`."""

    def __init__(self):
        self.held, self.release = threading.Event(), threading.Event()

    def infer(self, obs: dict) -> dict:
        if not isinstance(obs, dict) or "x" not in obs:
            raise ValueError("a request must be a dict with key 'x'")
        if obs.get("hold"):
            self.held.set()
            if not self.release.wait(WAIT_S):
                raise RuntimeError("never released")
        x = np.asarray(obs["x"], np.float64)
        actions = np.empty((4, 3), np.float32)
        actions[0] = [obs["client"], obs["seq"], x.sum()]
        actions[1:] = np.outer(np.arange(1, 4), x[:3]) + x[3:].prod()
        return {"actions": actions}


def observation(client: int, seq: int, **extra) -> dict:
    x = np.random.default_rng([client + 1000, seq]).normal(size=6)
    return {"client": client, "seq": seq, "x": x, "prompt": f"task {client}", **extra}


def close(client) -> None:
    client._ws.close()  # openpi's client has no close of its own


def run_clients(port: int, policy: Echo, clients: int, requests: int) -> list[BaseException]:
    """``clients`` openpi clients in threads, started together, each sending ``requests`` distinct
    observations; asserts each reply is the policy's for the observation sent just before it. Returns
    the errors (assertions included) raised in the threads."""
    errors: list[BaseException] = []
    start = threading.Barrier(clients)

    def run(c: int) -> None:
        try:
            client = wcp.WebsocketClientPolicy("127.0.0.1", port)
            start.wait(WAIT_S)
            try:
                for seq in range(requests):
                    obs = observation(c, seq)
                    reply = client.infer(obs)
                    assert reply["actions"][0, :2].tolist() == [c, seq], (c, seq, reply["actions"][0])
                    np.testing.assert_array_equal(reply["actions"], policy.infer(obs)["actions"])
            finally:
                close(client)
        except BaseException as e:  # noqa: BLE001 - reported in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 4)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return errors


def settled(server: PolicyServer) -> bool:
    """Whether every connection's slot and every request's count was given back (the server sees a close a
    moment after the client does)."""
    deadline = time.monotonic() + WAIT_S
    while server.admitted or server.pending:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_concurrent_openpi_clients_each_get_every_reply_in_order():
    policy = Echo()
    server = PolicyServer(policy, "127.0.0.1", 0)
    with serving_in_thread(server) as port:
        errors = run_clients(port, policy, clients=8, requests=20)
        assert not errors, errors
        assert server.requests == 8 * 20  # exactly one reply per request
        assert settled(server), (server.admitted, server.pending)
    assert server.refused_connections == server.refused_requests == 0


def _raw(port: int):
    from websockets.sync.client import connect

    ws = connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None)
    ws.recv(timeout=WAIT_S)  # metadata
    return ws


def _error_of(port: int, frame) -> str:
    """The text frame a bad frame gets, after which the server closes the connection."""
    with _raw(port) as ws:
        ws.send(frame)
        reply = ws.recv(timeout=WAIT_S)
        assert isinstance(reply, str), "a bad frame must get a text frame"
        with pytest.raises(websockets.ConnectionClosed) as e:
            ws.recv(timeout=WAIT_S)
        assert e.value.rcvd is not None and e.value.rcvd.code in (1007, 1011), e.value
        return reply


def test_clients_that_vanish_or_send_garbage_do_not_disturb_the_others():
    policy = Echo()
    server = PolicyServer(policy, "127.0.0.1", 0)
    try:
        with serving_in_thread(server) as port:
            results: list = []
            good = threading.Thread(target=lambda: results.append(run_clients(port, policy, clients=6, requests=15)),
                                    daemon=True)
            good.start()
            # A request whose client closes before its reply: the policy holds it until the client is gone.
            ws = _raw(port)
            ws.send(packb(observation(99, 0, hold=True)))
            assert policy.held.wait(WAIT_S)
            ws.close()
            policy.release.set()
            # Frames that are no observation: random bytes, a text frame, a truncated msgpack, not a dict.
            junk = np.random.default_rng(0).bytes(64)
            assert "bad request" in _error_of(port, junk)
            assert "text frame" in _error_of(port, "hello")
            assert "not a msgpack frame" in _error_of(port, packb(observation(98, 0))[:-7])
            assert "a dict with key 'x'" in _error_of(port, packb([1, 2, 3]))
            # Not even HTTP: bytes on the socket, then gone.
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as raw:
                raw.sendall(junk + b"\r\n\r\n")
                raw.recv(4096)  # the server answers (400) or closes; either way it goes on
            good.join(WAIT_S * 5)
            assert not good.is_alive(), "the well-behaved clients hung"
            assert results == [[]], results  # every well-behaved request answered, correctly and in order
            # A new connection is served afterwards, and nothing was left behind.
            client = wcp.WebsocketClientPolicy("127.0.0.1", port)
            obs = observation(7, 3)
            np.testing.assert_array_equal(client.infer(obs)["actions"], policy.infer(obs)["actions"])
            close(client)
            assert settled(server), (server.admitted, server.pending)
            assert server.requests == 6 * 15 + 1
    finally:
        policy.release.set()


def test_a_connection_beyond_max_connections_is_refused_with_503_naming_the_option():
    policy = Echo()
    server = PolicyServer(policy, "127.0.0.1", 0, max_connections=2)
    with serving_in_thread(server) as port:
        first, second = (wcp.WebsocketClientPolicy("127.0.0.1", port) for _ in range(2))
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            wcp.WebsocketClientPolicy("127.0.0.1", port)
        response = e.value.response
        body = bytes(response.body).decode()
        assert response.status_code == 503 and response.headers["Retry-After"] == "1", response
        assert "serve.max_connections=2" in body and "--max-connections" in body, body
        # The health check is not a connection; the two admitted are served as before.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=WAIT_S) as r:
            assert r.status == 200
        for client, c in ((first, 0), (second, 1)):
            obs = observation(c, 0)
            np.testing.assert_array_equal(client.infer(obs)["actions"], policy.infer(obs)["actions"])
        # A closed connection gives its slot back.
        close(first)
        assert settled_to(server, 1)
        third = wcp.WebsocketClientPolicy("127.0.0.1", port)
        obs = observation(2, 0)
        np.testing.assert_array_equal(third.infer(obs)["actions"], policy.infer(obs)["actions"])
        close(second)
        close(third)
        assert server.refused_connections == 1


def test_the_rollout_client_waits_for_a_busy_server_and_names_it_when_it_stays_busy():
    """A closed-loop client (``slurmvla.inference.closed_loop.connect``) refused with 503 tries again after the
    server's Retry-After until a slot frees; a server that stays full is one ValueError naming the limit."""
    from slurmvla.inference.closed_loop import connect

    policy = Echo()
    server = PolicyServer(policy, "127.0.0.1", 0, max_connections=1)
    with serving_in_thread(server) as port:
        holder = wcp.WebsocketClientPolicy("127.0.0.1", port)
        with pytest.raises(ValueError, match=r"stayed busy .*serve\.max_connections=1"):
            connect("127.0.0.1", port, timeout_s=0.5)
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(connect("127.0.0.1", port, timeout_s=WAIT_S)))
        refused = server.refused_connections
        waiting.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while server.refused_connections == refused:  # refused at least once while the slot is held
                assert time.monotonic() < deadline and waiting.is_alive()
                time.sleep(0.02)
        finally:
            close(holder)
            waiting.join(WAIT_S)
        assert len(got) == 1, "the waiting client never connected"
        obs = observation(0, 0)
        np.testing.assert_array_equal(got[0].infer(obs)["actions"], policy.infer(obs)["actions"])
        close(got[0])


def settled_to(server: PolicyServer, connections: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while len(server.admitted) > connections:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_request_beyond_max_pending_is_refused_at_once_with_1013():
    """One request held by the policy fills serve.max_pending=1: another client's request is answered with a
    text frame naming the option and its connection closes with 1013 (try again later), while the held one
    is still running; released, the held request gets its own reply, and the next request is served."""
    policy = Echo()
    server = PolicyServer(policy, "127.0.0.1", 0, max_pending=1)
    try:
        with serving_in_thread(server) as port:
            held_reply: list = []
            holder = wcp.WebsocketClientPolicy("127.0.0.1", port)
            held_obs = observation(0, 0, hold=True)
            thread = threading.Thread(target=lambda: held_reply.append(holder.infer(held_obs)), daemon=True)
            thread.start()
            assert policy.held.wait(WAIT_S)
            other = wcp.WebsocketClientPolicy("127.0.0.1", port)
            with pytest.raises(RuntimeError, match="serve.max_pending=1") as e:
                other.infer(observation(1, 0))
            assert "--max-pending" in str(e.value) and "try again later" in str(e.value)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                other._ws.recv(timeout=WAIT_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013, closed.value
            assert not held_reply  # refused while the held request was still running, not after it
            policy.release.set()
            thread.join(WAIT_S)
            np.testing.assert_array_equal(held_reply[0]["actions"], policy.infer(held_obs)["actions"])
            retry = wcp.WebsocketClientPolicy("127.0.0.1", port)
            obs = observation(1, 0)
            np.testing.assert_array_equal(retry.infer(obs)["actions"], policy.infer(obs)["actions"])
            for client in (holder, retry):
                close(client)
            assert server.refused_requests == 1 and server.requests == 2
    finally:
        policy.release.set()


@pytest.mark.parametrize("kwargs", [{"max_connections": 0}, {"max_pending": -1}, {"max_pending": 1.5},
                                    {"max_connections": True}])
def test_bad_admission_limits_are_refused_naming_the_value_and_range(kwargs):
    """The one check of the admission limits: the schema's (the server is handed them from it)."""
    from slurmvla.config.serve import ServeConfig

    [(name, value)] = kwargs.items()
    with pytest.raises(ValueError, match=f"serve.{name}={value!r} is not valid: give an integer >= 1"):
        ServeConfig(**kwargs)


@pytest.mark.parametrize("args, expected", [
    (["--max-connections", "0"], "serve.max_connections=0 is not valid: give an integer >= 1 (default 64)"),
    (["--max-pending", "many"], "argument --max-pending: invalid int value: 'many'"),
])
def test_bad_admission_flags_fail_at_start_with_one_line(capsys, args, expected):
    """A flag's value is checked as its option's (serve.max_connections, serve.max_pending), before anything loads."""
    from slurmvla import serve

    with pytest.raises(SystemExit) as e:
        serve.main(["/no/such/run", "--host", "127.0.0.1", "--port", "0", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err, err


@pytest.mark.parametrize("override, expected", [
    ("serve.max_pending=0", "serve.max_pending=0 is not valid: give an integer >= 1 (default 32)"),
    ("serve.max_connections=-3", "serve.max_connections=-3 is not valid: give an integer >= 1 (default 64)"),
    ("serve.max_connections=lots", "serve.max_connections='lots' is not valid"),
])
def test_bad_admission_overrides_are_refused_naming_the_value_and_range(override, expected):
    """What ``python -m slurmvla.serve RUN serve.max_pending=0`` composes first (and ends with one line)."""
    from slurmvla.compose import compose

    with pytest.raises(ValueError) as e:
        compose([override])
    assert expected in str(e.value) and "\n" not in str(e.value), e.value


def test_the_admission_options_reach_the_server(trained_run):
    from slurmvla.inference.build import build_server

    server = build_server(str(trained_run), ["serve.host=127.0.0.1", "serve.port=0", "serve.max_connections=5",
                                             "serve.max_pending=3"], device="cpu", environ={})
    try:
        assert (server.max_connections, server.max_pending) == (5, 3)
    finally:
        server.pool.shutdown()
