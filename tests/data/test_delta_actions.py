"""data.delta_actions (openpi's DeltaActions / AbsoluteActions): samples and statistics carry the deltas, the
server turns the policy's chunk back into absolute commands and a real-time chunking request's previous chunk
into deltas; and experiment=pi05_full_droid, openpi's recipe that trains on them."""

from __future__ import annotations

import collections

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.data.delta import delta_dims, to_absolute, to_delta
from slurmvla.data.mixture import Mixture
from slurmvla.evaluate import evaluate
from slurmvla.export import export
from slurmvla.inference.load import load_exported
from slurmvla.inference.runner import PolicyRunner, request_seed
from slurmvla.policy.rtc import Guidance
from slurmvla.trainer import Trainer
from tests.conftest import policy_spec

# openpi's RLDSDroidDataConfig under DroidActionSpace.JOINT_POSITION: make_bool_mask(7, -1).
DROID_MASK = [True] * 7 + [False]
DROID_MASK_OVERRIDE = "data.delta_actions=[true,true,true,true,true,true,true,false]"


def test_absolute_to_delta_and_back_is_exact_and_leaves_the_other_dims_alone():
    g = np.random.default_rng(0)
    # Multiples of 1/64 in a small range: every difference and sum is exact in float32.
    actions = (g.integers(-256, 256, (3, 5, 8)) / 64).astype(np.float32)  # [B, H, A]
    state = (g.integers(-256, 256, (3, 9)) / 64).astype(np.float32)  # [B, S], S > A
    flags = [True, False, True, True]
    delta = to_delta(actions, state, flags)
    by_hand = actions.copy()
    for b in range(3):
        for h in range(5):
            for d in (0, 2, 3):
                by_hand[b, h, d] = actions[b, h, d] - state[b, d]
    np.testing.assert_array_equal(delta, by_hand)
    assert np.array_equal(delta[..., [1, 4, 5, 6, 7]], actions[..., [1, 4, 5, 6, 7]])
    np.testing.assert_array_equal(to_absolute(delta, state, flags), actions)
    # The inputs are not changed; torch tensors take the same path.
    assert not np.array_equal(delta, actions)
    t = to_delta(torch.from_numpy(actions), torch.from_numpy(state), flags)
    np.testing.assert_array_equal(t.numpy(), by_hand)
    np.testing.assert_array_equal(to_absolute(t, torch.from_numpy(state), flags).numpy(), actions)
    # One chunk [H, A] with one state [S]; no flag (or null) changes nothing.
    np.testing.assert_array_equal(to_delta(actions[0], state[0], flags), by_hand[0])
    for off in (None, [], [False, False]):
        np.testing.assert_array_equal(to_delta(actions, state, off), actions)
    assert delta_dims(DROID_MASK) == list(range(7)) and delta_dims(None) == []


@pytest.mark.parametrize("flags", ["[true,true,true,true,true,true,true,true,true]", "[false,false,false,false,false,"
                                   "false,false,false,false,false]"])
def test_a_mask_longer_than_the_actions_or_the_state_is_refused_naming_it(flags):
    n = flags.count(",") + 1
    with pytest.raises(ValueError, match=rf"data.delta_actions=\[.*\] has {n} flags, but the actions have 8 dims "
                                         r"\(policy.action_dim\) and the state 8 \(policy.state_dim\); give at most 8"):
        compose(["experiment=demo", "data.root=/d", f"data.delta_actions={flags}"])
    # A narrower state bounds it too (the state dim at each flagged index must exist).
    with pytest.raises(ValueError, match=r"has 8 flags, but the actions have 8 dims \(policy.action_dim\) and the "
                                         r"state 7 \(policy.state_dim\); give at most 7"):
        compose(["experiment=demo", "data.root=/d", "policy.state_dim=7", DROID_MASK_OVERRIDE])
    cfg = compose(["experiment=demo", "data.root=/d", DROID_MASK_OVERRIDE])
    assert cfg.data.delta_actions == DROID_MASK
    assert compose(["experiment=demo", "data.root=/d"]).data.delta_actions is None


def _columns(root):
    """Each episode's state and action, read from the parquet files here (not through slurmvla's reader)."""
    rows = {k: [] for k in ("episode_index", "frame_index", "observation.state", "action")}
    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path, columns=list(rows))
        for k in rows:
            rows[k].extend(table.column(k).to_pylist())
    episode, frame = np.asarray(rows["episode_index"]), np.asarray(rows["frame_index"])
    state, action = (np.asarray(rows[k], np.float32) for k in ("observation.state", "action"))
    out = {}
    for ep in np.unique(episode).tolist():
        sel = np.flatnonzero(episode == ep)
        sel = sel[np.argsort(frame[sel])]
        out[ep] = (state[sel], action[sel])
    return out


def _delta_values(source, columns: dict, horizon: int) -> np.ndarray:
    """By hand: every in-episode action of every training sample's chunk, minus the state the chunk starts
    from on the first seven dims (no filter is set: every frame of a training episode starts a sample)."""
    values = []
    for pos in source.train_index.episodes.tolist():
        state, action = columns[int(source.meta.episodes["episode_index"][pos])]
        for t in range(len(action)):
            for k in range(horizon):
                if t + k < len(action):
                    values.append(np.concatenate([action[t + k, :7] - state[t, :7], action[t + k, 7:]]))
    return np.asarray(values, np.float64)


@pytest.fixture(scope="module")
def delta_cfg(sample_root, tmp_path_factory):
    return compose(["experiment=demo", f"data.root={sample_root}", "data.num_workers=0", "data.val_fraction=0.25",
                    f"data.cache_dir={tmp_path_factory.mktemp('cache')}", DROID_MASK_OVERRIDE])


def test_samples_and_statistics_carry_the_deltas(delta_cfg, sample_root):
    cfg, horizon = delta_cfg, 8
    spec = policy_spec(cfg, 32, horizon, 32)
    mixture = Mixture(cfg.data, spec, 0)
    source = mixture.sources[0]
    columns = _columns(sample_root)
    values = _delta_values(source, columns, horizon)
    stats = source.delta_action_stats()
    assert stats["count"][0] == len(values)
    for name, want in (("mean", values.mean(0)), ("std", values.std(0)), ("min", values.min(0)),
                       ("max", values.max(0)), ("q01", np.quantile(values, 0.01, axis=0)),
                       ("q99", np.quantile(values, 0.99, axis=0))):
        np.testing.assert_allclose(stats[name], want, rtol=1e-9, atol=1e-12, err_msg=name)
    # Not the absolute actions' statistics (the test data's joints sit away from zero).
    absolute = source.raw_stats(["action"])
    assert not np.allclose(stats["mean"][:7], absolute["mean"][:7], atol=1e-2)
    buffers = mixture.normalization("mean_std", "quantile")
    np.testing.assert_allclose(buffers["action_offset"].numpy(), (np.quantile(values, 0.01, axis=0) +
                                                                   np.quantile(values, 0.99, axis=0)) / 2, rtol=1e-6)
    # The state's statistics stay the dataset's own.
    np.testing.assert_allclose(buffers["state_offset"].numpy(), source.raw_stats(["observation.state"])["mean"],
                               rtol=1e-6)
    # A second computation reads the cache: the same numbers.
    again = Mixture(cfg.data, spec, 0).sources[0].delta_action_stats()
    assert all(np.array_equal(again[k], stats[k]) for k in stats)
    # A sample's chunk: the recorded actions minus its frame's state on the flagged dims; validation's too.
    for index in (source.train_index, source.val_index):
        pos = int(index.episodes[0])
        episode = source.load_episode(pos)
        state, action = columns[int(source.meta.episodes["episode_index"][pos])]
        for t in (0, 5, len(action) - 3):
            got = source.sample(episode, t, epoch=0)["actions"].numpy()
            rows = action[np.minimum(np.arange(t, t + horizon), len(action) - 1)]
            np.testing.assert_array_equal(got[:, 7], rows[:, 7])
            np.testing.assert_array_equal(got[:, :7], rows[:, :7] - state[t, :7])


def test_with_observation_history_the_chunk_is_relative_to_the_current_state(sample_root, tmp_path):
    cfg = compose(["experiment=demo", f"data.root={sample_root}", "data.num_workers=0", DROID_MASK_OVERRIDE,
                   "data.num_obs_history=2", "policy.num_obs_history=2", "data.history_interval=3",
                   f"data.cache_dir={tmp_path}"])
    source = Mixture(cfg.data, policy_spec(cfg, 32, 4, 32), 0).sources[0]
    state, action = _columns(sample_root)[int(source.meta.episodes["episode_index"][0])]
    sample = source.sample(source.load_episode(0), 6, epoch=0)
    np.testing.assert_array_equal(sample["state"].numpy(), state[[3, 6]])
    np.testing.assert_array_equal(sample["actions"].numpy()[:, :7], action[6:10, :7] - state[6, :7])


def _obs(size: int, seed: int) -> dict:
    g = np.random.default_rng(seed)
    return {"observation/exterior_image_1_left": g.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "observation/wrist_image_left": g.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
            "prompt": "pick up the cup"}


def _policy_chunk(runner: PolicyRunner, obs: dict, rtc: Guidance | None = None) -> np.ndarray:
    """The policy's own (delta) chunk for ``obs``, with the noise serve.seed draws, called here."""
    batch = runner.processor.batch(collections.deque([runner.processor.read(obs)]))
    pc = runner.cfg.policy
    noise = torch.randn((1, pc.action_horizon, pc.action_dim),
                        generator=torch.Generator().manual_seed(request_seed(runner.cfg.serve.seed, batch)))
    with torch.no_grad():
        return runner.policy.sample_actions(batch, noise=noise, **({"rtc": rtc} if rtc else {}))[0].numpy()


def test_a_trained_delta_policy_serves_its_chunk_plus_the_state(delta_cfg, sample_root, tmp_path):
    cfg = compose(["experiment=demo", f"data.root={sample_root}", "data.num_workers=0",
                   f"data.cache_dir={delta_cfg.data.cache_dir}", DROID_MASK_OVERRIDE, "logging.wandb.mode=disabled",
                   "trainer.progress_bar=false", "trainer.global_batch_size=4", "trainer.max_steps=2",
                   "checkpoint.every_steps=2", "trainer.val_every_steps=0", "trainer.log_every_steps=1",
                   "data.action_normalization=mean_std", "serve.seed=3"])
    run = tmp_path / "run"
    trainer = Trainer(cfg, run)
    try:
        trainer.fit()
    finally:
        trainer.close()
    export(run, run / "policy.safetensors")
    loaded = load_exported(run / "policy.safetensors")
    # The config travels with the export; the policy normalizes with the deltas' statistics.
    assert loaded.cfg.data.delta_actions == DROID_MASK
    spec = type(loaded.policy).sample_spec(loaded.cfg.policy)
    values = _delta_values(Mixture(loaded.cfg.data, spec, 0).sources[0], _columns(sample_root), spec.action_horizon)
    np.testing.assert_allclose(loaded.policy.action_offset.numpy(), values.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loaded.policy.action_scale.numpy(), values.std(0), rtol=1e-5, atol=1e-7)
    runner = PolicyRunner(loaded)
    assert runner.metadata()["delta_action_dims"] == list(range(7))
    obs = _obs(runner.spec.image_size, 0)
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]]).astype(np.float32)
    chunk = _policy_chunk(runner, obs)
    want = chunk.copy()
    want[:, :7] += state[:7]
    got = runner.infer(obs)["actions"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[:, 7], runner.session().infer(obs)["actions"][:, 7])
    assert not np.allclose(got[:, :7], chunk[:, :7], atol=1e-3)
    # evaluate compares absolute chunks: the recorded ones are the dataset's own actions again.
    _, v = evaluate(loaded, split="val")
    columns = _columns(sample_root)
    for i in range(0, len(v["actions"]), 17):
        state, action = columns[int(v["episode_index"][i])]
        t = int(v["frame_index"][i])
        steps = np.arange(t, t + spec.action_horizon)
        inside = steps < len(action)
        np.testing.assert_allclose(v["actions"][i][inside], action[steps[inside]], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def delta_runner(tmp_path_factory):
    from tests.policy.test_rtc import demo_runner

    return demo_runner(tmp_path_factory.mktemp("unused"), DROID_MASK_OVERRIDE)


def test_rtc_requests_send_absolute_previous_actions_which_become_deltas(delta_runner):
    runner = delta_runner
    pc = runner.cfg.policy
    obs = _obs(runner.spec.image_size, 1)
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]]).astype(np.float32)
    # The previous chunk as the robot got it: absolute commands near the current state.
    prev = (state + np.random.default_rng(2).normal(scale=0.05, size=(6, pc.action_dim))).astype(np.float32)
    got = runner.infer({**obs, "prev_actions": prev, "delay": 2})["actions"]
    padded = torch.zeros(1, pc.action_horizon, pc.action_dim)
    padded[0, :6] = torch.from_numpy(prev)
    padded[0, :6, :7] -= torch.from_numpy(state[:7])
    want = _policy_chunk(runner, obs, Guidance(padded, torch.tensor([2]), torch.tensor([6]), schedule="zeros",
                                                jacobian="identity"))
    want[:, :7] += state[:7]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The delay's actions are the previous chunk's, in absolute units again.
    np.testing.assert_allclose(got[:2], prev[:2], rtol=0, atol=1e-6)
    # Without the conversion the guided chunk would differ: the frozen prefix would be prev + state.
    assert not np.allclose(got[:2, :7], prev[:2, :7] + state[:7], atol=1e-3)
    with pytest.raises(ValueError, match="pass the request's state to read_rtc"):
        runner.read_rtc({"prev_actions": prev, "delay": 1})


# openpi's TrainConfig "pi05_full_droid_finetune" (Physical-Intelligence/openpi at 15a9616,
# src/openpi/training/config.py), RLDSDroidDataConfig with DroidActionSpace.JOINT_POSITION (delta mask
# make_bool_mask(7, -1)), src/openpi/training/droid_rlds_dataset.py (successful episodes only, the idle-range
# filter per frame) and TrainConfig's / AdamW's defaults (ema_decay 0.99; b1 0.9, b2 0.95, eps 1e-8,
# weight_decay 1e-10, clip_gradient_norm 1.0).
OPENPI_FULL = {"batch_size": 256, "num_train_steps": 100_000, "action_horizon": 16, "action_dim": 32,
               "warmup_steps": 1_000, "peak_lr": 5e-5, "decay_lr": 5e-5, "ema_decay": 0.99, "save_interval": 5_000,
               "log_interval": 100, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 1e-10,
               "clip_gradient_norm": 1.0, "delta_mask": DROID_MASK}


def test_pi05_full_droid_makes_openpis_choices():
    cfg = compose(["experiment=pi05_full_droid", "data.root=/d", "policy.pretrained_path=/ckpt/pi05_base"])
    p, d, t, o, s = cfg.policy, cfg.data, cfg.trainer, cfg.optim, cfg.scheduler
    assert d.delta_actions == OPENPI_FULL["delta_mask"]
    assert list(d.action_keys) == ["action.joint_position", "action.gripper_position"]
    assert list(d.state_keys) == ["observation.state.joint_position", "observation.state.gripper_position"]
    assert d.success_only and d.keep_ranges.semantics == "frame"
    assert d.augment == "openpi"  # preprocess_observation(train=True): every openpi training config
    assert (p.name, p.state_input, p.state_normalization, p.action_normalization, p.stats_source) == \
        ("pi05", "discrete", "quantile", "quantile", "data")
    assert (p.action_horizon, p.max_action_dim, p.action_dim, p.state_dim) == \
        (OPENPI_FULL["action_horizon"], OPENPI_FULL["action_dim"], 8, 8)
    assert (t.global_batch_size, t.max_steps, t.ema_decay, t.max_grad_norm, t.log_every_steps) == \
        (OPENPI_FULL["batch_size"], OPENPI_FULL["num_train_steps"], OPENPI_FULL["ema_decay"],
         OPENPI_FULL["clip_gradient_norm"], OPENPI_FULL["log_interval"])
    assert (o.lr, tuple(o.betas), o.eps, o.weight_decay) == \
        (OPENPI_FULL["peak_lr"], (OPENPI_FULL["b1"], OPENPI_FULL["b2"]), OPENPI_FULL["eps"],
         OPENPI_FULL["weight_decay"])
    # CosineDecaySchedule(decay_lr=peak_lr): warmup, then constant.
    assert (s.name, s.warmup_steps) == ("warmup_constant", OPENPI_FULL["warmup_steps"])
    assert o.lr == OPENPI_FULL["decay_lr"]
    assert (cfg.precision, cfg.checkpoint.every_steps) == ("bf16", OPENPI_FULL["save_interval"])
    assert list(cfg.serve.state) == ["observation/joint_position", "observation/gripper_position"]
    assert p.pretrained_path == "/ckpt/pi05_base"
