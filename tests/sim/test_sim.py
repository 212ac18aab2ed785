"""The closed loop: the simulated pick task, its scripted expert, the demonstrations as a LeRobot dataset,
and episodes driven through the real policy server and openpi's published client.

References: the expert's own episodes (the simulator is deterministic for a seed), the frames the
environment renders, a hand-computed Wilson interval."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("slurmvla.sim.pick.env", reason="the [sim] extra (MuJoCo): bash scripts/install.sh sim")
pytest.importorskip("openpi_client.websocket_client_policy", reason="pip install --no-deps openpi-client")

from slurmvla.compose import compose  # noqa: E402
from slurmvla.data.prepare import prepare_image  # noqa: E402
from slurmvla.inference.closed_loop import wilson_interval  # noqa: E402
from slurmvla.rollout import main as rollout_main  # noqa: E402
from slurmvla.rollout import run  # noqa: E402
from slurmvla.sim.pick.dataset import HOLD_STEPS, expert_episode  # noqa: E402
from slurmvla.sim.pick.env import PickCube  # noqa: E402
from slurmvla.sim.pick.expert import Expert  # noqa: E402
from slurmvla.sim.record import record  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EPISODES = 6
# Small frames keep the recording quick; the layout is DROID's.
HEIGHT, WIDTH = 72, 128


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sim") / "demos"
    record(root, "pick", episodes=EPISODES, first_seed=0, height=HEIGHT, width=WIDTH, episodes_per_file=4)
    return root


def _train(demos: Path, run_dir: Path, *overrides: str) -> Path:
    from slurmvla.trainer import Trainer

    cfg = compose(["experiment=sim_pick", f"data.root={demos}", "data.num_workers=0", "logging.wandb.mode=disabled",
                   "trainer.progress_bar=false", "trainer.global_batch_size=8", "trainer.log_every_steps=1",
                   "data.val_fraction=0", "trainer.val_every_steps=0", *overrides])
    trainer = Trainer(cfg, run_dir)
    trainer.fit()
    trainer.close()
    return run_dir


def _reference_policy(demos: Path, run_dir: Path, name: str, steps: int = 1) -> Path:
    return _train(demos, run_dir, "policy=custom", f"policy.target=slurmvla.policy.baselines.{name}",
                  f"+policy.kwargs={{root: '{demos}'}}" if name == "ReplayPolicy" else "policy.kwargs={}",
                  f"trainer.max_steps={steps}", f"checkpoint.every_steps={steps}")


def test_the_expert_succeeds_on_at_least_90_percent_of_seeded_episodes():
    env = PickCube(height=HEIGHT, width=WIDTH)
    wins, starts = 0, set()
    for seed in range(1000, 1050):
        env.reset(seed)
        starts.add(tuple(np.round(env.cube_position()[:2], 4)))
        expert = Expert()
        for _ in range(100):
            if env.step(expert.act(env)).success:
                wins += 1
                break
    assert len(starts) == 50, "the cube's start is not drawn from the seed"
    assert wins / 50 >= 0.9, f"expert success rate {wins / 50:.2f}"


def test_two_cubes_mirror_each_other_and_either_one_lifted_succeeds():
    """rollout.task=two_cubes: the cubes stand at (x, y) and (x, -y); the expert lifts the one the seed drew (both
    drawn over the seeds) and leaves the other on the table; lifting the other one succeeds as well."""
    import mujoco

    from slurmvla.sim.pick.env import CUBE_HALF, LIFT_HEIGHT, MIN_MIRROR_Y, TWO_CUBES_INSTRUCTION

    env = PickCube(height=HEIGHT, width=WIDTH, cubes=2)
    assert env.instruction == TWO_CUBES_INSTRUCTION
    targets = []
    for seed in range(10):
        ep = expert_episode(env, seed, render=False)
        env.reset(seed)
        a, b = env.cube_position(0), env.cube_position(1)
        assert a[0] == b[0] and a[1] == -b[1] and a[1] >= MIN_MIRROR_Y, (a, b)
        assert not env.success() and env.steps == 0
        targets.append(env.target)
        assert ep["success"], seed
    assert set(targets) == {0, 1}
    # Replayed from the seed, the expert's episode ends with its cube lifted and the other one where it stood.
    env.reset(3)
    expert, other = Expert(), 1 - env.target
    start = env.cube_position(other)
    while not env.step(expert.act(env)).success:
        assert env.steps < 100
    assert env.lifted(env.target) > LIFT_HEIGHT
    np.testing.assert_allclose(env.cube_position(other), start, atol=2e-3)
    # The other cube lifted (placed by hand) succeeds too, and its reward is the best of the two.
    env.reset(3)
    adr = env.model.jnt_qposadr[env.model.joint(("cube", "cube2")[other]).id]
    env.data.qpos[adr + 2] = CUBE_HALF + LIFT_HEIGHT + 0.01
    mujoco.mj_forward(env.model, env.data)
    assert env.success() and env.reward() >= 0.5
    env.close()


@pytest.mark.parametrize("args, message", [
    (["--env", "libero"], "--env='libero' is not valid; choose one of ['metaworld', 'mt50', 'pick']"),
    (["--env", "metaworld"], "--env metaworld needs --task"),
    (["--task", "three_cubes"], "--task='three_cubes' is not a variant of the pick task (--env pick); choose one of "
                                "['two_cubes'] or null (one cube)"),
])
def test_the_recorder_names_a_bad_embodiment_or_task_and_writes_nothing(args, message, tmp_path, capsys):
    from slurmvla.sim.record import main as record_main

    with pytest.raises(SystemExit) as exit_:
        record_main(["--out", str(tmp_path / "demos"), *args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "demos").exists()


def test_an_episode_is_a_function_of_its_seed():
    env = PickCube(height=HEIGHT, width=WIDTH)
    a, b, c = (expert_episode(env, s, render=False) for s in (3, 3, 4))
    np.testing.assert_array_equal(a["state"], b["state"])
    np.testing.assert_array_equal(a["joint_velocity"], b["joint_velocity"])
    assert not np.array_equal(a["state"][0], c["state"][0])


def test_demonstrations_read_back_through_the_data_layer_as_recorded(demos):
    from slurmvla.data.source import LeRobotSource, dataset_specs
    from tests.conftest import policy_spec

    info = json.loads((demos / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == EPISODES
    assert info["features"]["observation.images.wrist_left"]["info"]["video.codec"] == "av1"
    summary = json.loads((demos / "sim.json").read_text())
    assert summary["seeds"] == list(range(EPISODES)) and all(summary["success"])
    # The dataset as the trainer reads it (the keep-ranges filter on: every step kept), against the
    # expert's episode re-run from its seed. Episode 5 sits in the second file of the dataset.
    cfg = compose([f"data.root={demos}", "experiment=sim_pick", "data.val_fraction=0", "data.image_resize=squash"])
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, horizon=4), seed=0)
    env = PickCube(height=HEIGHT, width=WIDTH)
    ep = expert_episode(env, 5, render=True)
    episode = source.load_episode(5)
    assert source.index.counts["samples"] == summary["frames"], source.index.counts
    t = 7
    sample = source.sample(episode, t, epoch=0)
    np.testing.assert_array_equal(sample["state"].numpy(), ep["state"][t])
    want = np.concatenate([ep["joint_velocity"], ep["action"][:, 7:]], axis=1)[t : t + 4]
    np.testing.assert_array_equal(sample["actions"].numpy(), want)
    assert sample["instruction"] in ("pick up the red cube", "lift the red cube off the table", "grasp the cube and lift it")
    # Frames: AV1 at CRF 30, resized as training resizes, against what the environment rendered resized
    # the same way (the codec's tolerance); another step's frame is much further away.
    size = cfg.policy.image_size
    for c, cam in enumerate(("exterior_1_left", "wrist_left")):
        decoded = sample["images"][c].numpy().astype(np.float64)
        rendered = [prepare_image(ep["frames"][cam][k], size, mode="squash").astype(np.float64) for k in (t, t + 15)]
        assert np.abs(decoded - rendered[0]).mean() < 4.5, cam  # measured: 2.3 (exterior), 3.1 (wrist)
        assert np.abs(decoded - rendered[1]).mean() > 2 * np.abs(decoded - rendered[0]).mean(), cam


def test_wilson_interval_matches_hand_computed_values():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.23659, abs=1e-4), pytest.approx(0.76341, abs=1e-4))
    lo, hi = wilson_interval(50, 50)
    assert lo == pytest.approx(0.92865, abs=1e-4) and hi == pytest.approx(1.0)  # n / (n + z^2), 1


@pytest.fixture(scope="module")
def replay_run(demos, tmp_path_factory) -> Path:
    return _reference_policy(demos, tmp_path_factory.mktemp("replay") / "run", "ReplayPolicy")


def test_replaying_the_recorded_actions_through_server_and_client_reproduces_the_expert(demos, replay_run):
    run_dir = replay_run
    summary = run(str(run_dir), ["rollout.first_seed=0", f"rollout.episodes={EPISODES}", "rollout.replan_steps=4",
                                 f"rollout.height={HEIGHT}", f"rollout.width={WIDTH}", "rollout.videos=1"])
    recorded = json.loads((demos / "sim.json").read_text())
    assert summary["rollout/success_rate"] == np.mean(recorded["success"]) == 1.0
    # The same trajectories: each episode succeeds at the step its demonstration did.
    lengths = {e["seed"]: e["length"] for e in summary["episodes"]}
    env = PickCube(height=HEIGHT, width=WIDTH)
    for seed in range(EPISODES):
        demo_len = len(expert_episode(env, seed, render=False)["state"])
        assert lengths[seed] == demo_len - HOLD_STEPS, (seed, lengths[seed], demo_len)
    out = Path(summary["out"]).parent
    assert (out / "episode_0.mp4").stat().st_size > 1000
    assert summary["episodes"][0]["requests"] == -(-lengths[0] // 4)


def test_a_policy_that_outputs_zeros_never_succeeds(demos, tmp_path):
    run_dir = _reference_policy(demos, tmp_path / "zero", "ZeroPolicy")
    summary = run(str(run_dir), ["rollout.first_seed=0", "rollout.episodes=3", "rollout.max_steps=30",
                                 f"rollout.height={HEIGHT}", f"rollout.width={WIDTH}", "rollout.videos=0"])
    assert summary["rollout/success_rate"] == 0.0
    assert all(e["length"] == 30 for e in summary["episodes"])
    # Its default folder (the run's rollout/step_N/, where training's periodic evaluation of that step goes too)
    # now holds a summary: a second rollout there is refused, naming it, and the first is left as it was.
    written = Path(summary["out"])
    before = written.read_bytes()
    args = ["rollout.first_seed=0", "rollout.episodes=2", "rollout.max_steps=30", f"rollout.height={HEIGHT}",
            f"rollout.width={WIDTH}", "rollout.videos=0"]
    with pytest.raises(ValueError, match=f"{re.escape(str(written))} already holds an evaluation .* --out DIR"):
        run(str(run_dir), args)
    assert written.read_bytes() == before
    # --out names the folder (it used to apply to --merge alone and was ignored otherwise).
    rollout_main([str(run_dir), *args, "--out", str(tmp_path / "final")])
    again = json.loads((tmp_path / "final" / "rollout.json").read_text())
    assert again["rollout/episodes"] == 2 and written.read_bytes() == before


def _rollout_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmvla.rollout", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_rollout_against_a_running_server_by_address_in_shards_then_merged(replay_run, tmp_path):
    from tests.inference.test_serve import start_server, stop

    proc, port = start_server(replay_run)
    try:
        common = ["rollout.first_seed=0", "rollout.episodes=3", f"rollout.height={HEIGHT}", f"rollout.width={WIDTH}",
                  f"rollout.out={tmp_path}", "rollout.videos=0"]
        for shard in ("0/2", "1/2"):
            done = _rollout_cli(f"ws://127.0.0.1:{port}", *common, "--shard", shard)
            assert done.returncode == 0, done.stderr[-3000:]
            assert "success rate 1.000" in done.stdout
    finally:
        stop(proc)
    parts = [json.loads((tmp_path / f"rollout_shard{i}of2.json").read_text()) for i in range(2)]
    assert [[e["seed"] for e in p["episodes"]] for p in parts] == [[0, 2], [1]]
    done = _rollout_cli("--merge", *(str(tmp_path / f"rollout_shard{i}of2.json") for i in range(2)),
                        "--out", str(tmp_path / "rollout.json"))
    assert done.returncode == 0, done.stderr
    merged = json.loads((tmp_path / "rollout.json").read_text())
    assert merged["rollout/episodes"] == 3 and merged["rollout/successes"] == 3 and merged["shards"] == 2


@pytest.mark.parametrize("args, expected", [
    (["ws://127.0.0.1"], "is not a server address; write it as ws://HOST:PORT"),
    (["ws://127.0.0.1:1", "policy.action_horizon=4"], "only rollout.* overrides apply"),
    (["ws://127.0.0.1:1", "rollout.episodez=4"], "rollout.episodez is not a setting; choose from"),
    (["ws://127.0.0.1:1", "rollout.episodes=0"], "rollout.episodes=0"),
    (["ws://127.0.0.1:1", "rollout.execution=rtx"], "rollout.execution='rtx' is not valid; choose one of"),
    (["ws://127.0.0.1:1", "--shard", "2/2"], "--shard '2/2': I must be in 0..N-1"),
    (["/nonexistent/run"], "'/nonexistent/run' does not exist"),
])
def test_bad_rollout_input_fails_with_one_line(args, expected):
    done = _rollout_cli(*args, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], done.stderr


def test_an_unreachable_server_is_one_line(tmp_path):
    done = _rollout_cli("ws://127.0.0.1:9", "rollout.episodes=1", "rollout.connect_timeout_s=1", timeout=60)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: cannot reach"), done.stderr


def test_training_rolls_out_every_n_steps_on_every_rank_and_logs_the_success_rate(demos, tmp_path):
    """Two DDP ranks (torchrun, gloo) each run their share of the episodes; rank 0 logs all of them."""
    from tests.conftest import run_train

    run_dir = tmp_path / "run"
    run_train(["experiment=sim_pick", f"data.root={demos}", "engine=ddp", "policy=custom",
               "policy.target=slurmvla.policy.baselines.ReplayPolicy", f"+policy.kwargs={{root: '{demos}'}}",
               "data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
               "trainer.global_batch_size=8", "trainer.max_steps=2", "trainer.log_every_steps=1",
               "trainer.val_every_steps=0", "data.val_fraction=0", "trainer.rollout_every_steps=1",
               "rollout.first_seed=0", "rollout.episodes=3", f"rollout.height={HEIGHT}", f"rollout.width={WIDTH}",
               "rollout.videos=1", "checkpoint.every_steps=2", f"hydra.run.dir={run_dir}"], nproc=2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if "rollout/success_rate" in r]
    assert [r["step"] for r in rollouts] == [1, 2]
    assert all(r["rollout/episodes"] == 3 and r["rollout/success_rate"] == 1.0 for r in rollouts)
    summary = json.loads((run_dir / "rollout" / "step_00000002" / "rollout.json").read_text())
    assert sorted(e["seed"] for e in summary["episodes"]) == [0, 1, 2]
    assert (run_dir / "rollout" / "step_00000002" / "episode_0.mp4").is_file()


def test_a_sharding_engine_refuses_in_training_rollouts_at_start(demos):
    with pytest.raises(ValueError, match="trainer.rollout_every_steps=5 runs closed-loop episodes .* engine='fsdp_full'"):
        compose(["experiment=sim_pick", f"data.root={demos}", "engine=fsdp_full", "trainer.rollout_every_steps=5"])


def test_spatial_softmax_finds_where_a_feature_fires():
    import torch

    from slurmvla.policy.keypoints.model import SpatialSoftmax

    maps = torch.zeros(1, 2, 5, 9)
    maps[0, 0, 1, 6] = 50.0  # row 1 of 5 -> y = -0.5; column 6 of 9 -> x = 0.5
    maps[0, 1, 4, 0] = 50.0  # y = 1, x = -1
    points = SpatialSoftmax()(maps)[0]
    torch.testing.assert_close(points, torch.tensor([-0.5, 1.0, 0.5, -1.0]), atol=1e-4, rtol=0)


def test_the_standardized_spatial_softmax_is_the_hand_computed_one_and_sees_a_faint_feature():
    """``spatial_norm``: each map standardized over its positions and scaled by its channel's temperature before the
    softmax (numpy by hand below); a map's offset and scale then do not matter. The faint feature is the point: a
    map that varies by 0.1 across the image (what a small convolution gives at initialization) leaves the raw
    softmax's keypoint at the centre wherever the feature is, and the standardized one finds it."""
    import torch

    from slurmvla.policy.keypoints.model import SpatialSoftmax

    g = torch.Generator().manual_seed(0)
    maps = torch.randn(2, 3, 6, 8, generator=g, dtype=torch.float64)
    layer = SpatialSoftmax(3).double()
    with torch.no_grad():
        layer.log_temperature.copy_(torch.tensor([0.0, 0.5, -1.0]))
    m = maps.numpy().reshape(2, 3, -1)
    z = (m - m.mean(-1, keepdims=True)) / (m.std(-1, ddof=1, keepdims=True) + 1e-5) * np.exp([0.0, 0.5, -1.0])[:, None]
    w = np.exp(z - z.max(-1, keepdims=True))
    w = (w / w.sum(-1, keepdims=True)).reshape(2, 3, 6, 8)
    ys, xs = np.linspace(-1, 1, 6), np.linspace(-1, 1, 8)
    expected = np.concatenate([(w.sum(3) * ys).sum(2), (w.sum(2) * xs).sum(2)], axis=1)
    np.testing.assert_allclose(layer(maps).detach().numpy(), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(layer(3.0 * maps - 7.0).detach().numpy(), expected, rtol=0, atol=1e-5)  # up to the 1e-5

    faint = torch.zeros(2, 1, 24, 24)
    faint[0, 0, 3:6, 3:6] = 0.1  # top left
    faint[1, 0, 18:21, 18:21] = 0.1  # bottom right
    raw, standardized = SpatialSoftmax()(faint), SpatialSoftmax(1)(faint).detach()
    assert (raw[0] - raw[1]).abs().max() < 0.01, raw  # the centre, both times
    assert (standardized[1] - standardized[0]).min() > 1.0, standardized  # y and x: from top left to bottom right

    # Through the config: the option on adds one temperature per keypoint and encoder; off (the default), the
    # encoder earlier runs trained, parameter for parameter.
    from slurmvla.policy import build_policy

    def names(*extra: str) -> set[str]:
        cfg = compose(["experiment=sim_pick", "policy=keypoints_flow", "data.root=/any/where", *extra])
        return set(build_policy(cfg.policy, None).state_dict())

    plain, on = names(), names("policy.kwargs.spatial_norm=true")
    assert not any("log_temperature" in k for k in plain)
    assert on - plain == {f"encoders.{i}.5.log_temperature" for i in range(2)}, on - plain  # 2 cameras, 1 frame


def test_the_resnet18_encoder_is_resnet18s_trunk_and_feeds_the_spatial_softmax():
    """``policy.kwargs.encoder=resnet18``: Diffusion Policy's image trunk. At width 64 its parameter count is
    torchvision's ``resnet18`` less the classifier (11,689,512 - 512 * 1000 - 1000: BatchNorm's and GroupNorm's
    affine parameters are as many), a 96 px image gives 3 x 3 maps (five halvings), and the policy built through
    the config reads one such trunk per camera and frame into the same features; a bad name is one clear error."""
    import torch

    from slurmvla.policy import build_policy
    from slurmvla.policy.keypoints.model import BasicBlock, resnet18

    trunk = resnet18(64)
    assert sum(p.numel() for p in trunk.parameters()) == 11_689_512 - 512 * 1000 - 1000
    assert sum(isinstance(m, BasicBlock) for m in trunk.modules()) == 8  # 4 stages x 2 blocks: 18 = 1 + 8 x 2 + 1
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in trunk.modules())
    assert trunk(torch.zeros(2, 3, 96, 96)).shape == (2, 512, 3, 3)

    cfg = compose(["experiment=metaworld", "policy=keypoints", "data.root=/any/where", "policy.kwargs.encoder=resnet18",
                   "policy.kwargs.width=8", "policy.kwargs.spatial_norm=true"])
    policy = build_policy(cfg.policy, None)
    assert len(policy.encoders) == 2 and isinstance(policy.encoders[0][0][4], BasicBlock)  # 1 camera x 2 frames
    size = cfg.policy.image_size
    batch = {"images": torch.randint(0, 256, (3, 2, size, size, 3), dtype=torch.uint8),
             "image_mask": torch.ones(3, 2, dtype=torch.bool), "state": torch.zeros(3, 2, 9)}
    assert policy.features(batch).shape == (3, 2 * 2 * 16 + 2 * 9)
    assert policy.sample_actions(batch).shape == (3, 4, 4)

    bad = compose(["experiment=metaworld", "policy=keypoints", "data.root=/any/where", "policy.kwargs.encoder=vit"])
    with pytest.raises(ValueError, match=r"policy.kwargs.encoder='vit' is not valid; choose one of \['conv', 'resnet18'\]"):
        build_policy(bad.policy, None)
    zero = compose(["experiment=metaworld", "policy=keypoints", "data.root=/any/where", "policy.kwargs.encoder=resnet18",
                    "policy.kwargs.width=0"])
    with pytest.raises(ValueError, match=r"policy.kwargs.width=0 is not valid: the first stage's channels"):
        build_policy(zero.policy, None)


def test_the_keypoint_policy_keeps_the_contract_and_regresses_chunks_in_data_units(demos):
    import torch

    from slurmvla.policy import build_policy

    cfg = compose(["experiment=sim_pick", f"data.root={demos}"])
    stats = {"state_offset": torch.full((8,), 0.5), "state_scale": torch.full((8,), 2.0),
             "action_offset": torch.arange(8.0), "action_scale": torch.full((8,), 3.0)}
    policy = build_policy(cfg.policy, stats)
    b, size = 3, cfg.policy.image_size
    batch = {"images": torch.randint(0, 256, (b, 2, size, size, 3), dtype=torch.uint8),
             "image_mask": torch.tensor([[True, True], [True, False], [True, True]]),
             "state": torch.randn(b, 8), "actions": torch.randn(b, 8, 8), "action_mask": torch.ones(b, 8, dtype=torch.bool)}
    out = policy(batch)
    assert out["loss"].ndim == 0 and out["components"]["mse"][0].shape == (b,)
    chunk = policy.sample_actions(batch)
    assert chunk.shape == (b, 8, 8)
    # In data units: the normalized prediction scaled back by the action statistics.
    torch.testing.assert_close(chunk, policy._predict(batch) * 3.0 + torch.arange(8.0))


def test_the_keypoint_policy_learns_where_a_dot_is():
    """The spatial softmax's point: from images alone, regress the position of a bright dot. A policy
    blind to where things are in the image can do no better than the targets' variance (1 here)."""
    import dataclasses

    import torch

    from slurmvla.policy import build_policy

    cfg = compose(["experiment=sim_pick", "data.root=/any/where"])
    pcfg = dataclasses.replace(cfg.policy, image_size=32, num_cameras=1, action_horizon=1, action_dim=2)
    torch.manual_seed(0)
    policy = build_policy(pcfg, None)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> dict:
        rc = torch.randint(2, 30, (n, 2), generator=g)
        images = torch.zeros(n, 1, 32, 32, 3, dtype=torch.uint8)
        for i, (r, c) in enumerate(rc.tolist()):
            images[i, 0, r - 1 : r + 2, c - 1 : c + 2] = 255
        target = (rc.float() - 15.5) / 8.1  # ~unit variance
        return {"images": images, "image_mask": torch.ones(n, 1, dtype=torch.bool), "state": torch.zeros(n, 8),
                "actions": target[:, None, :], "action_mask": torch.ones(n, 1, dtype=torch.bool)}

    for _ in range(300):
        loss = policy(batch(32))["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    test = batch(256)
    with torch.no_grad():
        mse = (policy.sample_actions(test) - test["actions"]).square().mean().item()
    assert mse < 0.1, mse


def _before(client, cfg, seed: int) -> dict:
    """An episode as the closed loop ran it before execution modes: replan_steps actions of each chunk, then
    ask and wait (the environment standing still)."""
    from slurmvla.sim.pick.dataset import INSTRUCTIONS
    from slurmvla.sim.pick.env import CLIENT_CAMERAS

    meta = client.get_server_metadata()
    wanted = [k for k in meta["cameras"].values() if k]
    env = PickCube(height=cfg.height, width=cfg.width, cameras=tuple(CLIENT_CAMERAS.values()))
    env.reset(seed)
    plan, total, requests, actions = [], 0.0, 0, []
    for _ in range(cfg.max_steps):
        if not plan:
            obs = env.observe(tuple(wanted))
            request = {k: obs[k] for k in [*wanted, *meta["state"]]} | {meta.get("prompt") or "prompt": INSTRUCTIONS[0]}
            plan = list(np.asarray(client.infer(request)["actions"], dtype=np.float64)[: cfg.replan_steps])
            requests += 1
        actions.append(plan.pop(0))
        step = env.step(actions[-1])
        total += step.reward
        if step.success:
            total += float(cfg.max_steps - env.steps)
            break
    env.close()
    return {"return": total, "length": env.steps, "requests": requests, "success": step.success}


def test_sync_without_delay_is_the_loop_as_before_and_async_with_a_delay_reports_the_switches(replay_run):
    from dataclasses import replace

    from slurmvla.config.rollout import RolloutConfig
    from slurmvla.inference.build import build_server
    from slurmvla.inference.closed_loop import close_client, connect, run_episodes, summarize
    from slurmvla.inference.harness import serving_in_thread

    server = build_server(str(replay_run), ["serve.host=127.0.0.1", "serve.port=0"], environ={})
    cfg = RolloutConfig(first_seed=0, episodes=2, height=HEIGHT, width=WIDTH, videos=0, max_steps=60, replan_steps=4)
    with serving_in_thread(server) as port:
        client = connect("127.0.0.1", port)
        try:
            horizon = client.get_server_metadata()["action_horizon"]
            before = [_before(client, cfg, seed) for seed in (0, 1)]
            now = run_episodes(client, cfg, [0, 1])
            delayed = {mode: run_episodes(client, replace(cfg, execution=mode, delay_steps=2), [0, 1])
                       for mode in ("async", "sync")}
        finally:
            close_client(client)
    for old, new in zip(before, now):
        assert {k: new[k] for k in old} == old
        assert new["hold_steps"] == 0 and new["switches"] == new["requests"] - 1
        assert new["replan_steps"] == 4
    assert horizon >= cfg.replan_steps + 2
    for e in delayed["async"]:
        # Held only while the first chunk was on its way; a switch per answer (hold -> chunk 1 is one), the last
        # request perhaps unanswered when the episode ended.
        assert e["hold_steps"] == 2 and e["requests"] - 1 <= e["switches"] <= e["requests"], e
        assert e["switch_jump_max"] >= e["switch_jump_mean"] > 0 and e["within_steps"] > 0
    for e in delayed["sync"]:
        # Sync holds 2 steps per request (the last one may be cut short by the episode's end).
        assert 2 * (e["requests"] - 1) < e["hold_steps"] <= 2 * e["requests"], e
    summary = summarize(delayed["async"], 1.0)
    assert summary["rollout/mean_hold_steps"] == 2.0
    assert summary["rollout/switch_jump_max"] == max(e["switch_jump_max"] for e in delayed["async"])
    assert summary["rollout/within_jump_mean"] > 0


class _Recording:
    """A policy served on the one-method protocol: chunk n is 0.01 n on every joint velocity (the gripper open),
    every request recorded; its metadata lists the execution modes given."""

    def __init__(self, modes: list[str]):
        self.modes, self.seen = modes, []

    def metadata(self) -> dict:
        return {"action_horizon": 8, "cameras": {"exterior": "observation/exterior_image_1_left"},
                "state": ["observation/joint_position", "observation/gripper_position"], "execution_modes": self.modes}

    def infer(self, obs: dict) -> dict:
        self.seen.append(obs)
        chunk = np.zeros((8, 8))
        chunk[:, :7] = 0.01 * len(self.seen) + 0.001 * np.arange(8)[:, None]
        return {"actions": chunk}


def test_rtc_requests_carry_the_old_chunk_and_the_delay_and_a_server_without_rtc_refuses_it():
    from slurmvla.config.rollout import RolloutConfig
    from slurmvla.inference.closed_loop import run_served
    from slurmvla.inference.server import PolicyServer

    cfg = RolloutConfig(first_seed=0, episodes=1, height=HEIGHT, width=WIDTH, videos=0, max_steps=12, execution="rtc",
                        delay_steps=2)
    policy = _Recording(["sync", "async", "rtc"])
    [episode] = run_served(PolicyServer(policy, "127.0.0.1", 0), cfg, [0], None)
    # Requests at steps 0, 6 (chunk 1's index 4) and 10 (chunk 2's index 4: it started at index 2).
    assert episode["requests"] == len(policy.seen) == 3 and episode["hold_steps"] == 2
    assert "prev_actions" not in policy.seen[0] and "delay" not in policy.seen[0]
    for n, request in ((1, policy.seen[1]), (2, policy.seen[2])):
        want = 0.01 * n + 0.001 * np.arange(4, 8)
        np.testing.assert_allclose(request["prev_actions"][:, :7], np.repeat(want[:, None], 7, axis=1))
        assert request["prev_actions"].shape == (4, 8) and request["delay"] == 2
    with pytest.raises(ValueError, match=r"rollout.execution=rtc: the server does not offer real-time chunking "
                                         r"\(its execution_modes: \['sync', 'async'\]\)"):
        run_served(PolicyServer(_Recording(["sync", "async"]), "127.0.0.1", 0), cfg, [0], None)


def test_one_server_serves_several_sets_of_episodes_one_after_another(replay_run):
    """run_served starts and stops the server around each set of episodes (benchmarks/rtc.py: one set per mode
    and delay): each set gets the answers the first got, same seeds, same episodes."""
    from slurmvla.config.rollout import RolloutConfig
    from slurmvla.inference.build import build_server
    from slurmvla.inference.closed_loop import run_served

    server = build_server(str(replay_run), ["serve.host=127.0.0.1", "serve.port=0"], environ={})
    cfg = RolloutConfig(first_seed=0, episodes=1, height=HEIGHT, width=WIDTH, videos=0, max_steps=20)
    runs = [run_served(server, cfg, [0], None) for _ in range(3)]
    assert [[e["return"] for e in r] for r in runs[1:]] == [[e["return"] for e in runs[0]]] * 2


def test_the_projects_client_plays_the_episodes_openpis_client_plays(replay_run):
    """Where openpi's client is not installed the closed loop talks through the project's client of the same
    protocol: the same server, seeds and policy give the same episodes, step for step, through either."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from slurmvla.config.rollout import RolloutConfig
    from slurmvla.inference.build import build_server
    from slurmvla.inference.client import WebsocketClient
    from slurmvla.inference.closed_loop import client_class, run_served

    assert client_class() is WebsocketClientPolicy  # installed here: what a robot runs
    server = build_server(str(replay_run), ["serve.host=127.0.0.1", "serve.port=0"], environ={})
    cfg = RolloutConfig(first_seed=0, episodes=2, height=HEIGHT, width=WIDTH, videos=0, max_steps=40)
    runs = [run_served(server, cfg, [0, 1], None, client=client) for client in (WebsocketClientPolicy, WebsocketClient)]
    keys = ("seed", "success", "return", "length", "requests")
    assert [[e[k] for k in keys] for e in runs[0]] == [[e[k] for k in keys] for e in runs[1]]
    assert all(e["success"] for e in runs[1])


def test_rollout_runs_async_with_a_delay_from_the_command_line_overrides(replay_run, tmp_path):
    summary = run(str(replay_run), ["rollout.first_seed=0", "rollout.episodes=1", "rollout.execution=async",
                                    "rollout.delay_steps=4", "rollout.max_steps=30", f"rollout.height={HEIGHT}",
                                    f"rollout.width={WIDTH}", "rollout.videos=0", f"rollout.out={tmp_path}"])
    assert (summary["execution"], summary["delay"]) == ("async", 4)
    assert summary["rollout/mean_hold_steps"] == 4.0 and summary["episodes"][0]["switches"] >= 1
    written = json.loads((tmp_path / "rollout.json").read_text())
    assert written["execution"] == "async" and "rollout/switch_jump_mean" in written


def _flow_policy(demos: Path):
    import torch

    from slurmvla.policy import build_policy

    cfg = compose(["experiment=sim_pick", "policy=keypoints_flow", f"data.root={demos}"])
    stats = {"state_offset": torch.full((8,), 0.5), "state_scale": torch.full((8,), 2.0),
             "action_offset": torch.arange(8.0), "action_scale": torch.full((8,), 3.0)}
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, stats)
    b, size = 3, cfg.policy.image_size
    batch = {"images": torch.randint(0, 256, (b, 2, size, size, 3), dtype=torch.uint8),
             "image_mask": torch.tensor([[True, True], [True, False], [True, True]]),
             "state": torch.randn(b, 8), "actions": torch.randn(b, 8, 8),
             "action_mask": torch.tensor([[True] * 8, [True] * 5 + [False] * 3, [True] * 8])}
    return policy, batch


def test_the_keypoint_flow_policy_passes_the_plug_in_checks(demos):
    from slurmvla.check import run_checks
    from slurmvla.check.subject import CHECKS, GRADIENT_CHECKPOINTING, SINGLE_PROCESS, Subject

    over = ["experiment=sim_pick", "policy=keypoints_flow", f"data.root={demos}", "data.num_workers=0",
            "logging.wandb.mode=disabled"]
    results = run_checks(Subject(compose(over), over), [c for c in CHECKS if c in SINGLE_PROCESS])
    # Skipped: gradient checkpointing, which the policy does not offer.
    assert {r.check: r.status for r in results} == {c: "skipped" if c == GRADIENT_CHECKPOINTING else "pass"
                                                    for c in CHECKS if c in SINGLE_PROCESS}, [r.line() for r in results]


def test_the_keypoint_flow_loss_is_flow_matching_on_the_normalized_chunk(demos):
    """Reference: x_t computed here by hand, in normalized units; the head's clean chunk (x-prediction, the
    default) trained by its masked squared error averaged over every chunk element, its velocity (x_t -
    sample) / t; with prediction=velocity the head's output is the velocity, trained against noise - actions."""
    import torch

    policy, batch = _flow_policy(demos)
    noise, t = torch.randn(3, 8, 8), torch.tensor([0.9, 0.3, 0.05])
    actions = (batch["actions"] - torch.arange(8.0)) / 3.0
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    features = policy.features(batch)
    sample = policy.head(x_t, t, features)
    mask = batch["action_mask"][:, :, None].float()
    out = policy(batch, noise=noise, t=t)
    torch.testing.assert_close(out["loss"], ((sample - actions).square() * mask).sum() / sample.numel())
    torch.testing.assert_close(policy.velocity(features, x_t, t), (x_t - sample) / t[:, None, None])
    assert out["components"]["mse"][1].tolist() == [64.0, 40.0, 64.0]
    # Without arguments the noise and time come from the batch (drawn per sample by the data pipeline).
    u = torch.rand(3)
    drawn = policy({**batch, "noise": noise, "time_u": u})["loss"]
    torch.testing.assert_close(drawn, policy(batch, noise=noise, t=u.pow(1 / 1.5) * 0.999 + 0.001)["loss"])
    policy.prediction = "velocity"
    pred = policy.velocity(features, x_t, t)
    torch.testing.assert_close(pred, sample)
    expected = ((pred - (noise - actions)).square() * mask).sum() / pred.numel()
    torch.testing.assert_close(policy(batch, noise=noise, t=t)["loss"], expected)


def test_one_flow_step_from_the_given_noise_is_noise_minus_the_velocity_at_t_1(demos):
    import torch

    policy, batch = _flow_policy(demos)
    noise = torch.randn(3, 8, 8)
    with torch.no_grad():
        by_hand = noise - policy.velocity(policy.features(batch), noise, torch.ones(3))
        two = policy.features(batch)
        half = noise - policy.velocity(two, noise, torch.ones(3)) / 2
        by_hand_2 = half - policy.velocity(two, half, torch.full((3,), 0.5)) / 2
    torch.testing.assert_close(policy.sample_actions(batch, noise=noise, num_steps=1), by_hand * 3.0 + torch.arange(8.0))
    torch.testing.assert_close(policy.sample_actions(batch, noise=noise, num_steps=2), by_hand_2 * 3.0 + torch.arange(8.0))
    # The default is policy.num_inference_steps; the same noise gives the same chunk.
    assert policy.num_inference_steps == 10
    torch.testing.assert_close(policy.sample_actions(batch, noise=noise), policy.sample_actions(batch, noise=noise))


def test_the_keypoint_flow_policy_opts_into_real_time_chunking_through_the_contract(demos):
    """A plug-in's RTC path (slurmvla.policy.rtc.integrate): with beta = 0 the chunk is plain sampling's from the
    same noise bit for bit, the d frozen actions are the previous chunk's exactly, and guidance pulls the rest of
    the overlap towards it."""
    import torch

    from slurmvla.policy.base import supports_rtc
    from slurmvla.policy.rtc import Guidance

    policy, batch = _flow_policy(demos)
    assert supports_rtc(policy)
    noise, prev = torch.randn(3, 8, 8), torch.randn(3, 8, 8) * 3.0 + torch.arange(8.0)
    delay, overlap = torch.tensor([2, 0, 3]), torch.tensor([6, 4, 8])
    plain = policy.sample_actions(batch, noise=noise)
    off = policy.sample_actions(batch, noise=noise, rtc=Guidance(prev, torch.zeros(3, dtype=torch.long), overlap, 0.0))
    assert torch.equal(off, plain)
    guided = policy.sample_actions(batch, noise=noise, rtc=Guidance(prev, delay, overlap, 5.0))
    for i, d in enumerate(delay.tolist()):
        assert torch.equal(guided[i, :d], prev[i, :d])
    inside = torch.arange(8)[None, :] < overlap[:, None]
    assert (guided - prev).abs()[inside].mean() < (plain - prev).abs()[inside].mean()
