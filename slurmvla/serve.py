"""Serve a trained policy to robots over openpi's websocket protocol.

    python -m slurmvla.serve SOURCE [--host H] [--port 8000] [--max-request-mb MB] [overrides ...]

``SOURCE``: a file written by ``python -m slurmvla.export``, a checkpoint folder, a run directory
or a LeRobot pi0 / pi0.5 checkpoint directory (its weights, statistics and config). Overrides change the run's config (``serve.cameras=[...]``, ``policy.num_inference_steps=5``).

The wire protocol is that of openpi's ``openpi-client`` package: on connect the server sends one
msgpack frame of metadata; each request is a msgpack observation dict whose numpy arrays are maps
``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape}``; each reply
is a msgpack dict with ``actions`` (float32 ``[action_horizon, action_dim]``, raw dataset units)
and ``server_timing``. A request the server cannot use gets a text frame naming the key and what was
expected, and that connection closes (as openpi's server does); other connections go on. ``GET
/healthz`` answers 200, with or without a key. No pickle: arrays are rebuilt from raw bytes with numeric
dtypes only.

Bounded: a request larger than ``serve.max_request_mb`` (``--max-request-mb``) is refused as soon as its
frame header announces the size, before any of it is buffered: the connection closes with code 1009
(message too big), the server logs one line naming the limit and the option, other connections go on.
The default limit is derived from the policy (:func:`default_max_request_bytes`): 4 x one observation
(each camera the client sends counted at the policy's image size or as a 1280 x 720 RGB uint8 frame,
whichever is larger, plus the state as float64 and 64 KiB of prompt), plus 16 MiB. At most
``MAX_QUEUE`` frames wait per connection while the policy runs (openpi's protocol is one request, one
reply; a client that pipelines is held back by TCP flow control).

Closed to strangers: with an API key (``serve.api_key_env``, default ``$SLURMVLA_API_KEY``, and/or
``serve.api_key_file``) a connection must send ``Authorization: Api-Key <key>`` (what openpi's
``WebsocketClientPolicy(host, port, api_key=...)`` sends); one without it, or with another key, is
refused with HTTP 401 / 403 before the websocket opens. The key is never logged, never sent back and
never part of the config. The default host stays 0.0.0.0 (every interface: robots connect from other
machines, and ``sbatch/serve.sh`` prints the node's address for them); listening beyond localhost
without a key is allowed but warned about at start-up.

Observations map to the policy's inputs through ``serve.*`` (:class:`slurmvla.config.ServeConfig`),
and are prepared by the functions training uses (:mod:`slurmvla.data.prepare`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hmac
import http
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from slurmvla.compose import ArgumentParser
from slurmvla.data.prepare import observation_batch, prepare_image
from slurmvla.export import Loaded, load_exported
from slurmvla.policy.base import seeded_sample_actions
from slurmvla.policy.graphed import inference_sampler, lower_weights

log = logging.getLogger("slurmvla.serve")

# dtype kinds a request may carry: bool, signed / unsigned integers, floats. Object, void and
# complex arrays are refused (an object array rebuilt from raw bytes would be raw pointers).
NUMERIC_KINDS = "biuf"

# The default request-size limit (default_max_request_bytes): each camera counted as at least one
# 1280 x 720 RGB uint8 frame (a raw camera frame; DROID's are 180 x 320, openpi's clients send
# 224 x 224), 64 KiB of prompt, times MARGIN, plus HEADROOM.
CAMERA_FRAME_BYTES = 1280 * 720 * 3
PROMPT_BYTES = 64 * 1024
MARGIN = 4
HEADROOM = 16 * 2**20
MiB = 2**20
# Frames that may wait per connection before the server stops reading from it (websockets' max_queue).
MAX_QUEUE = 2
# What the default serve.api_key_env names: this one may be unset (no key); another name must be set.
DEFAULT_KEY_ENV = "SLURMVLA_API_KEY"
AUTH_SCHEME = "api-key"


class BadRequest(ValueError):
    """A request the server cannot use; its message goes back to the client."""


# -- openpi's msgpack-numpy encoding ------------------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in NUMERIC_KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        try:
            dtype = np.dtype(obj[b"dtype"])
            if dtype.kind not in NUMERIC_KINDS:
                raise ValueError(f"dtype {dtype} is not numeric")
            return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"an array in the request cannot be decoded ({e})") from None
    if b"__npgeneric__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind not in NUMERIC_KINDS:
            raise BadRequest(f"a scalar in the request has dtype {dtype}, which is not numeric")
        return dtype.type(obj[b"data"])
    return obj


def packb(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook)
    except BadRequest:
        raise
    except Exception as e:  # msgpack's own errors: truncated, garbage or trailing bytes
        raise ValueError(f"the request is not a msgpack frame ({type(e).__name__}: {e})") from None


# -- observations -> the policy's inputs --------------------------------------------------------


class PolicyRunner:
    """The loaded policy and the mapping from client keys to its inputs. ``infer`` is thread-safe:
    requests are prepared concurrently, the model runs one request at a time."""

    def __init__(self, loaded: Loaded, sampler: Any = None):
        cfg = loaded.cfg
        self.loaded, self.cfg = loaded, cfg
        self.policy = loaded.policy
        self.device = next(iter(self.policy.parameters()), torch.empty(0)).device
        self.spec = type(self.policy).sample_spec(cfg.policy)
        serve, cameras = cfg.serve, list(cfg.data.cameras)
        if len(serve.cameras) != len(cameras):
            raise ValueError(f"serve.cameras={list(serve.cameras)} has {len(serve.cameras)} entries but the policy "
                             f"reads {len(cameras)} cameras (data.cameras={cameras}); give one client key (or null "
                             "for a camera the client does not send) per camera, in that order")
        self.camera_keys = list(serve.cameras)
        self.history = cfg.data.history_interval * (self.spec.num_obs_history - 1) + 1
        self.lock = threading.Lock()
        self.fresh = np.random.default_rng()  # serve.seed=null: a new noise seed per request
        autocast = cfg.precision == "bf16" and self.device.type == "cuda"
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else None
        # What sample_actions is called on: the policy, or (build_server, under serve.cuda_graph) its graphs.
        self.sampler = sampler if sampler is not None else self.policy

    def metadata(self) -> dict:
        pc = self.cfg.policy
        return {
            "server": "slurmvla", "policy": pc.target or pc.name, "step": self.loaded.step, "source": self.loaded.source,
            "action_horizon": pc.action_horizon, "action_dim": pc.action_dim, "image_size": self.spec.image_size,
            "cameras": {cam: key for cam, key in zip(self.cfg.data.cameras, self.camera_keys)},
            "state": list(self.cfg.serve.state), "prompt": self.cfg.serve.prompt, "seed": self.cfg.serve.seed,
            "max_request_bytes": self.max_request_bytes,
        }

    def observation_bytes(self, camera_bytes: int = 0) -> int:
        """One observation's size on the wire, roughly: every camera the client sends at the policy's
        image size (or ``camera_bytes``, whichever is larger), the state as float64, the prompt."""
        size = self.spec.image_size or self.cfg.policy.image_size or 0
        per_camera = max(size * size * 3, camera_bytes)
        cameras = sum(1 for key in self.camera_keys if key)
        return cameras * per_camera + 8 * self.cfg.policy.state_dim + PROMPT_BYTES

    @property
    def max_request_bytes(self) -> int:
        """The largest request accepted: ``serve.max_request_mb``, else :func:`default_max_request_bytes`."""
        mb = self.cfg.serve.max_request_mb
        return int(mb * MiB) if mb is not None else default_max_request_bytes(self)

    def read(self, obs: Any) -> tuple[list[np.ndarray], np.ndarray, str]:
        """Prepared images (one per camera, None where padded), raw state and prompt of one request;
        a ValueError names the key and what was expected."""
        serve = self.cfg.serve
        if not isinstance(obs, dict):
            raise ValueError(f"a request must be a dict of observations, got {type(obs).__name__}")
        needed = [k for k in self.camera_keys if k] + list(serve.state) + [serve.prompt]
        missing = [k for k in needed if k not in obs]
        if missing:
            raise ValueError(f"missing key {missing[0]!r}: this server reads {needed}; the request has "
                             f"{sorted(map(str, obs))}")
        size = self.spec.image_size
        mode = self.cfg.data.image_resize
        images = [None if key is None else prepare_image(obs[key], size, name=key, mode=mode) for key in self.camera_keys]
        parts = []
        for key in serve.state:
            value = np.asarray(obs[key])
            if value.dtype.kind not in "biuf":
                raise ValueError(f"{key}: expected numbers, got dtype {value.dtype}")
            parts.append(value.astype(np.float32).reshape(-1))
        state = np.concatenate(parts)
        want = self.cfg.policy.state_dim
        if state.shape[0] != want:
            got = ", ".join(f"{k}: {p.shape[0]}" for k, p in zip(serve.state, parts))
            raise ValueError(f"state keys {list(serve.state)} give {state.shape[0]} values ({got}); the policy's state "
                             f"has {want} (policy.state_dim)")
        if not np.isfinite(state).all():
            raise ValueError(f"state keys {list(serve.state)} hold NaN or inf: {state.tolist()}")
        prompt = obs[serve.prompt]
        if isinstance(prompt, bytes):
            prompt = prompt.decode("utf-8", errors="replace")
        if not isinstance(prompt, str):
            raise ValueError(f"{serve.prompt}: expected a string, got {type(prompt).__name__}")
        return images, state, prompt

    def _frame_shape(self, past: collections.deque) -> tuple[int, int, int]:
        """One frame's shape: the policy's size, or (a policy that resizes frames itself) the size the
        client sent, which every camera of every kept observation must share."""
        if self.spec.image_size is not None:
            return (self.spec.image_size,) * 2 + (3,)
        shapes = {img.shape for cams, _, _ in past for img in cams if img is not None}
        if len(shapes) > 1:
            keys = [k for k in self.camera_keys if k]
            raise ValueError(f"the images of {keys} differ in size ({sorted(shapes)}); this policy resizes them itself "
                             "and needs one size per request: send every camera at one size (e.g. 224 x 224)")
        return next(iter(shapes), (self.cfg.policy.image_size,) * 2 + (3,))

    def batch(self, past: collections.deque) -> dict:
        """The policy's batch of one from this connection's observations (newest last): the history
        frames training would take, the ones before the first observation masked (as in training)."""
        n, interval = self.spec.num_obs_history, self.cfg.data.history_interval
        images, mask, states = [], [], []
        shape = self._frame_shape(past)
        for k in range(n - 1, -1, -1):
            i = len(past) - 1 - k * interval
            ok = i >= 0
            cams, state, prompt = past[max(i, 0)]
            for img in cams:
                images.append(np.zeros(shape, np.uint8) if img is None else img)
                mask.append(ok and img is not None)
            states.append(state)
        state = states[0] if n == 1 else np.stack(states)
        return observation_batch(images, mask, state, past[-1][2], self.spec)

    @torch.no_grad()
    def infer(self, batch: dict) -> np.ndarray:
        """The action chunk ``[action_horizon, action_dim]`` float32 in dataset units. Noise is drawn on the
        CPU, seeded by ``serve.seed`` for each request: the same observation always gives the same chunk,
        on any server and device (up to the device's precision). ``serve.seed=null``: fresh noise for each
        request (as openpi's server), from a generator seeded once from the OS."""
        batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with self.lock, (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
            seed = self.cfg.serve.seed if self.cfg.serve.seed is not None else int(self.fresh.integers(2**62))
            actions = seeded_sample_actions(self.sampler, self.spec, batch, seed)
        return actions[0].float().cpu().numpy()


def default_max_request_bytes(runner: PolicyRunner) -> int:
    """The default request-size limit: ``MARGIN`` (4) x one observation, each camera the client sends
    counted at the policy's image size or as a raw 1280 x 720 RGB uint8 camera frame, whichever is
    larger, plus the state (float64) and 64 KiB of prompt; plus ``HEADROOM`` (16 MiB). For openpi's
    DROID client (2 cameras) that is about 37 MiB; ``serve.max_request_mb`` sets another limit."""
    return MARGIN * runner.observation_bytes(CAMERA_FRAME_BYTES) + HEADROOM


# -- API key ------------------------------------------------------------------------------------


class ApiKey:
    """The key a client must send (``Authorization: Api-Key <key>``), and where it came from. Its
    repr and str never show the key."""

    def __init__(self, key: str, source: str):
        self._key, self.source = key.encode("ascii"), source

    def matches(self, header: str | None) -> bool:
        scheme, _, given = (header or "").strip().partition(" ")
        given_bytes = given.strip().encode("utf-8", "replace")
        # Compared in constant time, and always compared, whatever the scheme.
        same = hmac.compare_digest(given_bytes, self._key)
        return same and scheme.lower() == AUTH_SCHEME

    def __repr__(self) -> str:
        return f"ApiKey(from {self.source})"

    __str__ = __repr__


def _check_key(key: str, source: str) -> str:
    key = key.strip()
    if not key:
        raise ValueError(f"{source} holds an empty API key; put the key in it (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'), or leave it unset to serve without a key")
    if not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(f"the API key in {source} holds spaces, control or non-ASCII characters, which an HTTP "
                         "header cannot carry as is; use printable ASCII (e.g. secrets.token_urlsafe(32))")
    return key


def read_api_key(serve, environ=None) -> ApiKey | None:
    """The key from ``serve.api_key_file`` and/or the variable ``serve.api_key_env`` names (None: no
    key). A file that cannot be read, an empty key, a non-default variable that is unset, or two
    sources holding different keys: ValueError naming the source (never the key)."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, str]] = []
    if serve.api_key_env is not None:
        source = f"${serve.api_key_env}"
        if serve.api_key_env in env:
            found.append((_check_key(env[serve.api_key_env], source), source))
        elif serve.api_key_env != DEFAULT_KEY_ENV:
            raise ValueError(f"serve.api_key_env={serve.api_key_env} names a variable that is not set in the server's "
                             f"environment; export it (sbatch passes the submitting shell's environment), or set "
                             f"serve.api_key_env=null")
    if serve.api_key_file is not None:
        path = os.path.expanduser(serve.api_key_file)
        source = f"serve.api_key_file={serve.api_key_file}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(64 * 1024)
            mode = os.stat(path).st_mode
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ValueError(f"{source}: cannot read the API key file ({why}); give a readable file holding the key "
                             f"(chmod 600), or serve.api_key_file=null") from None
        found.append((_check_key(text, source), source))
        if mode & 0o077:
            log.warning("%s can be read by other users (mode %o); chmod 600 it", source, mode & 0o777)
    if len(found) == 2 and found[0][0] != found[1][0]:
        raise ValueError(f"{found[0][1]} and {found[1][1]} hold different API keys; give one of them (or the same key)")
    return ApiKey(found[-1][0], " and ".join(s for _, s in found)) if found else None


def is_local(host: str) -> bool:
    """Whether ``host`` is a loopback address (only this machine can connect)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- the server ---------------------------------------------------------------------------------


class PolicyServer:
    def __init__(self, runner: PolicyRunner, host: str, port: int, workers: int = 4, api_key: ApiKey | None = None):
        self.runner, self.host, self.port = runner, host, port
        self.api_key = api_key
        self.max_size = runner.max_request_bytes
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slurmvla-serve")
        self.requests = 0

    def _step(self, raw: Any, past: collections.deque) -> dict:
        if isinstance(raw, str):
            raise ValueError("expected a binary msgpack frame, got a text frame")
        past.append(self.runner.read(unpackb(raw)))
        start = time.monotonic()
        actions = self.runner.infer(self.runner.batch(past))
        return {"actions": actions, "infer_ms": (time.monotonic() - start) * 1000}

    async def _handle(self, ws) -> None:
        import websockets

        loop = asyncio.get_running_loop()
        peer = ws.remote_address
        past: collections.deque = collections.deque(maxlen=self.runner.history)
        await ws.send(packb(self.runner.metadata()))
        prev_total_ms = None
        while True:
            try:
                raw = await ws.recv()
            except websockets.ConnectionClosed as e:
                if e.sent is not None and e.sent.code == websockets.frames.CloseCode.MESSAGE_TOO_BIG:
                    self._log_too_big(peer, getattr(ws.protocol, "parser_exc", None) or e.sent.reason)
                break
            start = time.monotonic()
            try:
                out = await loop.run_in_executor(self.pool, self._step, raw, past)
            except ValueError as e:
                log.warning("bad request from %s: %s", peer, e)
                await self._refuse(ws, f"bad request: {e}", websockets.frames.CloseCode.INVALID_DATA)
                break
            except Exception:
                log.exception("inference failed for %s", peer)
                await self._refuse(ws, traceback.format_exc(), websockets.frames.CloseCode.INTERNAL_ERROR)
                break
            timing = {"infer_ms": out["infer_ms"], "total_ms": (time.monotonic() - start) * 1000}
            if prev_total_ms is not None:
                timing["prev_total_ms"] = prev_total_ms
            try:
                await ws.send(packb({"actions": out["actions"], "server_timing": timing}))
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
        """Before the websocket opens: the health check (open to all), then the API key."""
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
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
            print(f"serving {self.runner.loaded.source} (step {self.runner.loaded.step}) on "
                  f"{address(self.host, self.port)}; health check: GET /healthz; {key}; requests up to "
                  f"{self.max_size / MiB:.4g} MiB", flush=True)
            if self.api_key is None and not is_local(self.host):
                log.warning("listening on %s without an API key: anyone who can reach this port can drive the policy; "
                            "export %s (or set serve.api_key_file) and pass it to the client "
                            "(WebsocketClientPolicy(host, port, api_key=...))", self.host or "every interface",
                            self.runner.cfg.serve.api_key_env or DEFAULT_KEY_ENV)
            if ready is not None:
                ready.set()
            await stop.wait()
        self.pool.shutdown(wait=True)


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


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an exported .safetensors file, a checkpoint folder, a run directory or a "
                                           "LeRobot pi0 / pi0.5 checkpoint directory")
    parser.add_argument("--host", help="address to listen on (serve.host, default 0.0.0.0: every interface, so set "
                                       "an API key, see above; 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, help="port to listen on (serve.port, default 8000; 0: a free one)")
    parser.add_argument("--max-request-mb", help="largest request accepted, in MiB (serve.max_request_mb; default: "
                                                 "derived from the policy's observation size, see above)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. serve.cameras=[...] policy.num_inference_steps=5")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    overrides += [f"serve.host={args.host}"] if args.host is not None else []
    overrides += [f"serve.port={args.port}"] if args.port is not None else []
    if args.max_request_mb is not None:
        try:
            float(args.max_request_mb)
        except ValueError:
            print(f"error: --max-request-mb {args.max_request_mb!r} is not a number of MiB (e.g. 64)", file=sys.stderr)
            sys.exit(2)
        overrides.append(f"serve.max_request_mb={args.max_request_mb}")
    try:
        import msgpack  # noqa: F401
        import websockets  # noqa: F401
    except ImportError as e:
        print(f"error: the server needs websockets and msgpack ({e}); pip install -e '.[serve]'", file=sys.stderr)
        sys.exit(2)
    try:
        server = build_server(args.source, overrides)
    except ValueError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(server.run())
    except OSError as e:  # the port is taken, the address is not this machine's
        print(f"error: cannot listen on {server.host}:{server.port}: {e}", file=sys.stderr)
        sys.exit(1)


def _one_line(e: Exception) -> str:
    """An error as one line: OmegaConf's type errors span several ("Value 'x' could not be converted
    ... \n full_key: serve.port ..."); keep the first, prefixed by the key it names."""
    lines = str(e).splitlines() or [type(e).__name__]
    key = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.strip().startswith("full_key:")), None)
    return f"{key}: {lines[0]}" if key else " ".join(ln.strip() for ln in lines)


def build_server(source: str, overrides: list[str], device: str | None = None,
                 environ: dict[str, str] | None = None) -> PolicyServer:
    """Load ``source`` (see :func:`slurmvla.export.load_exported`) onto ``serve.device``, map its inputs
    and read its API key (:func:`read_api_key`, from ``environ``, default ``os.environ``)."""
    loaded = load_exported(source, overrides, device="cpu")
    want = device or loaded.cfg.serve.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        loaded.policy.to(torch.device(want))
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"serve.device={want!r} cannot be used here ({e}); choose auto, cpu or cuda") from None
    cfg = loaded.cfg
    if cfg.precision == "bf16" and torch.device(want).type == "cuda":
        # The weights in bf16, as training's forward holds them (under autocast): no cast of every weight
        # at every request.
        lower_weights(loaded.policy, torch.bfloat16)
    sampler = inference_sampler(loaded.policy, cfg.serve.cuda_graph, cfg.serve.compile, "serve.cuda_graph=true",
                                fused=cfg.serve.fused_projections)
    api_key = read_api_key(cfg.serve, environ)
    runner = PolicyRunner(loaded, sampler)
    if loaded.cfg.serve.max_request_mb is not None and runner.max_request_bytes < runner.observation_bytes():
        log.warning("serve.max_request_mb=%s is below one observation at the policy's image size (%.2f MiB): "
                    "requests will be refused", loaded.cfg.serve.max_request_mb, runner.observation_bytes() / MiB)
    return PolicyServer(runner, loaded.cfg.serve.host, loaded.cfg.serve.port, api_key=api_key)


if __name__ == "__main__":
    main()
