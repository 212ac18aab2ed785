"""Cameras stored as images (LeRobot's ``"dtype": "image"``): a dataset in exactly lerobot/metaworld_mt50's LeRobot
v3.0 layout (and an older v2.1 image dataset's), written by HF ``datasets`` (its ``Image()`` feature: PNG bytes in a
``struct<bytes, path>`` column) and pandas, never by slurmvla's writer, read by every reader slurmvla has; each frame is
compared with the PNG decoded independently by PIL."""

from __future__ import annotations

import io
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")  # the [dev] extra's: the writer LeRobot itself writes with
pd = pytest.importorskip("pandas")
PIL = pytest.importorskip("PIL.Image")

from slurmvla.compose import compose  # noqa: E402
from slurmvla.data import DataError  # noqa: E402
from slurmvla.data.checksums import FILE as CHECKSUMS  # noqa: E402
from slurmvla.data.checksums import write_checksums  # noqa: E402
from slurmvla.data.damaged import scan  # noqa: E402
from slurmvla.data.datasets import ValidationDataset  # noqa: E402
from slurmvla.data.lerobot_format import LeRobotMetadata  # noqa: E402
from slurmvla.data.loader import TrainData  # noqa: E402
from slurmvla.data.mixture import Mixture  # noqa: E402
from slurmvla.data.prepare import prepare_image  # noqa: E402
from slurmvla.data.source import LeRobotSource, dataset_specs  # noqa: E402
from tests.conftest import policy_spec  # noqa: E402

TASKS = ["reach the red button", "push the puck to the goal"]
LENGTHS = [11, 7, 14]  # 3 episodes, 32 frames
EPISODE_TASK = [1, 0, 1]
FPS = 80
H, W = 32, 32


def _png(img: np.ndarray) -> bytes:
    out = io.BytesIO()
    PIL.fromarray(img).save(out, format="PNG")
    return out.getvalue()


def _frames(rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
    """A moving gradient plus noise: every frame differs, and no two pixels' errors could cancel."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 7, y * 5, (x + y) * 3], -1)
    return np.stack([(base + 9 * t + rng.integers(0, 40, (h, w, 3))) % 256 for t in range(n)]).astype(np.uint8)


def _stats(x: np.ndarray) -> dict:
    x = x.reshape(len(x), -1).astype(np.float64)
    return {"mean": x.mean(0).tolist(), "std": x.std(0).tolist(), "min": x.min(0).tolist(), "max": x.max(0).tolist(),
            "count": [len(x)]}


def write_mt50_like(root: Path, version: str = "v3.0", h: int = H, w: int = W, damage: dict | None = None) -> dict:
    """A LeRobot image dataset as lerobot/metaworld_mt50 is laid out (v3.0: channel-first image shape, one data file,
    meta/episodes/ and meta/tasks.parquet) or as an older LeRobot image dataset (v2.1: ``[H, W, 3]``, a data file per
    episode, meta/*.jsonl). ``damage``: ``{global index: bytes}`` stored in place of those frames' PNGs. Returns what
    was written, for the comparisons."""
    from datasets import Dataset, Features, Image, List, Value

    rng = np.random.default_rng(0)
    n = sum(LENGTHS)
    images = _frames(rng, n, h, w)
    encoded = [_png(img) for img in images]
    for index, data in (damage or {}).items():
        encoded[index] = data
    state = rng.normal(size=(n, 4)).astype(np.float32)
    action = rng.uniform(-1, 1, size=(n, 4)).astype(np.float32)
    episode = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    frame = np.concatenate([np.arange(k) for k in LENGTHS])
    task = np.repeat(EPISODE_TASK, LENGTHS)
    columns = {
        "observation.image": [None if b is None else {"bytes": b, "path": None} for b in encoded],
        "observation.state": state.tolist(), "action": action.tolist(),
        "next.reward": rng.normal(size=n).astype(np.float32).tolist(), "next.success": (frame == 9).tolist(),
        "observation.environment_state": rng.normal(size=(n, 39)).astype(np.float32).tolist(),
        "task_id": task.astype(np.int16).tolist(),
        "timestamp": (frame / FPS).astype(np.float32).tolist(), "frame_index": frame.tolist(),
        "episode_index": episode.tolist(), "index": list(range(n)), "task_index": task.tolist(),
    }
    # As LeRobot's v3.0 writer declares them (lerobot.datasets.utils.get_hf_features_from_features).
    features = Features({
        "observation.image": Image(), "observation.state": List(Value("float32"), length=4),
        "action": List(Value("float32"), length=4), "next.reward": Value("float32"), "next.success": Value("bool"),
        "observation.environment_state": List(Value("float32"), length=39), "task_id": Value("int16"),
        "timestamp": Value("float32"), "frame_index": Value("int64"), "episode_index": Value("int64"),
        "index": Value("int64"), "task_index": Value("int64"),
    })
    channels_first = version == "v3.0"
    info = {
        "codebase_version": version, "robot_type": "metaworld", "total_episodes": len(LENGTHS), "total_frames": n,
        "total_tasks": len(TASKS), "chunks_size": 1000, "fps": FPS, "splits": {"train": f"0:{len(LENGTHS)}"},
        "features": {
            "observation.state": {"dtype": "float32", "shape": [4], "names": {"axes": None}},
            "action": {"dtype": "float32", "shape": [4], "names": {"axes": ["x", "y", "z", "gripper"]}},
            "next.reward": {"dtype": "float32", "shape": [1], "names": None},
            "next.success": {"dtype": "bool", "shape": [1], "names": None},
            "observation.environment_state": {"dtype": "float32", "shape": [39], "names": ["keypoints"]},
            "observation.image": ({"dtype": "image", "shape": [3, h, w], "names": ["channels", "height", "width"]}
                                  if channels_first else
                                  {"dtype": "image", "shape": [h, w, 3], "names": ["height", "width", "channel"]}),
            "task_id": {"dtype": "int16", "shape": [1], "names": None},
            **{k: {"dtype": d, "shape": [1], "names": None} for k, d in (
                ("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"), ("index", "int64"),
                ("task_index", "int64"))},
        },
    }
    meta = root / "meta"
    meta.mkdir(parents=True)
    stats = {k: _stats(np.asarray(columns[k])) for k in ("observation.state", "action", "next.reward",
                                                          "observation.environment_state")}
    # LeRobot keeps an image's stats per channel, shaped [3, 1, 1].
    stats["observation.image"] = {s: np.asarray(v).reshape(3, 1, 1).tolist() for s, v in
                                  _stats(images.reshape(-1, 3) / 255.0).items() if s != "count"}
    (meta / "stats.json").write_text(json.dumps(stats))
    starts = np.cumsum([0, *LENGTHS])
    if version == "v3.0":
        info["data_path"] = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
        info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
        info.update(data_files_size_in_mb=100, video_files_size_in_mb=500)
        path = root / "data" / "chunk-000" / "file-000.parquet"
        path.parent.mkdir(parents=True)
        Dataset.from_dict(columns, features=features).to_parquet(str(path))
        episodes = {
            "episode_index": list(range(len(LENGTHS))), "tasks": [[TASKS[t]] for t in EPISODE_TASK],
            "length": LENGTHS, "data/chunk_index": [0] * len(LENGTHS), "data/file_index": [0] * len(LENGTHS),
            "dataset_from_index": starts[:-1].tolist(), "dataset_to_index": starts[1:].tolist(),
            "meta/episodes/chunk_index": [0] * len(LENGTHS), "meta/episodes/file_index": [0] * len(LENGTHS),
        }
        (meta / "episodes" / "chunk-000").mkdir(parents=True)
        Dataset.from_dict(episodes).to_parquet(str(meta / "episodes" / "chunk-000" / "file-000.parquet"))
        # As LeRobot writes it: a pandas frame indexed by the task string.
        pd.DataFrame({"task_index": range(len(TASKS))}, index=pd.Index(TASKS, name="task")).to_parquet(
            meta / "tasks.parquet")
    else:
        info["data_path"] = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        info["video_path"] = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
        whole = Dataset.from_dict(columns, features=features)
        for e in range(len(LENGTHS)):
            path = root / "data" / "chunk-000" / f"episode_{e:06d}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            whole.select(range(starts[e], starts[e + 1])).to_parquet(str(path))
        (meta / "episodes.jsonl").write_text("".join(json.dumps({"episode_index": e, "tasks": [TASKS[t]], "length": k})
                                                     + "\n" for e, (t, k) in enumerate(zip(EPISODE_TASK, LENGTHS))))
        (meta / "tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n"
                                                  for i, t in enumerate(TASKS)))
    (meta / "info.json").write_text(json.dumps(info, indent=4))
    return {"png": encoded, "state": state, "action": action, "starts": starts}


def pil_frame(data: bytes, size: int | None = None) -> np.ndarray:
    """The reference: PIL decodes the PNG; at another size, the inference server's own resize of that picture."""
    img = np.asarray(PIL.open(io.BytesIO(data)).convert("RGB"))
    return img if size is None else prepare_image(img, size)


@pytest.fixture(scope="module")
def mt50(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("metaworld_mt50")
    return root, write_mt50_like(root)


def mt50_cfg(root: Path, *overrides: str):
    return compose(["experiment=mt50", f"data.root={root}", "policy.image_size=32", "data.num_workers=0",
                    "logging.wandb.mode=disabled", "trainer.progress_bar=false", "trainer.global_batch_size=4",
                    *overrides])


def check_sample(sample: dict, written: dict, size: int = 32) -> None:
    """One sample against what was written: the frame PIL decodes, state, action chunk, instruction."""
    e, t = int(sample["episode_index"]), int(sample["frame_index"])
    g = int(written["starts"][e]) + t
    expected = pil_frame(written["png"][g], None if size == H else size)
    images = sample["images"].numpy()
    assert images.shape == (1, size, size, 3)
    np.testing.assert_array_equal(images[0], expected, err_msg=f"episode {e} frame {t}")
    np.testing.assert_array_equal(sample["state"].numpy(), written["state"][g])
    end = int(written["starts"][e + 1])
    chunk = np.minimum(np.arange(g, g + len(sample["actions"])), end - 1)
    np.testing.assert_array_equal(sample["actions"].numpy(), written["action"][chunk])
    np.testing.assert_array_equal(sample["action_mask"].numpy(), np.arange(g, g + len(chunk)) < end)
    assert sample["instruction"] == TASKS[EPISODE_TASK[e]]


def unbatch(batch: dict) -> list[dict]:
    n = len(batch["frame_index"])
    return [{k: v[i] for k, v in batch.items() if isinstance(v, torch.Tensor | list)} for i in range(n)]


def test_the_metadata_reads_both_image_shape_conventions(mt50, tmp_path):
    meta = LeRobotMetadata(mt50[0])
    assert meta.image_keys == meta.camera_keys == ["observation.image"] and meta.video_keys == []
    assert meta.frame_hw("observation.image") == (H, W)  # [3, H, W], names channels first
    write_mt50_like(tmp_path / "old", "v2.1", h=24, w=40)
    assert LeRobotMetadata(tmp_path / "old").frame_hw("observation.image") == (24, 40)  # [H, W, 3]
    assert not (mt50[0] / CHECKSUMS).exists()  # LeRobot's datasets carry none: read as before
    info = json.loads((tmp_path / "old" / "meta" / "info.json").read_text())
    info["features"]["observation.image"]["shape"] = [24, 40]
    (tmp_path / "old" / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"info.json: feature 'observation.image' has shape \[24, 40\]; a camera's is"):
        LeRobotMetadata(tmp_path / "old").frame_hw("observation.image")


@pytest.mark.parametrize("loader", ["stream_cached", "stream_window", "map"])
def test_every_training_sample_is_the_png_pil_decodes(mt50, loader):
    """The stream with whole episodes kept (mt50's setting), the stream's forward windows and the map loader:
    every sample of an epoch, frame for frame as PIL decodes it, with its state, actions and task string."""
    root, written = mt50
    over = {"stream_cached": [], "stream_window": ["data.stream_cache_episodes=0"], "map": ["data.loader=map"]}[loader]
    cfg = mt50_cfg(root, *over)
    data = TrainData(Mixture(cfg.data, policy_spec(cfg, image_size=32), 0), cfg.data, 4, 0, 1, 0)
    seen = []
    for batch in data.iterate(0, 0):
        for sample in unbatch(batch):
            check_sample(sample, written)
            seen.append((int(sample["episode_index"]), int(sample["frame_index"])))
    assert len(seen) >= 24 and len(set(seen)) == len(seen)
    assert {e for e, _ in seen} == {0, 1, 2}


def test_validation_windows_and_other_sizes_read_the_same_frames(mt50):
    """Validation's forward windows over every sample, at 16 px (the resize is the server's own, prepare_image)."""
    root, written = mt50
    cfg = mt50_cfg(root)
    val = ValidationDataset(Mixture(cfg.data, policy_spec(cfg, image_size=16), 0), split="all")
    assert len(val) == sum(LENGTHS)
    for i in range(len(val)):
        check_sample(val[i], written, size=16)


def test_frames_at_their_own_size_in_both_layouts(tmp_path):
    """A policy that resizes frames itself (image_size=None) gets them as recorded, non-square, in v3.0 and v2.1."""
    for version in ("v3.0", "v2.1"):
        root = tmp_path / version
        written = write_mt50_like(root, version, h=24, w=40)
        cfg = mt50_cfg(root)
        spec = replace(policy_spec(cfg), image_size=None)
        source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, spec, 0)
        for pos in range(len(LENGTHS)):
            whole = source.load_episode(pos).frames
            window = source.open_episode(pos)
            for t in range(LENGTHS[pos]):
                expected = pil_frame(written["png"][written["starts"][pos] + t])
                assert expected.shape == (24, 40, 3)
                np.testing.assert_array_equal(whole[t, 0], expected)
                np.testing.assert_array_equal(window.images(np.asarray([t]))[0, 0], expected)
            window.close()


def test_a_long_episode_is_read_through_chunks_of_its_bytes(mt50, monkeypatch):
    """A window holds a chunk of an episode's encoded frames at a time, never the whole episode's."""
    from slurmvla.data.images import ImageReader

    root, written = mt50
    monkeypatch.setattr(ImageReader, "CHUNK", 3)
    reads = []
    original = LeRobotMetadata.read_frames
    monkeypatch.setattr(LeRobotMetadata, "read_frames",
                        lambda self, pos, keys, first=0, end=None: reads.append((first, end)) or original(
                            self, pos, keys, first, end))
    cfg = mt50_cfg(root)
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, image_size=32), 0)
    reads.clear()
    window = source.open_episode(2)
    for t in range(LENGTHS[2]):
        np.testing.assert_array_equal(window.images(np.asarray([t]))[0, 0],
                                      pil_frame(written["png"][written["starts"][2] + t]))
    # The episode's columns once, then its images three frames at a time.
    assert reads == [(0, None), (0, 3), (3, 6), (6, 9), (9, 12), (12, 14)]


BAD = {"not an image": b"<html>rate limited</html>", "truncated PNG": None, "no bytes": None}


@pytest.mark.parametrize("damage", list(BAD))
def test_a_damaged_frame_is_skipped_naming_the_file_or_one_line_error(tmp_path, caplog, damage):
    """Frame 3 of episode 1 damaged: skip warns naming the data file and episode 1, and its samples come from
    another episode (every sample delivered is still the PNG PIL decodes); error stops on one line naming it."""
    root = tmp_path / "ds"
    good = write_mt50_like(tmp_path / "good")
    bad_index = int(good["starts"][1]) + 3
    data = {"not an image": BAD["not an image"], "truncated PNG": good["png"][bad_index][:60], "no bytes": None}[damage]
    written = write_mt50_like(root, damage={bad_index: data})
    data_file = root / "data" / "chunk-000" / "file-000.parquet"
    for over in ([], ["data.stream_cache_episodes=0"], ["data.loader=map"]):
        cfg = mt50_cfg(root, "data.on_damaged=skip", *over)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="slurmvla"):
            batches = list(TrainData(Mixture(cfg.data, policy_spec(cfg, image_size=32), 0), cfg.data, 4, 0, 1,
                                     0).iterate(0, 0))
        warned = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        assert len(warned) == 1, warned
        assert f"{data_file} (episode 1 of mt50)" in warned[0] and "frame 3 of episode 1" in warned[0]
        assert sum(int(b["damaged_episodes"].sum()) for b in batches) >= 1
        for batch in batches:
            for sample in unbatch(batch):
                assert int(sample["episode_index"]) != 1
                check_sample(sample, written)
    cfg = mt50_cfg(root, "data.on_damaged=error", "data.stream_cache_episodes=0")
    data = TrainData(Mixture(cfg.data, policy_spec(cfg, image_size=32), 0), cfg.data, 4, 0, 1, 0)
    with pytest.raises(DataError) as err:
        list(data.iterate(0, 0))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{data_file}: frame 3 of episode 1, camera 'observation.image': ")
    # python -m slurmvla.inspect --scan finds it, with the episode that holds it.
    found = scan(Mixture(cfg.data, policy_spec(cfg, image_size=32), 0).sources)
    assert [(f.path, f.episodes) for f in found] == [(data_file, [1])]
    assert "frame 3 of episode 1" in found[0].reason


def test_checksums_when_present_guard_the_image_bytes(mt50, tmp_path):
    """LeRobot's datasets have no meta/checksums.json and read as before (every test here); a copy given checksums
    reads the same, and a byte changed in it afterwards is the data file's damage, named."""
    root = tmp_path / "copy"
    shutil.copytree(mt50[0], root)
    write_checksums(root)
    cfg = mt50_cfg(root, "data.on_damaged=error")
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, image_size=32), 0)
    assert source.load_episode(0).frames.shape == (LENGTHS[0], 1, 32, 32, 3)
    path = root / "data" / "chunk-000" / "file-000.parquet"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="its content differs from the sha256 it was written with"):
        source.load_episode(1)


def test_a_dataset_with_a_video_camera_and_an_image_camera(mt50, tmp_path):
    """Mixed storage: the image camera read from the data file, the video camera from its mp4, in one sample."""
    from slurmvla.data.writer import encode_video

    root, written = tmp_path / "mixed", mt50[1]
    shutil.copytree(mt50[0], root)
    frames = np.stack([pil_frame(b) for b in written["png"]])
    # The video camera shows one flat colour per frame, each frame's its own: lossy H.264 keeps flat colours within
    # a few levels, so a frame read at the wrong time would show.
    colours = (np.arange(len(frames))[:, None] * [23, 41, 67] + [20, 50, 100]) % 200 + 20
    video = np.broadcast_to(colours[:, None, None, :], frames.shape).astype(np.uint8)
    encode_video(root / "videos" / "observation.image2" / "chunk-000" / "file-000.mp4", video, "h264", fps=FPS)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.image2"] = {"dtype": "video", "shape": [H, W, 3],
                                              "names": ["height", "width", "channels"]}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    episodes_path = root / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    episodes = pd.read_parquet(episodes_path)
    starts = written["starts"]
    episodes["videos/observation.image2/chunk_index"] = 0
    episodes["videos/observation.image2/file_index"] = 0
    episodes["videos/observation.image2/from_timestamp"] = starts[:-1] / FPS
    episodes["videos/observation.image2/to_timestamp"] = starts[1:] / FPS
    episodes.to_parquet(episodes_path)
    cfg = mt50_cfg(root, "data.cameras=[observation.image,observation.image2]", "policy.num_cameras=2")
    source = LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, image_size=32), 0)
    for pos in range(len(LENGTHS)):
        for episode in (source.load_episode(pos), source.open_episode(pos)):
            images = episode.images(np.arange(LENGTHS[pos]))
            exact = frames[starts[pos] : starts[pos + 1]]
            np.testing.assert_array_equal(images[:, 0], exact)
            error = np.abs(images[:, 1].astype(int) - video[starts[pos] : starts[pos + 1]]).max(axis=(1, 2, 3))
            assert error.max() <= 4, error
            episode.close()


def test_training_and_inspect_run_on_it_unchanged(mt50, tmp_path, capsys):
    """python -m slurmvla.train experiment=mt50 data.root=DIR (through its Python API: the same composition and
    trainer), a few steps; python -m slurmvla.inspect describes it."""
    from slurmvla.inspect import main as inspect_main
    from slurmvla.trainer import Trainer

    root = mt50[0]
    cfg = mt50_cfg(root, "trainer.max_steps=2", "checkpoint.every_steps=0", "trainer.log_every_steps=1",
                   "scheduler.warmup_steps=0")
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.fit()
    trainer.close()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    assert all(m["damaged_episodes"] == 0 for m in metrics)
    inspect_main(["experiment=mt50", f"data.root={root}"])
    summary = json.loads(capsys.readouterr().out)
    entry = summary["datasets"]["mt50"]
    assert (entry["format"], entry["episodes"], entry["frames"], entry["samples_per_epoch"]) == ("v3.0", 3, 32, 32)
