"""The policy server's request boundary under generated input (Hypothesis; tests/properties.py): any keys, dtypes,
shapes, NaN / inf, nested values, wrong prompt types, empty, truncated and corrupted msgpack frames, text frames,
garbage bytes before or after the websocket handshake. One real server (the demo's policy, untrained, behind
:class:`PolicyServer` in a thread of this process) answers them all:

- a request it can use gets the policy's actions (float32 ``[action_horizon, action_dim]``, all finite);
- any other gets one text frame saying ``bad request: ...`` that names the key at fault (or what the frame is:
  not msgpack, not a dict, an array or scalar that cannot be decoded), then a close with code 1007 and its reason;
  never a traceback (1011), never a hang;
- garbage on the socket closes that connection;
- after every input a new well-formed client gets exactly the actions it got before the run; the server's
  memory stays bounded and no request is left pending.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time

import msgpack
import numpy as np
import psutil
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slurmvla.compose import compose
from slurmvla.inference.harness import serving_in_thread
from slurmvla.inference.load import Loaded
from slurmvla.inference.runner import PolicyRunner
from slurmvla.inference.server import PolicyServer
from slurmvla.inference.wire import packb, unpackb
from slurmvla.policy import build_policy
from slurmvla.units import MiB
from tests.properties import DEPTHS, Tally, run

websockets = pytest.importorskip("websockets")
from websockets.sync.client import connect  # noqa: E402

BUDGET = {"default": 250, "deep": 4000}
# The server's memory over a second pass of every input the run tried (the process's RSS: the server runs in this
# thread's process, beside Hypothesis, whose own memory grows with the inputs it has drawn; a second pass draws
# none). Each request is under 20 MiB; a request that left 4 KiB behind would add 16 MiB over the deep run's.
RSS_GROWTH = {"deep": 16 * MiB,
              # The default run's 254 inputs cannot show a 4 KiB leak (1 MiB); its RSS over a second pass moves by
              # 10-35 MiB with the allocator's arenas (measured in suite runs, where other tests share the process):
              # here the bound catches a request that leaves its own size behind, the deep run the small leaks.
              "default": 96 * MiB}
TIMEOUT_S = 30

rng = np.random.default_rng(0)
GOOD = {
    "observation/exterior_image_1_left": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
    "observation/wrist_image_left": rng.integers(0, 256, (48, 80, 3), dtype=np.uint8),
    "observation/joint_position": rng.normal(size=7),
    "observation/gripper_position": rng.uniform(size=1),
    "prompt": "put the red cup in the drawer",
}
# Every key the server reads: the observation's and real-time chunking's.
READS = [*GOOD, "prev_actions", "delay"]
# What a message says about a frame that is no observation dict (the wire's words, slurmvla/inference/wire.py).
WIRE = ("text frame", "not a msgpack frame", "an array in the request", "a scalar in the request", "must be a dict")


def _pack(obj) -> bytes:
    """Any client's encoding: openpi's array maps for every numpy array (of any dtype), the rest as msgpack has it."""
    def default(o):
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": list(o.shape)}
        raise TypeError(type(o).__name__)

    return msgpack.packb(obj, default=default, use_bin_type=True)


# -- the inputs ------------------------------------------------------------------------------------------------

# Anything msgpack can carry: integers in [-2**63, 2**64).
ints = st.integers(-2**63, 2**64 - 1)
DTYPES = ["|u1", "<u2", "<i4", ">i8", "<f2", "<f4", ">f4", "<f8", "|b1", "|i1", "<u8", "<c8", "|O", "<U3", "|S2",
          "|V4", "<M8[s]", "f4,i4", "(2,)f4", "", "zz", "<f16"]
arrays = hnp.arrays(st.sampled_from([np.uint8, np.float32, np.float64, np.int64, np.bool_, np.float16, np.int8, np.uint64]),
                    hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=40))
# openpi's array and scalar maps, well- or ill-formed: any dtype string, shape, payload.
raw_array = st.fixed_dictionaries(
    {b"__ndarray__": st.sampled_from([True, False, 1, None])},
    optional={b"data": st.binary(max_size=64),
              b"dtype": st.one_of(st.sampled_from(DTYPES), ints, st.binary(max_size=4),
                                  st.lists(st.text(max_size=3), max_size=2)),
              b"shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=4), ints, st.text(max_size=3),
                                  st.binary(max_size=3), st.lists(st.floats(), max_size=2))})
raw_scalar = st.fixed_dictionaries(
    {b"__npgeneric__": st.just(True)},
    optional={b"data": st.one_of(ints, st.floats(), st.text(max_size=4), st.binary(max_size=4),
                                 st.none()),
              b"dtype": st.one_of(st.sampled_from(DTYPES), ints)})
leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(max_size=20),
                   st.binary(max_size=20), arrays, raw_array, raw_scalar)
values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=5), st.binary(max_size=3)), inner, max_size=3)),
    max_leaves=8)
images = hnp.arrays(st.sampled_from([np.uint8, np.float32, np.float64, np.int32]),
                    st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(1, 4)))
numbers = hnp.arrays(st.sampled_from([np.float64, np.float32, np.float16]), st.integers(0, 9),
                     elements={"allow_nan": True, "allow_infinity": True})
real_time_chunking = st.fixed_dictionaries({}, optional={
    "prev_actions": st.one_of(values, hnp.arrays(st.sampled_from([np.float32, np.float64]),
                                                  st.tuples(st.integers(0, 10), st.integers(7, 9)))),
    "delay": st.one_of(st.integers(-3, 10), values)})


@st.composite
def observations(draw) -> dict:
    """The good observation with keys dropped, values replaced (any value, images of any size and dtype, numbers
    with NaN / inf), keys added, and real-time chunking's keys with any value."""
    obs = {k: v for k, v in GOOD.items() if k not in draw(st.sets(st.sampled_from(list(GOOD)), max_size=2))}
    obs.update(draw(st.dictionaries(st.sampled_from(list(GOOD)), st.one_of(values, images, numbers), max_size=3)))
    obs.update(draw(st.dictionaries(st.text(max_size=8), values, max_size=2)))
    obs.update(draw(real_time_chunking))
    return obs


def _flip(frame: bytes, at: int, byte: int) -> bytes:
    at %= len(frame)
    return frame[:at] + bytes([byte]) + frame[at + 1:]


GOOD_FRAME = _pack(GOOD)
frames = st.one_of(
    observations().map(_pack),
    values.map(_pack),
    st.tuples(observations().map(_pack), st.floats(0, 1)).map(lambda t: t[0][: int(len(t[0]) * t[1])]),  # truncated
    st.tuples(st.integers(0, len(GOOD_FRAME)), st.integers(0, 255)).map(lambda t: _flip(GOOD_FRAME, *t)),  # corrupted
    st.binary(min_size=1, max_size=8).map(lambda tail: GOOD_FRAME + tail),  # trailing bytes
    st.binary(max_size=200),  # garbage, the empty frame among it
    st.text(max_size=30),  # a text frame
)
# Bytes on the socket itself: in place of the HTTP handshake, or after it in place of websocket frames.
raw_bytes = st.tuples(st.sampled_from(["handshake", "frames"]),
                      st.one_of(st.binary(max_size=300), st.binary(max_size=200).map(lambda b: b"GET / HTTP/1.1\r\n" + b)))
inputs = st.one_of(frames, frames, frames, raw_bytes)

# Failures found by these tests, fixed, kept (tried first by both budgets).
FOUND = [
    # prev_actions finite in float64, beyond float32's range: the guidance held inf, the chunk came back NaN.
    _pack({**GOOD, "prev_actions": np.full((3, 8), 1e39)}),
    # A ragged nested list for the state: numpy's own message, naming no key.
    _pack({**GOOD, "observation/joint_position": [[1.0], [1.0, 2.0]]}),
    # An image libswscale cannot scale (2 x 3,000,000): "Invalid argument returned 22", naming no key.
    _pack({**GOOD, "observation/wrist_image_left": np.zeros((2, 3_000_000, 3), np.uint8)}),
    # A scalar map whose payload is no number: "the request is not a msgpack frame" for a msgpack frame.
    _pack({**GOOD, "prompt": {b"__npgeneric__": True, b"data": b"abcd", b"dtype": "<f4"}}),
]


# -- the run ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """One server for the whole run (the tiny policy untrained: its weights do not matter here), and the actions a
    well-formed client gets; stopped on the way out, also on failure."""
    cfg = compose(["experiment=demo"])
    torch.manual_seed(0)
    runner = PolicyRunner(Loaded(build_policy(cfg.policy).eval(), cfg, 0, "memory"))
    server = PolicyServer(runner, "127.0.0.1", 0)
    want = runner.infer(GOOD)["actions"]
    quiet = logging.getLogger("slurmvla.serve"), logging.getLogger("websockets")
    levels = [log.level for log in quiet]
    for log in quiet:  # one warning per bad request: thousands of lines
        log.setLevel(logging.CRITICAL)
    try:
        with serving_in_thread(server) as port:
            yield server, port, want
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def _names_what(frame, text: str) -> bool:
    """The error names the key at fault, or what the frame is."""
    if any(w in text for w in WIRE):
        return isinstance(frame, str) or "not a msgpack frame" not in text or _not_msgpack(frame)
    return any(str(k) in text for k in READS)


def _not_msgpack(frame: bytes) -> bool:
    try:
        msgpack.unpackb(frame)
    except Exception:  # noqa: BLE001 - any of msgpack's errors
        return True
    return False


def _send(port: int, frame, tally: Tally) -> None:
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=TIMEOUT_S) as ws:
        ws.recv(timeout=TIMEOUT_S)  # metadata
        ws.send(frame)
        reply = ws.recv(timeout=TIMEOUT_S)
        if isinstance(reply, str):
            assert reply.startswith("bad request: "), f"not a bad-request reply: {reply[-2000:]}"
            assert _names_what(frame, reply), f"the reply names no key of the request: {reply}"
            with pytest.raises(websockets.ConnectionClosed) as closed:
                ws.recv(timeout=TIMEOUT_S)
            code = closed.value.rcvd.code if closed.value.rcvd else None
            assert code == 1007 and closed.value.rcvd.reason, f"closed with {closed.value.rcvd} after {reply!r}"
            tally["refused (1007)"] += 1
            return
        out = unpackb(reply)
        actions = out["actions"]
        assert actions.dtype == np.float32 and actions.shape == (8, 8), (actions.dtype, actions.shape)
        assert np.isfinite(actions).all(), f"actions with NaN or inf: {actions}"
        tally["answered"] += 1


def _raw(port: int, where: str, data: bytes, tally: Tally) -> None:
    """``data`` on the socket in place of the handshake or of frames, then our side closed for writing: the server
    closes the connection (EOF) within the timeout."""
    if where == "handshake":
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        with contextlib.closing(sock):
            with contextlib.suppress(OSError):  # the server may close before all of it is written
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):
                    pass
        tally["garbage before the handshake"] += 1
        return
    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=TIMEOUT_S) as ws:
        ws.recv(timeout=TIMEOUT_S)
        with contextlib.suppress(OSError):
            ws.socket.sendall(data)
            ws.socket.shutdown(socket.SHUT_WR)
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                reply = ws.recv(timeout=TIMEOUT_S)
                assert not isinstance(reply, str) or reply.startswith("bad request: "), reply[-2000:]
    tally["garbage after the handshake"] += 1


@pytest.mark.parametrize("depth", DEPTHS)
def test_any_request_gets_actions_or_a_bad_request_and_the_server_goes_on(served, depth):
    server, port, want = served
    tally, tried = Tally(), []

    def send(item, tally: Tally) -> None:
        if isinstance(item, tuple):
            _raw(port, *item, tally)
        else:
            _send(port, item, tally)

    def check(item) -> None:
        tried.append(item)
        send(item, tally)
        # The next well-formed client is served, its answer unchanged.
        with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None, open_timeout=TIMEOUT_S) as ws:
            ws.recv(timeout=TIMEOUT_S)
            ws.send(packb(GOOD))
            np.testing.assert_array_equal(unpackb(ws.recv(timeout=TIMEOUT_S))["actions"], want)

    start = time.monotonic()
    run(depth, inputs, check, BUDGET, examples=FOUND)
    took = time.monotonic() - start
    process = psutil.Process()
    before = process.memory_info().rss
    for item in tried:  # the same requests again: what each leaves behind shows as growth
        send(item, Tally())
    after = process.memory_info().rss
    for _ in range(50):  # the handlers of the last connections end once their closing handshakes do
        if not server.admitted:
            break
        time.sleep(0.1)
    assert server.pending == 0 and not server.admitted, (server.pending, server.admitted)
    print(tally.line(f"server [{depth}]"), f"in {took:.0f} s; crashes 0, hangs 0; RSS {before / MiB:.0f} -> "
          f"{after / MiB:.0f} MiB over a second pass of the {len(tried)} inputs")
    assert after - before < RSS_GROWTH[depth], f"RSS grew {(after - before) / MiB:.1f} MiB over {len(tried)} requests again"
