"""The policy server, driven by openpi's published client package (openpi-client, installed with
--no-deps by scripts/test.sh: it pins numpy<2 but runs on numpy 2).

The server runs as its own process (``python -m slurmvla.serve``), started and stopped by PID here.
Reference actions come from the policy loaded in this process: the same inputs prepared by hand and
``sample_actions`` under the same seed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import secrets
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.data.prepare import prepare_image
from slurmvla.inference.auth import ApiKey, check_exposure, read_api_key
from slurmvla.inference.build import build_server
from slurmvla.inference.harness import serving_in_thread
from slurmvla.inference.load import Loaded, load_exported
from slurmvla.inference.runner import PolicyRunner, default_max_request_bytes, request_seed
from slurmvla.inference.server import (
    DEFAULT_MAX_REQUEST_BYTES,
    InferencePolicy,
    PolicyServer,
    SupportsMetadata,
    SupportsRequestLimit,
    SupportsSessions,
)
from slurmvla.policy import build_policy
from slurmvla.units import MiB

wcp = pytest.importorskip("openpi_client.websocket_client_policy", reason="pip install --no-deps openpi-client")
image_tools = pytest.importorskip("openpi_client.image_tools")

REPO = Path(__file__).resolve().parents[2]
# Same fp32 operations on the same CPU, in another process and thread: only the split of intra-op
# reductions over threads can differ, which moves results by a few ulp of float32.
RTOL, ATOL = 1e-5, 1e-6


def start_server(source: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
    """``python -m slurmvla.serve`` on a free port of 127.0.0.1; ``proc.log`` collects its output lines. An API
    key only where ``env`` gives one (never one from the environment the tests run in)."""
    base = {k: v for k, v in os.environ.items() if k != "SLURMVLA_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "slurmvla.serve", str(source), "--host", "127.0.0.1", "--port", "0",
                             *args], cwd=REPO, env={**base, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = proc.log = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* on ws://127\.0\.0\.1:(\d+)", line)
        if m:
            # Keep draining the log so the server never blocks on a full pipe.
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return proc, int(m.group(1))
    proc.wait(10)
    raise AssertionError("server did not start:\n" + "".join(lines)[-3000:])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="module")
def server(trained_run):
    proc, port = start_server(trained_run)
    try:
        yield port
    finally:
        stop(proc)
    assert proc.returncode == 0, f"server exited with {proc.returncode} on SIGTERM"


@pytest.fixture(scope="module")
def loaded(trained_run) -> Loaded:
    return load_exported(trained_run)


def droid_obs(seed: int, raw: bool = False) -> dict:
    """What openpi's DROID client sends: resize_with_pad to 224 on the client (or the raw 180x320)."""
    g = np.random.default_rng(seed)
    ext = g.integers(0, 256, (180, 320, 3), dtype=np.uint8)
    wrist = g.integers(0, 256, (180, 320, 3), dtype=np.uint8)
    if not raw:
        ext, wrist = (image_tools.convert_to_uint8(image_tools.resize_with_pad(x, 224, 224)) for x in (ext, wrist))
    return {
        "observation/exterior_image_1_left": ext,
        "observation/wrist_image_left": wrist,
        "observation/joint_position": g.normal(size=7),
        "observation/gripper_position": g.uniform(size=1),
        "prompt": ["pick up the cup", "open the drawer", "wipe the table", ""][seed % 4],
    }


def reference(loaded: Loaded, obs: dict) -> np.ndarray:
    """The policy's chunk for ``obs``, with the batch built here by hand: exterior 1 and wrist
    prepared, exterior 2 (never sent by the DROID client) black and masked, state = joints + gripper."""
    policy, cfg = loaded.policy, loaded.cfg
    size = cfg.policy.image_size
    images = np.stack([prepare_image(obs["observation/exterior_image_1_left"], size),
                       np.zeros((size, size, 3), np.uint8),
                       prepare_image(obs["observation/wrist_image_left"], size)])
    ids, mask = type(policy).sample_spec(cfg.policy).tokenizer(obs["prompt"])
    batch = {
        "images": torch.from_numpy(images)[None], "image_mask": torch.tensor([[True, False, True]]),
        "state": torch.from_numpy(np.concatenate([obs["observation/joint_position"],
                                                  obs["observation/gripper_position"]]).astype(np.float32))[None],
        "text": ids[None], "text_mask": mask[None], "instruction": [obs["prompt"]],
    }
    torch.manual_seed(request_seed(cfg.serve.seed, batch))
    with torch.no_grad():
        return policy.sample_actions(batch)[0].numpy()


def test_openpi_client_receives_the_policys_actions(server, loaded):
    client = wcp.WebsocketClientPolicy("127.0.0.1", server)
    meta = client.get_server_metadata()
    assert meta["action_horizon"] == loaded.cfg.policy.action_horizon and meta["step"] == 8
    for seed, raw in ((0, False), (1, True), (2, False)):
        obs = droid_obs(seed, raw)
        reply = client.infer(obs)
        actions = reply["actions"]
        assert actions.dtype == np.float32
        assert actions.shape == (loaded.cfg.policy.action_horizon, loaded.cfg.policy.action_dim)
        np.testing.assert_allclose(actions, reference(loaded, obs), rtol=RTOL, atol=ATOL)
        assert reply["server_timing"]["infer_ms"] > 0
    # The chunk depends on the observation (the test above could not pass with a constant answer).
    assert not np.allclose(client.infer(droid_obs(0))["actions"], client.infer(droid_obs(1))["actions"])
    with urllib.request.urlopen(f"http://127.0.0.1:{server}/healthz", timeout=10) as r:
        assert r.status == 200


def _raw_request(port: int, frame) -> str:
    """Send one frame as any client could (not only openpi's) and return the server's text reply."""
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        ws.recv()  # metadata
        ws.send(frame)
        reply = ws.recv()
        assert isinstance(reply, str), "a bad request must get a text frame, not actions"
        return reply


def test_bad_requests_get_an_error_naming_the_key_and_the_server_goes_on(server, loaded):
    good = droid_obs(3)
    cases = [
        ({k: v for k, v in good.items() if k != "observation/wrist_image_left"}, "missing key 'observation/wrist_image_left'"),
        ({**good, "observation/exterior_image_1_left": good["observation/exterior_image_1_left"][..., 0]},
         "observation/exterior_image_1_left: expected an RGB image [H, W, 3]"),
        ({**good, "observation/wrist_image_left": good["observation/wrist_image_left"].astype(np.int32)},
         "observation/wrist_image_left: expected dtype uint8"),
        ({**good, "observation/joint_position": np.zeros(6)}, "observation/joint_position: 6"),
        ({**good, "observation/joint_position": np.full(7, np.nan)}, "NaN"),
        ({**good, "prompt": 5}, "prompt: expected a string"),
    ]
    for obs, expected in cases:
        client = wcp.WebsocketClientPolicy("127.0.0.1", server)
        with pytest.raises(RuntimeError, match=re.escape(expected)):
            client.infer(obs)
    # Frames that are no observation at all; an object array would be raw pointers if rebuilt.
    pickled = msgpack.packb({"prompt": {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}})
    for frame, expected in ((b"\x93garbage", "not a msgpack frame"), ("hello", "text frame"),
                            (pickled, "not numeric"), (msgpack.packb([1, 2]), "must be a dict")):
        assert expected in _raw_request(server, frame)
    # After all that, the same server answers a good request correctly.
    client = wcp.WebsocketClientPolicy("127.0.0.1", server)
    np.testing.assert_allclose(client.infer(good)["actions"], reference(loaded, good), rtol=RTOL, atol=ATOL)


def test_concurrent_clients_get_their_own_answers(server, loaded):
    seeds = [10, 11, 12, 13]
    results: dict[int, list[np.ndarray]] = collections.defaultdict(list)
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            client = wcp.WebsocketClientPolicy("127.0.0.1", server)
            for _ in range(5):
                results[seed].append(client.infer(droid_obs(seed))["actions"])
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for seed in seeds:
        want = reference(loaded, droid_obs(seed))
        assert len(results[seed]) == 5
        for got in results[seed]:
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_an_exported_file_serves_the_same_policy_as_its_run(trained_run, loaded):
    from_file = load_exported(trained_run / "policy.safetensors")
    obs = droid_obs(5)
    np.testing.assert_array_equal(reference(from_file, obs), reference(loaded, obs))
    proc, port = start_server(trained_run / "policy.safetensors", "policy.num_inference_steps=3")
    try:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        three = load_exported(trained_run, ["policy.num_inference_steps=3"])
        np.testing.assert_allclose(client.infer(obs)["actions"], reference(three, obs), rtol=RTOL, atol=ATOL)
    finally:
        stop(proc)


@pytest.mark.parametrize("args, expected", [
    (["/no/such/run"], "'/no/such/run' does not exist"),
    (["{run}", "policy.width=96"], "the weights do not fit"),
    (["{run}", "serve.cameras=[observation/wrist_image_left]"], "serve.cameras="),
    (["{run}", "serve.colour=1"], "unknown config key 'serve.colour'"),
    (["{run}/metrics.jsonl"], "is not a safetensors file"),
])
def test_bad_sources_and_overrides_fail_at_start_with_one_line(trained_run, capsys, args, expected):
    from slurmvla import serve  # the CLI's main() in this process (the server's own process: tests above)

    with pytest.raises(SystemExit) as e:
        serve.main([*(a.format(run=trained_run) for a in args), "--host", "127.0.0.1", "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err, err


@pytest.mark.parametrize("request_interval", [1, 2])
def test_history_frames_follow_training_layout(sample_root, request_interval):
    """With observation history, each connection keeps its own past: the first request repeats its
    frame masked (as training masks frames before the episode start), later ones take the frames
    history_interval steps apart: history_interval requests back when each request is the next frame, fewer when
    requests come serve.request_interval steps apart."""
    cfg = compose([f"data.root={sample_root}", "policy.num_obs_history=2", "data.num_obs_history=2",
                   "data.history_interval=2", f"serve.request_interval={request_interval}"])
    back = 2 // request_interval  # requests between the two frames
    runner = PolicyRunner(Loaded(build_policy(cfg.policy).eval(), cfg, 0, "memory"))
    past: collections.deque = collections.deque(maxlen=runner.processor.history)
    size = cfg.policy.image_size
    frames = []
    for i in range(4):
        obs = droid_obs(20 + i)
        past.append(runner.processor.read(obs))
        frames.append(prepare_image(obs["observation/exterior_image_1_left"], size))
        batch = runner.processor.batch(past)
        assert batch["images"].shape == (1, 6, size, size, 3)
        older = i - back if i >= back else 0
        assert torch.equal(batch["images"][0, 0], torch.from_numpy(frames[older]))
        assert torch.equal(batch["images"][0, 3], torch.from_numpy(frames[i]))
        assert batch["image_mask"][0].tolist() == [i >= back, False, i >= back, True, False, True]
        assert batch["state"].shape == (1, 2, 8)
    assert runner.policy.sample_actions(batch).shape == (1, cfg.policy.action_horizon, cfg.policy.action_dim)


def test_history_a_client_never_sends_is_refused_and_a_rollout_says_what_it_reads(sample_root):
    """A client requesting every 3 steps never sends the frames 2 steps back a policy was trained on: the config
    refuses the setting by name at start-up; a rollout whose requests are spaced otherwise than the server counts
    them says which frames the policy then reads."""
    from slurmvla.inference.closed_loop import history_warning

    with pytest.raises(ValueError, match=r"serve.request_interval=3: .* data.history_interval=2 steps apart"):
        compose([f"data.root={sample_root}", "policy.num_obs_history=2", "data.num_obs_history=2",
                 "data.history_interval=2", "serve.request_interval=3"])
    with pytest.raises(ValueError, match="serve.request_interval=0"):
        compose([f"data.root={sample_root}", "serve.request_interval=0"])
    cfg = compose([f"data.root={sample_root}", "policy.num_obs_history=2", "data.num_obs_history=2"])
    assert "it reads frames 3 steps apart" in history_warning(cfg.data, cfg.serve, 3)  # trained 1 apart, asked every 3
    assert history_warning(cfg.data, cfg.serve, 1) is None
    matched = compose([f"data.root={sample_root}", "policy.num_obs_history=2", "data.num_obs_history=2",
                       "data.history_interval=3", "serve.request_interval=3"])
    assert history_warning(matched.data, matched.serve, 3) is None
    assert "frames 6 steps apart" in history_warning(matched.data, matched.serve, 6)
    plain = compose([f"data.root={sample_root}"])
    assert history_warning(plain.data, plain.serve, 3) is None  # no history: nothing to read wrong


def test_a_plug_in_policy_is_served_through_the_same_contract(sample_root, example_policy):
    """The server calls only the contract: a user's class (the MLP example) is served as the built-in is."""
    cfg = compose([f"data.root={sample_root}", "policy=custom", f"policy.target={example_policy}"])
    torch.manual_seed(0)
    policy = build_policy(cfg.policy).eval()
    runner = PolicyRunner(Loaded(policy, cfg, 0, "memory"))
    obs = droid_obs(30, raw=True)
    got = runner.infer(obs)["actions"]
    size = cfg.policy.image_size
    images = np.stack([prepare_image(obs["observation/exterior_image_1_left"], size), np.zeros((size, size, 3), np.uint8),
                       prepare_image(obs["observation/wrist_image_left"], size)])
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]]).astype(np.float32)
    with torch.no_grad():
        want = policy.sample_actions({"images": torch.from_numpy(images)[None], "image_mask": torch.tensor([[1, 0, 1]]).bool(),
                                      "state": torch.from_numpy(state)[None]})[0].numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# -- bounded and closed to strangers: the API key and the request-size limit ----------------------

KEY = "test-" + secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed_server(trained_run):
    """A server whose key comes from $SLURMVLA_API_KEY; yields (port, its process)."""
    proc, port = start_server(trained_run, env={"SLURMVLA_API_KEY": KEY})
    try:
        yield port, proc
    finally:
        stop(proc)
    assert proc.returncode == 0, f"server exited with {proc.returncode} on SIGTERM"
    log = "".join(proc.log)
    assert KEY not in log and "Traceback" not in log, log[-3000:]


def _log_lines(proc: subprocess.Popen, pattern: str, want: int, timeout: float = 10) -> list[str]:
    """The server's log lines matching ``pattern``, once there are ``want`` of them (the server logs as
    the connection closes, a moment after the client sees the close)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in list(proc.log) if re.search(pattern, ln)]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def _rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def test_only_clients_with_the_api_key_are_served_and_healthz_stays_open(keyed_server, loaded):
    import websockets

    port, proc = keyed_server
    client = wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=KEY)
    meta = client.get_server_metadata()
    assert KEY not in repr(meta) and meta["max_request_bytes"] > 0
    for seed in (0, 1):
        obs = droid_obs(seed, raw=bool(seed))
        np.testing.assert_allclose(client.infer(obs)["actions"], reference(loaded, obs), rtol=RTOL, atol=ATOL)
    # Refused before the websocket opens: openpi's client raises the HTTP status it got.
    for key, status, reason in ((None, 401, "Authorization: Api-Key <key>"), ("not-" + KEY, 403, "wrong API key"),
                                (KEY[:-1], 403, "wrong API key")):
        with pytest.raises(websockets.exceptions.InvalidStatus) as e:
            wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=key)
        assert e.value.response.status_code == status
        assert reason in bytes(e.value.response.body).decode()
    # Another scheme with the right key is no key.
    from websockets.sync.client import connect

    with pytest.raises(websockets.exceptions.InvalidStatus) as e:
        connect(f"ws://127.0.0.1:{port}", additional_headers={"Authorization": f"Bearer {KEY}"}).close()
    assert e.value.response.status_code == 403
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200
    lines = _log_lines(proc, r"refused a connection", 4)
    assert len(lines) == 4 and "no API key" in lines[0] and all("wrong API key" in ln for ln in lines[1:]), lines
    assert not any(KEY in ln or KEY[:-1] in ln for ln in proc.log)
    assert "API key required (from $SLURMVLA_API_KEY)" in "".join(proc.log)


def test_an_oversized_request_is_refused_while_another_client_is_served(keyed_server, loaded):
    """64 MiB of bytes from the plain websockets client: closed with 1009, one log line naming the
    limit and its option, the server's memory unchanged, and a client connected meanwhile answered."""
    import websockets
    from websockets.sync.client import connect

    port, proc = keyed_server
    client = wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=KEY)
    limit = client.get_server_metadata()["max_request_bytes"]
    size = 64 * MiB
    assert 2 * 1280 * 720 * 3 < limit < size  # two raw 720p frames fit; the 64 MiB frame does not
    client.infer(droid_obs(8))  # warm: the policy's first allocations are not the frame's
    before = _rss(proc.pid)
    closed: list = []

    def send_big() -> None:
        with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None,
                     additional_headers={"Authorization": f"Api-Key {KEY}"}) as ws:
            ws.recv()  # metadata
            try:
                ws.send(b"\0" * size)
                ws.recv(timeout=30)
            except websockets.ConnectionClosed as e:
                closed.append(e.rcvd)

    big = threading.Thread(target=send_big)
    big.start()
    answered = 0
    while big.is_alive() or answered < 3:
        obs = droid_obs(40 + answered % 3)
        np.testing.assert_allclose(client.infer(obs)["actions"], reference(loaded, obs), rtol=RTOL, atol=ATOL)
        answered += 1
    big.join(60)
    after = _rss(proc.pid)
    assert closed and closed[0] is not None and closed[0].code == 1009, closed
    assert str(limit) in closed[0].reason  # websockets' words for it vary by version; the numbers do not
    lines = _log_lines(proc, r"refused a request", 1)
    assert len(lines) == 1 and str(size) in lines[0] and "serve.max_request_mb" in lines[0], lines
    print(f"server RSS around a 64 MiB frame: {before / MiB:.1f} -> {after / MiB:.1f} MiB")
    assert after - before < 32 * MiB, (before, after)
    # The same connection of the legitimate client goes on.
    np.testing.assert_allclose(client.infer(droid_obs(9))["actions"], reference(loaded, droid_obs(9)),
                               rtol=RTOL, atol=ATOL)


def test_an_oversized_frame_is_closed_on_its_header_before_its_payload_is_read(keyed_server):
    """A frame header announcing 256 MiB, then 2 MiB of it: the server closes (1009) without waiting for
    the rest, and its memory does not grow by the announced size."""
    import websockets
    from websockets.sync.client import connect

    port, proc = keyed_server
    before = _rss(proc.pid)
    announced, sent = 256 * MiB, 2 * MiB
    with connect(f"ws://127.0.0.1:{port}", compression=None,
                 additional_headers={"Authorization": f"Api-Key {KEY}"}) as ws:
        ws.recv()  # metadata
        # A client frame as RFC 6455 writes it: FIN + binary, masked, 64-bit length, mask key, payload.
        header = struct.pack("!BBQ", 0x82, 0x80 | 127, announced) + b"\x01\x02\x03\x04"
        with contextlib.suppress(OSError):  # the server may have closed before all of it is written
            ws.socket.sendall(header + b"\x55" * sent)
        with pytest.raises(websockets.ConnectionClosed) as e:
            ws.recv(timeout=10)
    assert e.value.rcvd is not None and e.value.rcvd.code == 1009, e.value
    after = _rss(proc.pid)
    print(f"server RSS around a 256 MiB frame header + {sent // MiB} MiB: {before / MiB:.1f} -> {after / MiB:.1f} MiB")
    assert after - before < 32 * MiB, (before, after)
    assert len(_log_lines(proc, rf"refused a request .*\b{announced}\b", 1)) == 1


def test_the_request_limit_follows_the_policy_and_serve_max_request_mb(trained_run, loaded):
    runner = PolicyRunner(loaded)
    size = loaded.cfg.policy.image_size
    assert size * size * 3 < 1280 * 720 * 3  # the tiny policy's images are smaller than a raw camera frame
    # The documented rule: 4 x (2 cameras sent, each a 1280 x 720 RGB frame; state; 64 KiB prompt) + 16 MiB.
    want = 4 * (2 * 1280 * 720 * 3 + 8 * loaded.cfg.policy.state_dim + 64 * 1024) + 16 * MiB
    assert runner.max_request_bytes == default_max_request_bytes(runner) == want
    assert runner.metadata()["max_request_bytes"] == want
    assert PolicyRunner(load_exported(trained_run, ["serve.max_request_mb=1.5"])).max_request_bytes == int(1.5 * MiB)


@contextlib.contextmanager
def in_process_server(trained_run, *overrides: str, environ: dict[str, str] | None = None):
    """build_server + run in a thread of this process; yields the server once it listens."""
    server = build_server(str(trained_run), ["serve.port=0", *overrides], device="cpu", environ=environ or {})
    with serving_in_thread(server):
        yield server


def test_a_key_file_is_read_and_listening_beyond_localhost_without_a_key_is_warned_when_allowed(trained_run, tmp_path,
                                                                                               caplog):
    key_file = tmp_path / "api_key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    caplog.set_level(logging.WARNING, logger="slurmvla.serve")
    with in_process_server(trained_run, "serve.host=127.0.0.1", f"serve.api_key_file={key_file}") as server:
        obs = droid_obs(6)
        actions = wcp.WebsocketClientPolicy("127.0.0.1", server.port, api_key=KEY).infer(obs)["actions"]
        np.testing.assert_allclose(actions, reference(server.policy.loaded, obs), rtol=RTOL, atol=ATOL)
        with pytest.raises(Exception, match="HTTP 401"):
            wcp.WebsocketClientPolicy("127.0.0.1", server.port)
    assert not [r for r in caplog.records if "without an API key" in r.getMessage()]
    assert KEY not in caplog.text and KEY not in repr(server.api_key)
    with in_process_server(trained_run, "serve.host=0.0.0.0", "serve.allow_unauthenticated=true"):
        pass
    warned = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0] and "SLURMVLA_API_KEY" in warned[0], warned
    assert "serve.allow_unauthenticated=true" in warned[0], warned
    # A key file readable by others is served, with one warning.
    key_file.chmod(0o644)
    caplog.clear()
    assert read_api_key(server.policy.cfg.serve).matches(f"Api-Key {KEY}")
    assert "chmod 600" in caplog.text and KEY not in caplog.text


def test_listening_beyond_this_machine_without_a_key_refuses_to_start(trained_run):
    """The real entry point: one error line naming both ways out (a loopback host, a key and how it is
    given), exit 2, no traceback, nothing served."""
    env = {k: v for k, v in os.environ.items() if k != "SLURMVLA_API_KEY"}
    res = subprocess.run([sys.executable, "-m", "slurmvla.serve", str(trained_run), "--host", "0.0.0.0", "--port", "0"],
                         cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in res.stderr and "serving" not in res.stdout, res.stderr[-3000:]
    line = errors[0]
    assert line.startswith("error: serve.host=0.0.0.0 listens beyond this machine without an API key"), line
    for way_out in ("serve.host=127.0.0.1", "export SLURMVLA_API_KEY=<key>", "serve.api_key_file=",
                    "Authorization: Api-Key <key>", "serve.allow_unauthenticated=true"):
        assert way_out in line, (way_out, line)


@pytest.mark.parametrize("host, key, allowed, served", [
    ("127.0.0.1", False, False, True), ("::1", False, False, True), ("localhost", False, False, True),
    ("127.0.0.2", False, False, True),
    ("0.0.0.0", False, False, False), ("::", False, False, False), ("", False, False, False),
    ("10.1.2.17", False, False, False), ("gpu-node-7", False, False, False),
    ("0.0.0.0", True, False, True), ("10.1.2.17", True, False, True), ("0.0.0.0", False, True, True),
])
def test_only_a_loopback_host_a_key_or_allow_unauthenticated_lets_a_server_start(host, key, allowed, served):
    """Every way to build a server passes the same gate (PolicyServer itself checks, not only the CLI)."""
    api_key = ApiKey(KEY, "$SLURMVLA_API_KEY") if key else None
    if served:
        check_exposure(host, api_key, allowed)
        PolicyServer(Scripted(), host, 0, api_key=api_key, allow_unauthenticated=allowed).pool.shutdown()
        return
    with pytest.raises(ValueError, match="without an API key") as e:
        check_exposure(host, api_key, allowed)
    assert "serve.host=127.0.0.1" in str(e.value) and "serve.api_key_file" in str(e.value)
    with pytest.raises(ValueError, match="without an API key"):
        PolicyServer(Scripted(), host, 0, api_key=api_key, allow_unauthenticated=allowed)


def test_beyond_this_machine_with_a_key_or_allow_unauthenticated_the_server_starts(trained_run):
    """build_server on 0.0.0.0: with a key from the environment it starts and wants the key; with
    serve.allow_unauthenticated=true it starts without one; with neither it is refused before it listens."""
    with in_process_server(trained_run, "serve.host=0.0.0.0", environ={"SLURMVLA_API_KEY": KEY}) as server:
        assert server.api_key is not None and server.api_key.matches(f"Api-Key {KEY}")
        obs = droid_obs(8)
        actions = wcp.WebsocketClientPolicy("127.0.0.1", server.port, api_key=KEY).infer(obs)["actions"]
        np.testing.assert_allclose(actions, reference(server.policy.loaded, obs), rtol=RTOL, atol=ATOL)
    with in_process_server(trained_run, "serve.host=0.0.0.0", "serve.allow_unauthenticated=true") as server:
        assert server.api_key is None
    with pytest.raises(ValueError, match="serve.host=0.0.0.0 listens beyond this machine without an API key"):
        build_server(str(trained_run), ["serve.host=0.0.0.0", "serve.port=0"], device="cpu", environ={})


def _serve_sh(tmp_path: Path, args: list[str], env: dict[str, str], python: str = sys.executable) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("SLURMVLA_API_KEY", "SLURMVLA_API_KEY_FILE")}
    return subprocess.Popen(["bash", str(REPO / "sbatch" / "serve.sh"), *args], cwd=tmp_path, text=True,
                            env={**base, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "77", "SLURMVLA_HOME": str(REPO),
                                 "HOME": str(tmp_path), "PYTHON": python, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_sbatch_serve_writes_a_private_key_once_and_serves_with_it(trained_run, tmp_path):
    """sbatch/serve.sh without $SLURMVLA_API_KEY: a key in ~/.slurmvla_api_key (mode 600) that the server on
    0.0.0.0 requires and the job log never shows; the log says where it is and how a client sends it."""
    proc = _serve_sh(tmp_path, [str(trained_run), "--port", "0"], {})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"^serving .* on ws://\S+:(\d+) ", line):
                threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
                port = int(m.group(1))
                break
        else:
            raise AssertionError("server did not start:\n" + "".join(lines)[-3000:])
        key_file = tmp_path / ".slurmvla_api_key"
        assert key_file.stat().st_mode & 0o777 == 0o600
        key = key_file.read_text().strip()
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key), "not secrets.token_urlsafe(32)"
        obs = droid_obs(9)
        actions = wcp.WebsocketClientPolicy("127.0.0.1", port, api_key=key).infer(obs)["actions"]
        np.testing.assert_allclose(actions, reference(load_exported(trained_run), obs), rtol=RTOL, atol=ATOL)
        with pytest.raises(Exception, match="HTTP 401"):
            wcp.WebsocketClientPolicy("127.0.0.1", port)
    finally:
        stop(proc)
    log = "".join(lines)
    assert key not in log and "Traceback" not in log, log[-3000:]
    assert f"API key in {key_file}" in log and "Authorization: Api-Key KEY" in log and "api_key=KEY" in log, log
    # The next job reuses the key (a robot keeps it); $SLURMVLA_API_KEY, or a key source named on the
    # command line, is passed on instead of the file.
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\n[ "$1" = -m ] && {{ echo "ARGS $*"; exit 0; }}\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    for env, args, want in [({}, [], f"serve.api_key_file={key_file}"),
                            ({"SLURMVLA_API_KEY": "k"}, [], None),
                            ({}, ["serve.api_key_file=/elsewhere"], "serve.api_key_file=/elsewhere"),
                            ({}, ["serve.allow_unauthenticated=true"], None)]:
        out = _serve_sh(tmp_path, ["run_dir", *args], env, python=str(stub)).communicate(timeout=60)[0]
        [called] = [line for line in out.splitlines() if line.startswith("ARGS ")]
        assert called.count("serve.api_key_file=") == (want is not None) and (want is None or want in called), out
    assert key_file.read_text().strip() == key


@pytest.mark.parametrize("args, environ, expected", [
    (["serve.api_key_file={tmp}/missing"], {}, "serve.api_key_file={tmp}/missing: cannot read the API key file "
                                               "(No such file or directory)"),
    (["serve.api_key_file={tmp}"], {}, "cannot read the API key file"),
    (["serve.api_key_file={tmp}/empty"], {}, "serve.api_key_file={tmp}/empty holds an empty API key"),
    ([], {"SLURMVLA_API_KEY": " "}, "$SLURMVLA_API_KEY holds an empty API key"),
    ([], {"SLURMVLA_API_KEY": "two words"}, "holds spaces, control or non-ASCII characters"),
    (["serve.api_key_env=ROBOT_KEY"], {}, "serve.api_key_env=ROBOT_KEY names a variable that is not set"),
    (["serve.api_key_file={tmp}/key"], {"SLURMVLA_API_KEY": "other"}, "hold different API keys"),
    (["serve.api_key_env=" + KEY.replace("-", "_") + "!"], {}, "must be the NAME of an environment variable"),
    (["--max-request-mb", "abc"], {}, "--max-request-mb 'abc' is not a number of MiB"),
    (["--max-request-mb", "0"], {}, "serve.max_request_mb=0.0 is not a size"),
    (["serve.max_request_mb=lots"], {}, "serve.max_request_mb"),  # the composition's own type error, on one line
])
def test_bad_keys_and_sizes_fail_at_start_with_one_line(trained_run, tmp_path, monkeypatch, capsys, args, environ,
                                                        expected):
    from slurmvla import serve

    (tmp_path / "empty").write_text("\n")
    (tmp_path / "key").write_text(KEY)
    monkeypatch.delenv("SLURMVLA_API_KEY", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        serve.main([str(trained_run), "--port", "0", *(a.format(tmp=tmp_path) for a in args)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert expected.format(tmp=tmp_path) in err, err
    # A key, or a value put in serve.api_key_env by mistake, never reaches the terminal.
    assert KEY not in err and KEY.replace("-", "_") not in err and "two words" not in err, err


def test_serve_seed_null_draws_fresh_noise_per_request(trained_run):
    """serve.seed=N: the same observation gives the same chunk; serve.seed=null: a new draw each request
    (openpi's server), each still a chunk the policy samples (its spread matches seeded draws')."""
    fixed = PolicyRunner(load_exported(trained_run, ["serve.seed=3"]))
    fresh = PolicyRunner(load_exported(trained_run, ["serve.seed=null"]))
    batch = fixed.processor.batch(collections.deque([fixed.processor.read(droid_obs(5))], maxlen=1))
    a, b = fixed.act(batch), fixed.act(batch)
    np.testing.assert_array_equal(a, b)
    draws = np.stack([fresh.act(batch) for _ in range(4)])
    assert len({d.tobytes() for d in draws}) == 4, "serve.seed=null repeated a draw"
    seeded = np.stack([PolicyRunner(load_exported(trained_run, [f"serve.seed={s}"])).act(batch) for s in range(4)])
    assert 0.3 < draws.std(0).mean() / seeded.std(0).mean() < 3.0


def test_serve_seed_draws_unrelated_noise_for_each_observation(trained_run):
    """serve.seed=N seeds each request by the seed and the observation: one observation keeps its draw, any change
    to it (a joint, one pixel, the prompt) draws anew, and over a closed loop's stream of observations the draws
    are standard normal across requests (one fixed draw for every request would have a spread of zero)."""
    runner = PolicyRunner(load_exported(trained_run, ["serve.seed=3"]))
    pc = runner.cfg.policy

    def noise(obs: dict, seed: int = 3) -> np.ndarray:
        batch = runner.processor.batch(collections.deque([runner.processor.read(obs)], maxlen=1))
        g = torch.Generator().manual_seed(request_seed(seed, batch))
        return torch.randn((pc.action_horizon, pc.action_dim), generator=g).numpy()

    obs = droid_obs(5)
    np.testing.assert_array_equal(noise(obs), noise(droid_obs(5)))
    changed = [dict(obs, **{"observation/joint_position": obs["observation/joint_position"] + 1e-3}),
               dict(obs, prompt="close the drawer"), dict(obs)]
    changed[2]["observation/wrist_image_left"] = obs["observation/wrist_image_left"].copy()
    changed[2]["observation/wrist_image_left"][100:104, 100:104, 0] ^= 1  # 4 x 4 pixels: one pixel of the 64 px frame
    draws = [noise(o).tobytes() for o in [obs, *changed]] + [noise(obs, seed=4).tobytes()]
    assert len(set(draws)) == 5, [draws.index(d) for d in draws]
    # A stream of nearby observations (the arm moving a little each step): per chunk element, the draws across
    # 200 requests have mean ~ 0 (standard error 0.07) and standard deviation ~ 1.
    stream = np.stack([noise(dict(obs, **{"observation/joint_position": obs["observation/joint_position"] + 1e-4 * i}))
                       for i in range(200)])
    assert np.abs(stream.mean(0)).max() < 0.35, stream.mean(0)
    assert 0.8 < stream.std(0).mean() < 1.2, stream.std(0)


class Scripted:
    """A policy as openpi's BasePolicy has it, and nothing of slurmvla: ``infer(obs) -> {"actions"}`` and metadata."""

    def __init__(self):
        self.seen: list[dict] = []

    def infer(self, obs: dict) -> dict:
        if "joints" not in obs:
            raise ValueError("missing key 'joints'")
        self.seen.append(obs)
        return {"actions": np.full((4, 2), float(obs["joints"].sum()), np.float32)}

    def metadata(self) -> dict:
        return {"action_horizon": 4, "server": "scripted"}


def test_any_object_with_infer_is_served_to_openpis_client():
    """The server's one-method protocol (InferencePolicy): a plain object with infer(obs) -> {"actions"} (and
    metadata) answers openpi's own client with that object's actions, its server_timing added; its ValueError
    is the client's error, as the runner's are."""
    policy = Scripted()
    assert isinstance(policy, InferencePolicy)
    server = PolicyServer(policy, "127.0.0.1", 0)
    with serving_in_thread(server) as port:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        assert client.get_server_metadata() == {"action_horizon": 4, "server": "scripted"}
        for i in range(3):
            joints = np.arange(7, dtype=np.float64) * i
            reply = client.infer({"joints": joints, "prompt": "pick"})
            np.testing.assert_array_equal(reply["actions"], np.full((4, 2), joints.sum(), np.float32))
            assert set(reply["server_timing"]) == ({"infer_ms", "total_ms"} | ({"prev_total_ms"} if i else set()))
        with pytest.raises(RuntimeError, match="bad request: missing key 'joints'"):
            client.infer({"prompt": "pick"})
    assert len(policy.seen) == 3 and policy.seen[1]["prompt"] == "pick"


class Limited:
    """``infer`` and a request-size limit, nothing else."""

    max_request_bytes = 1234

    def infer(self, obs: dict) -> dict:
        return {"actions": np.zeros((1, 1), np.float32)}


class PerConnection(Scripted):
    """A fresh Scripted for each connection."""

    def session(self) -> Scripted:
        return Scripted()


@pytest.mark.parametrize("policy, capabilities", [(Scripted(), {SupportsMetadata}), (Limited(), {SupportsRequestLimit}),
                                                  (PerConnection(), {SupportsMetadata, SupportsSessions})])
def test_the_servers_optional_capabilities_are_what_their_protocols_declare(policy, capabilities):
    """Each optional capability is read through its protocol: what a policy lacks, the server does without (no
    metadata, the policy itself for every connection, the default request limit)."""
    assert {c for c in (SupportsMetadata, SupportsSessions, SupportsRequestLimit) if isinstance(policy, c)} == capabilities
    server = PolicyServer(policy, "127.0.0.1", 0)
    try:
        assert server.metadata() == (policy.metadata() if SupportsMetadata in capabilities else {})
        assert server.max_size == (1234 if SupportsRequestLimit in capabilities else DEFAULT_MAX_REQUEST_BYTES)
        sessions = server._session(), server._session()
        if SupportsSessions in capabilities:
            assert all(type(s) is Scripted for s in sessions) and sessions[0] is not sessions[1]
        else:
            assert all(s is policy for s in sessions)
    finally:
        server.pool.shutdown()
    with pytest.raises(TypeError, match="serves an object with infer"):
        PolicyServer(object(), "127.0.0.1", 0)
