"""LeRobot v2.1 against a fixture written here by hand, normalization stats, cameras, history and modes."""

from __future__ import annotations

import json
from fractions import Fraction

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from slurmvla.data.keep_ranges import episode_key
from slurmvla.data.mixture import Mixture
from slurmvla.data.source import LeRobotSource, dataset_specs
from slurmvla.inspect import main as inspect_main
from slurmvla.policy.tokenizer import detokenize
from slurmvla.trainer import Trainer
from tests.conftest import policy_spec

CAM = "observation.images.top"
LENGTHS = (5, 7)
TASKS = ["open the drawer", "wipe the table"]


def _gray(e, t):
    return 30 + 25 * t + 60 * e


@pytest.fixture(scope="module")
def v21_root(tmp_path_factory):
    """Two episodes in LeRobot v2.1's layout, written with pyarrow and PyAV only. Each video frame is
    one flat gray level that encodes (episode, frame); per-episode stats have no ``count``."""
    root = tmp_path_factory.mktemp("v21") / "ds"
    (root / "meta").mkdir(parents=True)
    episodes, stats = [], []
    index = 0
    for e, n in enumerate(LENGTHS):
        state = np.stack([np.arange(n) + 100 * e, -np.arange(n)], axis=1).astype(np.float32)
        action = state + 0.5
        table = pa.table({
            "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(state.reshape(-1)), 2),
            "action": pa.FixedSizeListArray.from_arrays(pa.array(action.reshape(-1)), 2),
            "timestamp": pa.array(np.arange(n) / 10, pa.float32()),
            "frame_index": pa.array(np.arange(n)), "episode_index": pa.array([e] * n),
            "index": pa.array(np.arange(index, index + n)), "task_index": pa.array([e] * n),
        })
        path = root / f"data/chunk-000/episode_{e:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        # Rows shuffled on disk: the reader must order them by frame_index.
        pq.write_table(table.take(pa.array(np.random.default_rng(e).permutation(n))), path)
        video = root / f"videos/chunk-000/{CAM}/episode_{e:06d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(video), "w") as c:
            s = c.add_stream("libx264", rate=Fraction(10))
            s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
            s.options = {"crf": "10", "g": "4"}
            for t in range(n):
                f = av.VideoFrame.from_ndarray(np.full((48, 64, 3), _gray(e, t), np.uint8), format="rgb24")
                f.pts, f.time_base = t, Fraction(1, 10)
                for p in s.encode(f):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        episodes.append({"episode_index": e, "tasks": [TASKS[e]], "length": n, "episode_id": f"LAB+{e:08x}+x"})
        stats.append({"episode_index": e, "stats": {
            k: {"mean": v.mean(0).tolist(), "std": v.std(0).tolist(), "min": v.min(0).tolist(), "max": v.max(0).tolist()}
            for k, v in (("observation.state", state), ("action", action))}})
        index += n
    (root / "meta/episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in episodes))
    (root / "meta/episodes_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stats))
    (root / "meta/tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n" for i, t in enumerate(TASKS)))
    vec = {"dtype": "float32", "shape": [2], "names": None}
    info = {"codebase_version": "v2.1", "fps": 10, "chunks_size": 1000, "total_episodes": 2, "total_frames": index,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": {CAM: {"dtype": "video", "shape": [48, 64, 3]}, "observation.state": vec, "action": vec,
                         "task_index": {"dtype": "int64", "shape": [1]}}}
    (root / "meta/info.json").write_text(json.dumps(info))
    return root


def _source(cfg, image_size=32, horizon=4):
    return LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, image_size, horizon, 32), 0)


def test_v21_fixture_reads_back_exactly(make_cfg, v21_root):
    cfg = make_cfg(f"data.root={v21_root}", f"data.cameras=[{CAM}]", "policy.num_cameras=1", "policy.state_dim=2",
                   "policy.action_dim=2")
    source = _source(cfg)
    assert source.meta.version == "v2.1" and source.index.num_samples == sum(LENGTHS)
    for e, n in enumerate(LENGTHS):
        ep = source.load_episode(e)
        for t in (0, 2, n - 1):
            s = source.sample(ep, t, 0)
            assert s["state"].tolist() == [t + 100 * e, -t]
            rows = [min(t + k, n - 1) for k in range(4)]
            assert s["actions"][:, 0].tolist() == [r + 100 * e + 0.5 for r in rows]
            assert s["action_mask"].tolist() == [t + k < n for k in range(4)]
            assert detokenize(s["text"][s["text_mask"]]) == TASKS[e]  # from tasks.jsonl through task_index
            # The middle row lies inside the picture (a 64x48 frame is padded above and below to a square).
            assert abs(s["images"][:, 16].float().mean().item() - _gray(e, t)) < 4
    # Pooled from the per-episode stats, weighted by episode length (no "count" in the file).
    all_state = np.concatenate([np.stack([np.arange(n) + 100 * e, -np.arange(n)], 1) for e, n in enumerate(LENGTHS)])
    raw = source.raw_stats(["observation.state"])
    assert np.allclose(raw["mean"], all_state.mean(0)) and np.allclose(raw["std"], all_state.std(0))
    assert raw["min"].tolist() == all_state.min(0).tolist() and raw["max"].tolist() == all_state.max(0).tolist()
    with pytest.raises(ValueError, match="data.action_normalization='quantile' needs \\['q01', 'q99'\\]"):
        Mixture(cfg.data, policy_spec(cfg, 32, 4, 32), 0).normalization("mean_std", "quantile")


def test_both_layouts_of_the_same_episodes_give_the_same_samples(make_cfg, tmp_path):
    from slurmvla.data.synthetic import write_droid_sample

    roots = [write_droid_sample(tmp_path / f, 5, seed=4, episodes_per_file=2, format=f) for f in ("v3.0", "v2.1")]
    sources = [_source(make_cfg(f"data.root={r}")) for r in roots]
    for e in range(5):
        a, b = (s.load_episode(e) for s in sources)
        for t in (0, len(a.state) - 1):
            x, y = sources[0].sample(a, t, 0), sources[1].sample(b, t, 0)
            assert all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor) and k != "images")
            # The same frames, encoded into different files: lossy h264 differs by a few levels.
            assert (x["images"].float() - y["images"].float()).abs().mean() < 3


def test_v30_is_written_as_lerobots_writer_writes_it_and_the_older_form_still_reads(make_cfg, tmp_path):
    """Shape-[1] features as plain scalars and the task table indexed by the task string, as LeRobot's
    own writer stores them (LeRobot 0.6.1 opens the files: tests/reference/interop_lerobot.py); files in
    the form slurmvla wrote before (one-element lists, a plain task column) give the same samples."""
    import shutil

    from slurmvla.data.synthetic import write_droid_sample

    new = write_droid_sample(tmp_path / "new", 4, seed=5, episodes_per_file=2)
    schema = pq.read_schema(next((new / "data").rglob("*.parquet")))
    assert schema.field("observation.state.gripper_position").type == pa.float32()
    assert pa.types.is_fixed_size_list(schema.field("observation.state.joint_position").type)
    tasks = pq.read_table(new / "meta" / "tasks.parquet")
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]
    old = tmp_path / "old"
    shutil.copytree(new, old, ignore=shutil.ignore_patterns("checksums.json"))  # an older writer's: none
    for path in (old / "data").rglob("*.parquet"):
        table = pq.read_table(path)
        for i, field in enumerate(table.schema):
            if field.type == pa.float32():
                col = table.column(i).combine_chunks()
                table = table.set_column(i, field.name, pa.FixedSizeListArray.from_arrays(col, 1))
        pq.write_table(table, path)
    pq.write_table(tasks.replace_schema_metadata(None), old / "meta" / "tasks.parquet")
    over = ["data.state_keys=[observation.state.joint_position,observation.state.gripper_position]",
            "data.action_keys=[action.joint_velocity,action.gripper_velocity]", "data.instruction_keys=[]"]
    sources = [_source(make_cfg(f"data.root={r}", *over)) for r in (new, old)]
    assert sources[0].meta.tasks == sources[1].meta.tasks and sources[0].use_task
    for e in range(4):
        a, b = (s.load_episode(e) for s in sources)
        for t in (0, len(a.state) - 1):
            x, y = sources[0].sample(a, t, 0), sources[1].sample(b, t, 0)
            assert x["instruction"] == y["instruction"] and x["instruction"] in sources[0].meta.tasks.values()
            assert all(torch.equal(x[k], y[k]) for k in x if isinstance(x[k], torch.Tensor))


def test_normalization_modes_use_the_dataset_stats(make_cfg, sample_root):
    stats = json.loads((sample_root / "meta" / "stats.json").read_text())["action"]
    mixture = Mixture(make_cfg().data, policy_spec(make_cfg(), 32, 8, 32), 0)
    q = mixture.normalization("identity", "quantile")
    lo, hi = np.asarray(stats["q01"]), np.asarray(stats["q99"])
    assert np.allclose(q["action_offset"], (lo + hi) / 2, atol=1e-6)
    assert np.allclose(q["action_scale"], np.maximum((hi - lo) / 2, 1e-4), atol=1e-6)
    assert torch.equal(q["state_offset"], torch.zeros(8)) and torch.equal(q["state_scale"], torch.ones(8))
    m = mixture.normalization("mean_std", "min_max")
    assert np.allclose(m["action_offset"], (np.asarray(stats["min"]) + np.asarray(stats["max"])) / 2, atol=1e-6)
    with pytest.raises(ValueError, match="data.action_normalization='z' is not valid; choose one of"):
        make_cfg("data.action_normalization=z")


def test_missing_camera_fails_or_pads(make_cfg):
    cams = "data.cameras=[observation.images.exterior_1_left,observation.images.nope]"
    with pytest.raises(ValueError) as e:
        _source(make_cfg(cams, "policy.num_cameras=2"))
    assert "'observation.images.nope'" in str(e.value) and "observation.images.wrist_left" in str(e.value)
    source = _source(make_cfg(cams, "policy.num_cameras=2", "data.missing_cameras=pad"))
    s = source.sample(source.load_episode(0), 3, 0)
    assert s["images"].shape == (2, 32, 32, 3) and s["image_mask"].tolist() == [True, False]
    assert s["images"][1].abs().sum() == 0 and s["images"][0].float().mean() > 10


def test_observation_history(make_cfg):
    plain = _source(make_cfg())
    hist = _source(make_cfg("data.num_obs_history=3", "data.history_interval=2", "policy.num_obs_history=3"))
    ep_plain, ep_hist = plain.load_episode(0), hist.load_episode(0)
    for t in (0, 3, 10):
        s = hist.sample(ep_hist, t, 0)
        frames = [t - 4, t - 2, t]
        assert s["state"].shape == (3, 8) and s["images"].shape == (9, 32, 32, 3)
        assert s["image_mask"].tolist() == [f >= 0 for f in frames for _ in range(3)]
        for k, f in enumerate(frames):
            ref = plain.sample(ep_plain, max(f, 0), 0)
            assert torch.equal(s["state"][k], ref["state"])
            assert torch.equal(s["images"][3 * k : 3 * k + 3], ref["images"])
    with pytest.raises(ValueError, match="policy.num_obs_history=1 does not match data.num_obs_history=2"):
        make_cfg("data.num_obs_history=2")


def test_joint_mode_draws_all_three_and_carries_future_states(make_cfg):
    source = _source(make_cfg("data.mode=joint", "policy.dynamics=true"), horizon=8)
    ep = source.load_episode(0)
    n = len(ep.state)
    modes = []
    for t in range(n):
        s = source.sample(ep, t, 0)
        modes.append(int(s["mode"]))
        rows = [min(t + 1 + k, n - 1) for k in range(8)]
        assert torch.equal(s["future_states"], torch.from_numpy(ep.state[rows]))
        assert s["future_mask"].tolist() == [t + 1 + k < n for k in range(8)]
    assert set(modes) == {0, 1, 2}
    # A pure function of the seed: another reader with the same seed draws the same modes, another seed not.
    for seed, same in ((0, True), (1, False)):
        other = LeRobotSource(source.spec, source.cfg, source.sample_spec, seed)
        again = [int(other.sample(ep, t, 0)["mode"]) for t in range(n)]
        assert (again == modes) is same
    with pytest.raises(ValueError, match="data.mode='joint' yields dynamics samples, which need policy.dynamics=true"):
        make_cfg("data.mode=joint")


def test_training_runs_with_history_and_joint_mode(make_cfg, tmp_path):
    cfg = make_cfg("data.mode=joint", "policy.dynamics=true", "data.num_obs_history=2", "policy.num_obs_history=2",
                   "trainer.max_steps=3", "checkpoint.every_steps=0")
    trainer = Trainer(cfg, tmp_path)
    metrics = trainer.fit()
    trainer.close()
    assert np.isfinite(metrics["loss"]) and trainer.step == 3


def test_inspect_counts_match_the_files(sample_root, capsys):
    keep = json.loads((sample_root / "keep_ranges_1_0_1.json").read_text())
    to_path = json.loads((sample_root / "episode_id_to_path.json").read_text())
    episodes = pq.read_table(sample_root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    horizon = 8
    ranges = {ep["episode_index"]: keep.get(episode_key(to_path[ep["episode_id"]])) for ep in episodes}
    lengths = {ep["episode_index"]: ep["length"] for ep in episodes}
    frame = sum(min(e, lengths[i]) - s for i, r in ranges.items() if r for s, e in r)
    window = sum(max(0, min(e, lengths[i]) - s - horizon + 1) for i, r in ranges.items() if r for s, e in r)
    inspect_main([f"data.root={sample_root}", f"data.keep_ranges.path={sample_root / 'keep_ranges_1_0_1.json'}",
                  f"data.keep_ranges.episode_id_to_path={sample_root / 'episode_id_to_path.json'}",
                  f"policy.action_horizon={horizon}", "data.val_fraction=0.2"])
    out = json.loads(capsys.readouterr().out)
    d = out["datasets"]["droid_sample"]
    assert d["format"] == "v3.0" and d["episodes"] == len(episodes) and d["frames"] == sum(lengths.values())
    assert d["episodes_absent"] == sum(r is None for r in ranges.values()) and d["episodes_unkeyed"] == 0
    assert d["episodes_kept"] == sum(r is not None for r in ranges.values())
    assert d["samples_by_semantics"]["frame"]["samples"] == frame == d["frames_kept"]
    assert d["samples_by_semantics"]["window"]["samples"] == window
    assert d["train_episodes"] + d["val_episodes"] == d["episodes_kept"] and d["val_episodes"] == round(0.2 * d["episodes_kept"])
    assert out["mixture"]["weights"] == {"droid_sample": 1.0}
    assert out["mixture"]["samples_per_epoch"] == d["train_samples"]


def test_av1_at_gop_2_decodes_frame_i_as_frame_i_in_every_file(tmp_path):
    """The DROID port's encoding (SVT-AV1, GOP 2): flat gray frames that encode their index, two
    files of several episodes each; every episode range, read by seek + forward decode, holds
    exactly its own frames, also in the second file."""
    from slurmvla.data.synthetic import FPS, HEIGHT, WIDTH
    from slurmvla.data.video import decode_range
    from slurmvla.data.writer import encode_video as _encode

    lengths = [[9, 4, 13], [6, 11]]
    for f, file_lengths in enumerate(lengths):
        n = sum(file_lengths)
        frames = np.stack([np.full((HEIGHT, WIDTH, 3), 20 + 9 * i + 3 * f, np.uint8) for i in range(n)])
        _encode(tmp_path / f"file-{f}.mp4", frames, codec="av1")
        with av.open(str(tmp_path / f"file-{f}.mp4")) as c:
            assert c.streams.video[0].codec_context.name in ("libdav1d", "av1")
        cursor = 0
        for length in file_lengths:
            out = decode_range(tmp_path / f"file-{f}.mp4", cursor / FPS, (cursor + length) / FPS, FPS, 32)
            gray = out[:, 16].reshape(length, -1).mean(1)
            expected = 20 + 9 * np.arange(cursor, cursor + length) + 3 * f
            assert np.abs(gray - expected).max() < 3, (f, cursor, gray, expected)
            cursor += length


def test_pad_resize_keeps_the_aspect_ratio_as_openpi_does():
    """180x320 -> 224: the picture is 224x126, centred (49 black rows above, 49 below), and its
    pixels are the squash-resized picture's at that size; squash fills the square."""
    from slurmvla.data.prepare import prepare_image

    rng = np.random.default_rng(0)
    image = np.repeat(np.repeat(rng.integers(0, 255, (18, 32, 3), dtype=np.uint8), 10, 0), 10, 1)
    padded = prepare_image(image, 224)
    assert padded.shape == (224, 224, 3)
    assert not padded[:49].any() and not padded[175:].any()
    picture = av.VideoFrame.from_ndarray(image, format="rgb24").to_ndarray(format="rgb24", width=224, height=126)
    assert np.array_equal(padded[49:175], picture)
    squashed = prepare_image(image, 224, mode="squash")
    assert np.array_equal(squashed, av.VideoFrame.from_ndarray(image, format="rgb24").to_ndarray(
        format="rgb24", width=224, height=224))
    portrait = prepare_image(np.full((320, 180, 3), 200, np.uint8), 224)
    assert not portrait[:, :49].any() and (portrait[:, 49:175] == 200).all() and not portrait[:, 175:].any()
    with pytest.raises(ValueError, match="data.image_resize='crop' is not valid; choose one of \\['pad', 'squash'\\]"):
        prepare_image(image, 224, mode="crop")


def test_writing_av1_leaves_the_writers_scheduling_policy_alone(tmp_path):
    """SVT-AV1, run as root, turns the thread that opens an encoder into SCHED_FIFO 99; whatever that
    process starts afterwards (torchrun ranks, a policy server) would inherit it and could starve the
    machine. The writer restores the thread's own policy (checked in a fresh process)."""
    import subprocess
    import sys

    code = ("import os; from slurmvla.data.synthetic import write_droid_sample; "
            "b = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority); "
            f"write_droid_sample({str(tmp_path / 'd')!r}, num_episodes=1); "
            "print(b, (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.strip().splitlines()[-1].split(") (")
    assert before + ")" == "(" + after, out.stdout
