"""The policy server: openpi's websocket protocol in front of an :class:`InferencePolicy` (``infer(obs) -> dict``).

The wire protocol is that of openpi's ``openpi-client`` package: on connect the server sends one
msgpack frame of metadata; each request is a msgpack observation dict (:mod:`slurmvla.inference.wire`);
each reply is the policy's dict (``actions``: float32 ``[action_horizon, action_dim]``) with
``server_timing`` added. A request the server cannot use (a ValueError from decoding or from the policy)
gets a text frame naming the key and what was expected, and that connection closes with code 1007 (as
openpi's server does); any other failure sends the traceback and closes with 1011; other connections go
on. ``GET /healthz`` answers 200, with or without a key.

Bounded: a request larger than the limit is refused as soon as its frame header announces the size,
before any of it is buffered: the connection closes with code 1009 (message too big), the server logs one
line naming the limit and the option, other connections go on. At most ``MAX_QUEUE`` frames wait per
connection while the policy runs (openpi's protocol is one request, one reply; a client that pipelines is
held back by TCP flow control).

Overload gets an answer, never an unbounded backlog: at most ``max_connections`` connections are served at
once; one more is refused at the HTTP handshake with 503 (Service Unavailable, ``Retry-After``) and a body
naming the limit and its option (openpi's client raises it as ``InvalidStatus``). At most ``max_pending``
requests, over all connections, are being answered or waiting for the policy at once; one more gets a text
frame saying so (openpi's client raises it) and its connection closes with code 1013 (try again later), so
a request admitted waits behind at most ``max_pending - 1`` others. Each refusal logs one line.

Closed to strangers: with an :class:`slurmvla.inference.auth.ApiKey` a connection must send
``Authorization: Api-Key <key>``; one without it, or with another key, is refused with HTTP 401 / 403
before the websocket opens.
"""

from __future__ import annotations

import asyncio
import http
import logging
import signal
import socket
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from slurmvla.inference.auth import DEFAULT_KEY_ENV, ApiKey, check_exposure, is_local
from slurmvla.inference.wire import packb, unpackb
from slurmvla.units import MiB

log = logging.getLogger("slurmvla.serve")

# Frames that may wait per connection before the server stops reading from it (websockets' max_queue).
MAX_QUEUE = 2
# The request-size limit of a policy that names none (not SupportsRequestLimit, or 0).
DEFAULT_MAX_REQUEST_BYTES = 64 * MiB
# The admission limits of a server given none (serve.max_connections, serve.max_pending have the same defaults).
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_PENDING = 32


@runtime_checkable
class InferencePolicy(Protocol):
    """What the server serves, as openpi's ``BasePolicy``: one observation in, a dict with ``actions`` out.
    A ValueError is the client's mistake (its message goes back to it).

    Its optional capabilities are protocols of their own, each one member (``CAPABILITIES``): a policy offers one
    by having it, and the server reads each through its protocol, once, when it is built:
    :class:`SupportsMetadata` (``metadata() -> dict``, sent on connect), :class:`SupportsSessions` (``session()``: a
    fresh :class:`InferencePolicy` for each connection, its own history of observations) and
    :class:`SupportsRequestLimit` (``max_request_bytes``, the request-size limit). So a plain object with ``infer``
    (and ``metadata``), openpi's way, is served as it is; :class:`slurmvla.inference.runner.PolicyRunner` offers
    all three."""

    def infer(self, obs: dict) -> dict: ...


@runtime_checkable
class SupportsMetadata(Protocol):
    """An :class:`InferencePolicy` that describes itself: ``metadata()`` is what a client gets on connect."""

    def metadata(self) -> dict: ...


@runtime_checkable
class SupportsSessions(Protocol):
    """An :class:`InferencePolicy` that keeps one connection's past: ``session()`` is called once per connection,
    and that connection's requests go to what it returns."""

    def session(self) -> InferencePolicy: ...


@runtime_checkable
class SupportsRequestLimit(Protocol):
    """An :class:`InferencePolicy` that names the largest request it accepts (bytes; 0: the server's default)."""

    max_request_bytes: int


# The optional capabilities of an InferencePolicy, each read through its protocol.
CAPABILITIES = (SupportsMetadata, SupportsSessions, SupportsRequestLimit)

P = TypeVar("P", bound=InferencePolicy)


class PolicyServer(Generic[P]):
    """``policy`` (an :class:`InferencePolicy`) on ``host:port``. ``metadata``: what clients get on connect
    (default: ``policy.metadata()`` where it :class:`SupportsMetadata`, else nothing); ``max_request_bytes``: the
    request-size limit (default: ``policy.max_request_bytes`` where it :class:`SupportsRequestLimit`, else
    ``DEFAULT_MAX_REQUEST_BYTES``); each connection's requests go to its own ``policy.session()`` where it
    :class:`SupportsSessions`, else to ``policy``; ``api_key_env``: the variable the
    messages about a server without a key name. Without ``api_key``, a ``host`` beyond this machine is refused
    (ValueError, :func:`slurmvla.inference.auth.check_exposure`) unless ``allow_unauthenticated``.
    ``max_connections``: connections served at once, one more is refused with HTTP 503; ``max_pending``:
    requests being answered or waiting at once, over all connections, one more is refused with a text frame
    and close code 1013."""

    def __init__(self, policy: P, host: str, port: int, workers: int = 4, api_key: ApiKey | None = None,
                 metadata: dict | None = None, max_request_bytes: int | None = None,
                 api_key_env: str | None = DEFAULT_KEY_ENV, allow_unauthenticated: bool = False,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, max_pending: int = DEFAULT_MAX_PENDING):
        if not isinstance(policy, InferencePolicy):
            raise TypeError(f"a PolicyServer serves an object with infer(obs) -> dict; {type(policy).__name__} has none")
        check_exposure(host, api_key, allow_unauthenticated, api_key_env)
        self.policy, self.host, self.port = policy, host, port
        self.api_key, self.api_key_env = api_key, api_key_env
        # The policy's optional capabilities, read through their protocols once: None where not offered.
        self._describe_policy = policy.metadata if isinstance(policy, SupportsMetadata) else None
        self._open_session = policy.session if isinstance(policy, SupportsSessions) else None
        self._metadata = metadata
        if max_request_bytes is None:
            own = policy.max_request_bytes if isinstance(policy, SupportsRequestLimit) else None
            max_request_bytes = own or DEFAULT_MAX_REQUEST_BYTES
        self.max_size = int(max_request_bytes)
        # Each >= 1: checked once, where serve.max_connections / serve.max_pending are read (ServeConfig).
        self.max_connections, self.max_pending = max_connections, max_pending
        self.workers = workers
        self.pool = self._new_pool()
        self.requests = 0
        # Admission, kept on the event loop's thread (no lock): the connections admitted at the handshake and
        # not yet closed, and the requests received and not yet answered.
        self.admitted: set = set()
        self.pending = 0
        self.refused_connections = self.refused_requests = 0

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="slurmvla-serve")

    def metadata(self) -> dict:
        if self._metadata is not None:
            return self._metadata
        return self._describe_policy() if self._describe_policy is not None else {}

    def _session(self) -> InferencePolicy:
        """What this connection's requests go to: its own session where the policy makes them, else the policy."""
        return self._open_session() if self._open_session is not None else self.policy

    def _describe(self) -> str:
        meta = self.metadata()
        if "source" in meta and "step" in meta:
            average = ", the moving average of its weights" if meta.get("weights") == "ema" else ""
            return f"{meta['source']} (step {meta['step']}{average})"
        return type(self.policy).__name__

    @staticmethod
    def _step(raw: Any, session: InferencePolicy) -> tuple[dict, float]:
        if isinstance(raw, str):
            raise ValueError("expected a binary msgpack frame, got a text frame")
        obs = unpackb(raw)
        start = time.monotonic()
        out = session.infer(obs)
        infer_ms = (time.monotonic() - start) * 1000
        if not isinstance(out, dict) or "actions" not in out:
            raise TypeError(f"the policy's infer returned {type(out).__name__}, not a dict with 'actions'")
        return out, infer_ms

    async def _handle(self, ws) -> None:
        try:
            await self._serve_connection(ws)
        finally:
            self.admitted.discard(ws)

    async def _serve_connection(self, ws) -> None:
        import websockets

        loop = asyncio.get_running_loop()
        peer = ws.remote_address
        session = self._session()
        await ws.send(packb(self.metadata()))
        prev_total_ms = None
        while True:
            try:
                raw = await ws.recv()
            except websockets.ConnectionClosed as e:
                if e.sent is not None and e.sent.code == websockets.frames.CloseCode.MESSAGE_TOO_BIG:
                    self._log_too_big(peer, getattr(ws.protocol, "parser_exc", None) or e.sent.reason)
                break
            start = time.monotonic()
            if self.pending >= self.max_pending:
                self.refused_requests += 1
                log.warning("refused a request from %s: %d requests are being answered or waiting, the limit "
                            "(serve.max_pending=%d); its connection closes with 1013 (try again later)", peer,
                            self.pending, self.max_pending)
                await self._refuse(ws, f"server busy: {self.pending} requests are already being answered or waiting, "
                                   f"the limit serve.max_pending={self.max_pending}; reconnect and try again later, or "
                                   "raise serve.max_pending (--max-pending N) on the server",
                                   websockets.frames.CloseCode.TRY_AGAIN_LATER)
                break
            self.pending += 1
            try:
                out, infer_ms = await loop.run_in_executor(self.pool, self._step, raw, session)
            except ValueError as e:
                log.warning("bad request from %s: %s", peer, e)
                await self._refuse(ws, f"bad request: {e}", websockets.frames.CloseCode.INVALID_DATA)
                break
            except Exception:
                log.exception("inference failed for %s", peer)
                await self._refuse(ws, traceback.format_exc(), websockets.frames.CloseCode.INTERNAL_ERROR)
                break
            finally:
                self.pending -= 1
            timing = {"infer_ms": infer_ms, "total_ms": (time.monotonic() - start) * 1000}
            if prev_total_ms is not None:
                timing["prev_total_ms"] = prev_total_ms
            try:
                await ws.send(packb({**out, "server_timing": timing}))
            except websockets.ConnectionClosed:
                break
            self.requests += 1
            prev_total_ms = (time.monotonic() - start) * 1000

    @staticmethod
    async def _refuse(ws, message: str, code) -> None:
        import websockets

        try:
            await ws.send(message)  # a text frame: openpi's client raises it as the server's error
            await ws.close(code=code, reason="see the previous frame")
        except websockets.ConnectionClosed:
            pass

    def _log_too_big(self, peer, why) -> None:
        log.warning("refused a request from %s: %s; this server accepts requests up to %.4g MiB (%d bytes): "
                    "serve.max_request_mb=MB (--max-request-mb MB) changes it", peer, why, self.max_size / MiB,
                    self.max_size)

    def _process_request(self, connection, request):
        """Before the websocket opens: the health check (open to all), then the API key, then room for one more
        connection."""
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        refused = self._check_key(connection, request)
        return refused if refused is not None else self._admit(connection)

    def _admit(self, connection):
        """Admitted (None) while fewer than ``max_connections`` are open, else HTTP 503 naming the limit."""
        from websockets.protocol import State

        # A connection whose handshake failed after this check never reaches the handler: dropped once closed.
        self.admitted = {c for c in self.admitted if c.protocol.state is not State.CLOSED}
        if len(self.admitted) < self.max_connections:
            self.admitted.add(connection)
            return None
        self.refused_connections += 1
        log.warning("refused a connection from %s: %d connections open, the limit (serve.max_connections=%d)",
                    connection.remote_address, len(self.admitted), self.max_connections)
        response = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                      f"server busy: {len(self.admitted)} connections open, the limit "
                                      f"serve.max_connections={self.max_connections}; try again later, or raise "
                                      "serve.max_connections (--max-connections N) on the server\n")
        response.headers["Retry-After"] = "1"
        return response

    def _check_key(self, connection, request):
        """None when the request carries the key (or none is needed), else the HTTP 401 / 403 refusal."""
        if self.api_key is None:
            return None
        header = request.headers.get("Authorization")
        if self.api_key.matches(header):
            return None
        peer = connection.remote_address
        if header is None:
            log.warning("refused a connection from %s: no API key (no Authorization header)", peer)
            response = connection.respond(http.HTTPStatus.UNAUTHORIZED, "this server needs an API key: send the "
                                          "header 'Authorization: Api-Key <key>' (openpi_client: "
                                          "WebsocketClientPolicy(host, port, api_key=...))\n")
            response.headers["WWW-Authenticate"] = "Api-Key"
            return response
        log.warning("refused a connection from %s: wrong API key", peer)
        return connection.respond(http.HTTPStatus.FORBIDDEN, "wrong API key\n")

    async def run(self, ready: threading.Event | None = None, stop: asyncio.Event | None = None) -> None:
        from websockets.asyncio.server import serve

        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (ValueError, RuntimeError):  # not the main thread (tests run the server in a thread)
                pass
        async with serve(self._handle, self.host, self.port, compression=None, max_size=self.max_size,
                         max_queue=MAX_QUEUE, process_request=self._process_request) as server:
            self.port = server.sockets[0].getsockname()[1]
            key = f"API key required (from {self.api_key.source})" if self.api_key is not None else "no API key"
            print(f"serving {self._describe()} on {address(self.host, self.port)}; health check: GET /healthz; {key}; "
                  f"requests up to {self.max_size / MiB:.4g} MiB; at most {self.max_connections} connections and "
                  f"{self.max_pending} pending requests", flush=True)
            if self.api_key is None and not is_local(self.host):
                log.warning("listening on %s without an API key (serve.allow_unauthenticated=true): anyone who can reach "
                            "this port can drive the policy; export %s (or set serve.api_key_file) and pass it to the client "
                            "(WebsocketClientPolicy(host, port, api_key=...))", self.host or "every interface",
                            self.api_key_env or DEFAULT_KEY_ENV)
            if ready is not None:
                ready.set()
            await stop.wait()
        # Its requests finished, the pool's threads end; a later run (the closed loop serves one server for
        # several sets of episodes) gets a new pool.
        self.pool.shutdown(wait=True)
        self.pool = self._new_pool()


def address(host: str, port: int) -> str:
    """The address a client connects to: this node's name and IP when listening on every interface."""
    if host not in ("0.0.0.0", "::", ""):
        return f"ws://{host}:{port}"
    name = socket.gethostname()
    try:
        ip = socket.gethostbyname(name)
    except OSError:
        ip = "?"
    return f"ws://{name}:{port} (ws://{ip}:{port})"
