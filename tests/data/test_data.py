"""The sample writer, the v3.0 reader and the map-style dataset, checked against pyarrow / PyAV directly."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from slurmvla.data.datasets import EpochSampler
from slurmvla.data.lerobot_format import LeRobotMetadata
from slurmvla.data.source import LeRobotSource, dataset_specs, seeded_int
from slurmvla.data.spec import Draw
from slurmvla.data.synthetic import main as synthetic_main
from slurmvla.data.video import decode_range
from slurmvla.droid_features import DROID_CAMERAS
from slurmvla.policy.tokenizer import detokenize, tokenize
from tests.conftest import policy_spec


def _frames_table(root):
    return pa.concat_tables([pq.read_table(p) for p in sorted((root / "data").glob("**/*.parquet"))])


def test_sample_has_droid_features_and_layout(sample_root):
    info = json.loads((sample_root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 15
    for cam in DROID_CAMERAS:
        assert info["features"][cam]["dtype"] == "video" and info["features"][cam]["shape"] == [180, 320, 3]
    for key, dim in [("observation.state", 8), ("action", 8), ("action.joint_position", 7),
                     ("observation.state.gripper_position", 1), ("action.cartesian_position", 6)]:
        assert info["features"][key]["shape"] == [dim]
    for key in ("language_instruction", "language_instruction_2", "language_instruction_3", "is_episode_successful"):
        assert key in info["features"]
    # Several episodes per file, as v3.0 packs them.
    assert len(list((sample_root / "data").glob("**/*.parquet"))) == 3
    episodes = pq.read_table(sample_root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    lengths = episodes["length"].to_pylist()
    assert min(lengths) < 8 < max(lengths), "lengths vary, and some episodes are shorter than a chunk"
    table = _frames_table(sample_root)
    assert table.num_rows == sum(lengths) == info["total_frames"]


def test_video_ranges_match_a_straight_decode(sample_root):
    """decode_range (seek + forward) returns exactly the frames a full sequential decode has there."""
    meta = LeRobotMetadata(sample_root)
    cam = DROID_CAMERAS[1]
    loc = meta.video_location(cam)
    path = loc.paths[-1]
    with av.open(str(path)) as c:
        full = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    same_file = [e for e in range(meta.num_episodes) if loc.paths[e] == path]
    assert len(same_file) > 1
    total = 0
    for e in same_file:
        frames = decode_range(path, loc.from_ts[e], loc.to_ts[e], meta.fps, None)
        start = int(round(loc.from_ts[e] * 15))
        assert np.array_equal(frames, full[start : start + len(frames)])
        total += len(frames)
    assert total == len(full)


def _source(cfg, image_size=32, horizon=8, max_text_len=32, seed=0):
    return LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, image_size, horizon, max_text_len), seed)


class _ByIndex:
    """Samples by global frame index (episodes loaded whole), for checks against the raw rows."""

    def __init__(self, source):
        self.source = source
        ep = source.meta.episodes
        self.bounds = np.asarray(ep["dataset_from_index"])
        self.kept = {int(e) for e in source.train_index.episodes}

    def __len__(self):
        return sum(int(self.source.meta.episodes["length"][e]) for e in self.kept)

    def __getitem__(self, key):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        pos = int(np.searchsorted(self.bounds, i, side="right") - 1)
        return self.source.sample(self.source.load_episode(pos), i - int(self.bounds[pos]), epoch)


def test_samples_match_the_parquet_rows(sample_root, make_cfg):
    cfg = make_cfg()
    ds = _ByIndex(_source(cfg))
    table = _frames_table(sample_root)
    state = np.asarray(table["observation.state"].to_pylist(), dtype=np.float32)
    action = np.asarray(table["action"].to_pylist(), dtype=np.float32)
    episode = np.asarray(table["episode_index"])
    instructions = [table[k].to_pylist() for k in ("language_instruction", "language_instruction_2", "language_instruction_3")]
    assert len(ds) == len(state)
    for i in [0, 1, 7, len(ds) // 2, len(ds) - 1]:
        s = ds[i]
        assert torch.equal(s["state"], torch.from_numpy(state[i]))
        assert s["episode_index"].item() == episode[i]
        rows = [j for j in range(i, i + 8) if j < len(episode) and episode[j] == episode[i]]
        assert s["action_mask"].tolist() == [True] * len(rows) + [False] * (8 - len(rows))
        assert torch.equal(s["actions"][: len(rows)], torch.from_numpy(action[rows]))
        assert torch.equal(s["actions"][len(rows):], torch.from_numpy(action[rows[-1]]).expand(8 - len(rows), -1))
        assert s["frame_index"].item() == i - np.flatnonzero(episode == episode[i])[0]
        assert s["images"].shape == (3, 32, 32, 3) and s["images"].dtype == torch.uint8
        text = detokenize(s["text"][s["text_mask"]])
        # Cut to max_text_len - 2 bytes (BOS and EOS).
        assert text and any(instructions[k][i] and instructions[k][i][:30] == text for k in range(3))
        # The raw string travels too (for a policy with its own tokenizer), uncut.
        assert s["instruction"] in [instructions[k][i] for k in range(3)] and s["instruction"].startswith(text)
        assert s["dataset_name"] == "droid_sample" and s["control_mode"] == "joint_position"


def test_success_only_drops_failed_episodes(sample_root, make_cfg):
    table = _frames_table(sample_root)
    ok = np.asarray(table["is_episode_successful"])
    source = _source(make_cfg("data.success_only=true"))
    assert 0 < source.index.num_samples == int(ok.sum()) < len(ok)
    kept = set(source.index.episodes.tolist())
    assert kept == set(np.asarray(table["episode_index"])[ok].tolist())


def test_episode_facts_come_from_stats_or_one_cached_read(sample_root, tmp_path, monkeypatch):
    """success_only's per-episode flags: from per-episode stats where the dataset has them; without
    them, read from the data files by one of several concurrent readers (the others wait on the
    lock), cached, and never read again. Every path agrees with pyarrow reading the frames."""
    import shutil
    import threading

    from slurmvla.data.facts import episode_values

    table = _frames_table(sample_root)
    first = np.unique(np.asarray(table["episode_index"]), return_index=True)[1]
    expected = np.asarray(table["is_episode_successful"])[first]
    meta = LeRobotMetadata(sample_root)
    assert np.array_equal(episode_values(meta, "is_episode_successful", tmp_path / "unused").astype(bool), expected)
    assert not (tmp_path / "unused").exists(), "answered from the per-episode stats, no data read"

    bare = tmp_path / "bare"
    shutil.copytree(sample_root, bare, ignore=shutil.ignore_patterns("videos", "checksums.json"))  # edited below
    episodes = bare / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    t = pq.read_table(episodes)
    pq.write_table(t.drop([c for c in t.column_names if c.startswith("stats/")]), episodes)
    meta = LeRobotMetadata(bare)
    assert meta.episode_constant_from_stats("is_episode_successful") is None
    reads, original = [], LeRobotMetadata.episode_first_values

    def counted(self, key):
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(LeRobotMetadata, "episode_first_values", counted)
    results = [None] * 4

    def worker(i):
        results[i] = episode_values(LeRobotMetadata(bare), "is_episode_successful", tmp_path / "cache")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert reads == ["is_episode_successful"], "one reader, the others waited and loaded its file"
    assert all(np.array_equal(r.astype(bool), expected) for r in results)
    assert len(list((tmp_path / "cache" / "episode_facts").glob("*.npy"))) == 1
    episode_values(meta, "is_episode_successful", tmp_path / "cache")
    assert len(reads) == 1, "a later start reads the cache, not the data"


def test_image_content_follows_the_arm(sample_root, make_cfg):
    """The rendered square tracks the state: two frames of the first episode differ visibly."""
    ds = _ByIndex(_source(make_cfg(), image_size=64))
    a, b = ds[0]["images"].float(), ds[20]["images"].float()
    assert (a - b).abs().mean() > 1.0


def test_sampler_is_a_pure_function_and_shards_evenly():
    s0, s1 = EpochSampler(103, seed=5, rank=0, world_size=2), EpochSampler(103, seed=5, rank=1, world_size=2)
    a, b = list(s0), list(s1)
    assert len(a) == len(b) == 51 and not {i for i, _ in a} & {i for i, _ in b}
    assert a == list(EpochSampler(103, seed=5, rank=0, world_size=2))
    assert {e for _, e in a} == {0}
    s0.set_position(epoch=1, start=0)
    epoch1 = list(s0)
    assert epoch1 != a and sorted(epoch1) != epoch1 and {e for _, e in epoch1} == {1}
    s0.set_position(epoch=1, start=10)
    assert list(s0) == epoch1[10:]


def test_sample_randomness_depends_on_sample_and_epoch_only(make_cfg):
    ds = _ByIndex(_source(make_cfg(), seed=3))
    a, b = ds[(5, 0)], ds[(5, 0)]
    assert torch.equal(a["noise"], b["noise"]) and torch.equal(a["time_u"], b["time_u"])
    assert not torch.equal(a["noise"], ds[(5, 1)]["noise"]) and not torch.equal(a["noise"], ds[(6, 0)]["noise"])
    assert a["noise"].shape == (8, 8) and 0 <= a["time_u"] < 1


def test_the_policy_spec_decides_text_fields_and_pre_drawn_randomness(make_cfg):
    """A policy without a tokenizer gets no token fields; its own draws arrive under its names, in order."""
    cfg = make_cfg()
    spec = dataclasses.replace(policy_spec(cfg, 32, 8, 32), tokenizer=None,
                               draws=(Draw("eps", "normal", (2, 3)), Draw("u", "uniform", (4,))))
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, spec, 3)
    ep = source.load_episode(0)
    s = source.sample(ep, 5, 0)
    assert "text" not in s and "text_mask" not in s and "noise" not in s and s["instruction"]
    # Drawn from the per-sample generator, in the spec's order (an independent replay of the seed).
    g = torch.Generator().manual_seed(seeded_int(3, 0, 0, 0, 5, 0) % 2**63)
    assert torch.equal(s["eps"], torch.randn((2, 3), generator=g)) and torch.equal(s["u"], torch.rand((4,), generator=g))
    with pytest.raises(ValueError, match="distribution='gamma' is not valid; choose one of"):
        Draw("x", "gamma")


def test_tokenizer_round_trip():
    ids, mask = tokenize("put the cup in the sink ü", 40)
    assert detokenize(ids[mask]) == "put the cup in the sink ü"
    ids, mask = tokenize("x" * 100, 16)
    assert mask.all() and detokenize(ids) == "x" * 14


def test_synthetic_cli(tmp_path, capsys):
    synthetic_main(["--out", str(tmp_path / "d"), "--episodes", "3"])
    meta = LeRobotMetadata(tmp_path / "d")
    assert meta.num_episodes == 3 and "wrote 3 episodes" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        synthetic_main(["--out", str(tmp_path / "d"), "--episodes", "3"])
    assert "already holds a dataset" in capsys.readouterr().err
    assert Fraction(meta.fps) == 15


def test_a_damaged_video_is_an_error_naming_the_file(sample_root, make_cfg, tmp_path):
    """A video cut short (a partial copy) or replaced by garbage: reading the episodes it holds fails
    with a ValueError that names the file, in the stream's windowed reader and the whole-episode one."""
    import shutil

    root = tmp_path / "damaged"
    shutil.copytree(sample_root, root)
    source = _source(make_cfg(f"data.root={root}"))
    cam = DROID_CAMERAS[0]
    loc = source.videos[cam]
    last = source.meta.num_episodes - 1
    path = loc.paths[last]
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    with pytest.raises(ValueError, match=str(path)):
        window = source.open_episode(last)
        window.images(np.asarray([int(source.meta.episodes["length"][last]) - 1]))
    with pytest.raises(ValueError, match=str(path)):
        source.load_episode(last)
    path.write_bytes(b"not a video" * 100)
    with pytest.raises(ValueError, match=str(path)):
        source.load_episode(last)
