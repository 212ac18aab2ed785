"""The policy server, driven by openpi's published client package (openpi-client, installed with
--no-deps by scripts/test.sh: it pins numpy<2 but runs on numpy 2).

The server runs as its own process (``python -m slurmvla.serve``), started and stopped by PID here.
Reference actions come from the policy loaded in this process: the same inputs prepared by hand and
``sample_actions`` under the same seed.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.data.prepare import prepare_image
from slurmvla.export import Loaded, load_exported
from slurmvla.policy import build_policy
from slurmvla.serve import PolicyRunner

wcp = pytest.importorskip("openpi_client.websocket_client_policy", reason="pip install --no-deps openpi-client")
image_tools = pytest.importorskip("openpi_client.image_tools")

REPO = Path(__file__).resolve().parents[1]
# Same fp32 operations on the same CPU, in another process and thread: only the split of intra-op
# reductions over threads can differ, which moves results by a few ulp of float32.
RTOL, ATOL = 1e-5, 1e-6


def start_server(source: Path, *args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "slurmvla.serve", str(source), "--host", "127.0.0.1", "--port", "0",
                             *args], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* on ws://127\.0\.0\.1:(\d+)", line)
        if m:
            # Keep draining the log so the server never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
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
    torch.manual_seed(cfg.serve.seed)
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
def test_bad_sources_and_overrides_fail_at_start_with_one_line(trained_run, args, expected):
    args = [a.format(run=trained_run) for a in args]
    res = subprocess.run([sys.executable, "-m", "slurmvla.serve", *args, "--port", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert expected in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_history_frames_follow_training_layout(sample_root):
    """With observation history, each connection keeps its own past: the first request repeats its
    frame masked (as training masks frames before the episode start), later ones take the frames
    history_interval requests apart."""
    cfg = compose([f"data.root={sample_root}", "policy.num_obs_history=2", "data.num_obs_history=2",
                   "data.history_interval=2"])
    runner = PolicyRunner(Loaded(build_policy(cfg.policy).eval(), cfg, 0, "memory"))
    past: collections.deque = collections.deque(maxlen=runner.history)
    size = cfg.policy.image_size
    frames = []
    for i in range(4):
        obs = droid_obs(20 + i)
        past.append(runner.read(obs))
        frames.append(prepare_image(obs["observation/exterior_image_1_left"], size))
        batch = runner.batch(past)
        assert batch["images"].shape == (1, 6, size, size, 3)
        older = i - 2 if i >= 2 else 0
        assert torch.equal(batch["images"][0, 0], torch.from_numpy(frames[older]))
        assert torch.equal(batch["images"][0, 3], torch.from_numpy(frames[i]))
        assert batch["image_mask"][0].tolist() == [i >= 2, False, i >= 2, True, False, True]
        assert batch["state"].shape == (1, 2, 8)
    assert runner.policy.sample_actions(batch).shape == (1, cfg.policy.action_horizon, cfg.policy.action_dim)


def test_a_plug_in_policy_is_served_through_the_same_contract(sample_root, example_policy):
    """The server calls only the contract: a user's class (the MLP example) is served as the built-in is."""
    cfg = compose([f"data.root={sample_root}", "policy=custom", f"policy.target={example_policy}"])
    torch.manual_seed(0)
    policy = build_policy(cfg.policy).eval()
    runner = PolicyRunner(Loaded(policy, cfg, 0, "memory"))
    obs = droid_obs(30, raw=True)
    got = runner.infer(runner.batch(collections.deque([runner.read(obs)])))
    size = cfg.policy.image_size
    images = np.stack([prepare_image(obs["observation/exterior_image_1_left"], size), np.zeros((size, size, 3), np.uint8),
                       prepare_image(obs["observation/wrist_image_left"], size)])
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]]).astype(np.float32)
    with torch.no_grad():
        want = policy.sample_actions({"images": torch.from_numpy(images)[None], "image_mask": torch.tensor([[1, 0, 1]]).bool(),
                                      "state": torch.from_numpy(state)[None]})[0].numpy()
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
