"""Serve a trained policy to robots over openpi's websocket protocol.

    python -m slurmvla.serve SOURCE [--host H] [--port 8000] [overrides ...]

``SOURCE``: a file written by ``python -m slurmvla.export``, a checkpoint folder, a run directory
or a LeRobot pi0 / pi0.5 checkpoint directory (its weights, statistics and config). Overrides change the run's config (``serve.cameras=[...]``, ``policy.num_inference_steps=5``).

The wire protocol is that of openpi's ``openpi-client`` package: on connect the server sends one
msgpack frame of metadata; each request is a msgpack observation dict whose numpy arrays are maps
``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape}``; each reply
is a msgpack dict with ``actions`` (float32 ``[action_horizon, action_dim]``, raw dataset units)
and ``server_timing``. A request the server cannot use gets a text frame naming the key and what was
expected, and that connection closes (as openpi's server does); other connections go on. ``GET
/healthz`` answers 200. No pickle: arrays are rebuilt from raw bytes with numeric dtypes only.

Observations map to the policy's inputs through ``serve.*`` (:class:`slurmvla.config.ServeConfig`),
and are prepared by the functions training uses (:mod:`slurmvla.data.prepare`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http
import logging
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

from slurmvla.data.prepare import observation_batch, prepare_image
from slurmvla.export import Loaded, load_exported
from slurmvla.policy.base import seeded_sample_actions

log = logging.getLogger("slurmvla.serve")

# dtype kinds a request may carry: bool, signed / unsigned integers, floats. Object, void and
# complex arrays are refused (an object array rebuilt from raw bytes would be raw pointers).
NUMERIC_KINDS = "biuf"


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

    def __init__(self, loaded: Loaded):
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
        autocast = cfg.precision == "bf16" and self.device.type == "cuda"
        self.autocast = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else None

    def metadata(self) -> dict:
        pc = self.cfg.policy
        return {
            "server": "slurmvla", "policy": pc.target or pc.name, "step": self.loaded.step, "source": self.loaded.source,
            "action_horizon": pc.action_horizon, "action_dim": pc.action_dim, "image_size": self.spec.image_size,
            "cameras": {cam: key for cam, key in zip(self.cfg.data.cameras, self.camera_keys)},
            "state": list(self.cfg.serve.state), "prompt": self.cfg.serve.prompt, "seed": self.cfg.serve.seed,
        }

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
        """The action chunk ``[action_horizon, action_dim]`` float32 in dataset units. Noise is seeded by
        ``serve.seed`` for each request and drawn on the CPU: the same observation always gives the same
        chunk, on any server and device (up to the device's precision)."""
        batch = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with self.lock, (self.autocast() if self.autocast is not None else contextlib.nullcontext()):
            actions = seeded_sample_actions(self.policy, self.spec, batch, self.cfg.serve.seed)
        return actions[0].float().cpu().numpy()


# -- the server ---------------------------------------------------------------------------------


class PolicyServer:
    def __init__(self, runner: PolicyRunner, host: str, port: int, workers: int = 4):
        self.runner, self.host, self.port = runner, host, port
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
            except websockets.ConnectionClosed:
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

    @staticmethod
    def _health(connection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    async def run(self, ready: threading.Event | None = None, stop: asyncio.Event | None = None) -> None:
        from websockets.asyncio.server import serve

        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (ValueError, RuntimeError):  # not the main thread (tests run the server in a thread)
                pass
        async with serve(self._handle, self.host, self.port, compression=None, max_size=None,
                         process_request=self._health) as server:
            self.port = server.sockets[0].getsockname()[1]
            print(f"serving {self.runner.loaded.source} (step {self.runner.loaded.step}) on "
                  f"{address(self.host, self.port)}; health check: GET /healthz", flush=True)
            if ready is not None:
                ready.set()
            await stop.wait()
        self.pool.shutdown(wait=True)


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="an exported .safetensors file, a checkpoint folder, a run directory or a "
                                           "LeRobot pi0 / pi0.5 checkpoint directory")
    parser.add_argument("--host", help="address to listen on (serve.host, default 0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, help="port to listen on (serve.port, default 8000; 0: a free one)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. serve.cameras=[...] policy.num_inference_steps=5")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    overrides += [f"serve.host={args.host}"] if args.host is not None else []
    overrides += [f"serve.port={args.port}"] if args.port is not None else []
    try:
        import msgpack  # noqa: F401
        import websockets  # noqa: F401
    except ImportError as e:
        print(f"error: the server needs websockets and msgpack ({e}); pip install -e '.[serve]'", file=sys.stderr)
        sys.exit(2)
    try:
        server = build_server(args.source, overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(server.run())
    except OSError as e:  # the port is taken, the address is not this machine's
        print(f"error: cannot listen on {server.host}:{server.port}: {e}", file=sys.stderr)
        sys.exit(1)


def build_server(source: str, overrides: list[str], device: str | None = None) -> PolicyServer:
    """Load ``source`` (see :func:`slurmvla.export.load_exported`) onto ``serve.device`` and map its inputs."""
    loaded = load_exported(source, overrides, device="cpu")
    want = device or loaded.cfg.serve.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        loaded.policy.to(torch.device(want))
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"serve.device={want!r} cannot be used here ({e}); choose auto, cpu or cuda") from None
    return PolicyServer(PolicyRunner(loaded), loaded.cfg.serve.host, loaded.cfg.serve.port)


if __name__ == "__main__":
    main()
