"""Write a small DROID-format dataset in the LeRobot v3.0 (or v2.1) layout, with real mp4 video.

    python -m slurmvla.data.synthetic --out DIR --episodes 24 [--format v2.1]

    python -m slurmvla.data.synthetic --out DIR --codec h264 --gop 15   # the older H.264 encoding

Feature names, shapes and encoding are LeRobot's DROID port's (three 180x320 cameras at 15 fps as
AV1 through SVT-AV1 at GOP 2 / CRF 30, yuv420p; 8-D state and action plus their joint / gripper /
cartesian sub-keys as fixed-size float32 lists; three language instructions; ``is_episode_successful``
and RLDS's ``is_first`` / ``is_last`` / ``is_terminal``), with many episodes per data and video file
(v3.0). The episodes are instances of six tasks: the arm moves a fixed fraction of the way to the
task's goal each step, the scene colour shows the task and the instruction names it, and the action
is the next joint position, so a held-out episode is predictable from the others.
Episode lengths vary, and some episodes are shorter than an action chunk. Beside the data it
writes ``keep_ranges_1_0_1.json`` and ``episode_id_to_path.json`` in DROID's formats (idle first and
last steps cut from long episodes, every fifth episode left out), to exercise the idle filter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from slurmvla.compose import ArgumentParser
from slurmvla.data.keep_ranges import episode_key
from slurmvla.droid_features import DROID_CAMERAS

FPS = 15
HEIGHT, WIDTH = 180, 320
OBJECTS = ["red cup", "blue block", "green marker", "yellow sponge", "black bowl", "white towel"]
PLACES = ["the drawer", "the shelf", "the sink", "the left bin", "the right bin", "the tray"]
LABS = ["AUTOLab", "ILIAD", "IRIS", "RAIL", "PennPAL", "REAL"]
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V2_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V2_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
FORMATS = ("v3.0", "v2.1")


# Each task's goal joint configuration: a held-out episode of a task is predictable from the others.
GOALS = np.stack([np.linspace(-0.8, 0.8, len(OBJECTS))[g] * np.cos(np.arange(7) * 0.9 + g) for g in range(len(OBJECTS))])
GAIN = 0.12  # the fraction of the remaining way to the goal the arm covers per step


def _episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    """One episode of one of a few tasks. The arm starts anywhere and moves a fixed fraction of the
    remaining way to the task's goal each step (the goal is shown by the scene colour and named by
    the instruction); the gripper closes once the arm is near the goal. The action is the next
    joint and gripper position: a smooth function of what the cameras and the state show."""
    goal_id = int(rng.integers(len(OBJECTS)))
    goal = GOALS[goal_id]
    joints = np.empty((length + 1, 7))
    gripper = np.empty(length + 1)
    joints[0], gripper[0] = rng.uniform(-1.0, 1.0, size=7), 0.0
    for t in range(length):
        joints[t + 1] = joints[t] + GAIN * (goal - joints[t])
        near = np.abs(joints[t] - goal).max() < 0.3
        gripper[t + 1] = min(1.0, gripper[t] + 0.25) if near else gripper[t]
    state = np.concatenate([joints[:-1], gripper[:-1, None]], axis=1).astype(np.float32)
    action = np.concatenate([joints[1:], gripper[1:, None]], axis=1).astype(np.float32)
    return {"state": state, "action": action, "goal_id": goal_id}


def _cartesian(joints: np.ndarray) -> np.ndarray:
    """A smooth stand-in for forward kinematics: 3 position + 3 orientation values."""
    c = np.cumsum(joints[:, :6], axis=1)
    return np.concatenate([np.cos(c[:, :3]) * 0.5, np.sin(c[:, 3:]) * 0.5], axis=1).astype(np.float32)


def _render(state: np.ndarray, goal_id: int, camera: int, texture: np.random.Generator | None = None) -> np.ndarray:
    """Frames ``[T, H, W, 3]``: scene colour shows the goal, a square tracks the arm, brightness the gripper.
    With ``texture`` (a generator for the noise) the scene is textured, drifts as a moving camera's view
    does and carries sensor noise: it decodes like camera footage, which flat colour flatters."""
    length = len(state)
    hue = np.array([[200, 60, 60], [60, 60, 200], [60, 180, 60], [210, 200, 60], [40, 40, 40], [220, 220, 220]])
    frames = np.empty((length, HEIGHT, WIDTH, 3), dtype=np.uint8)
    base = (hue[goal_id] * (0.6 + 0.2 * camera)).clip(0, 255)
    if texture is not None:
        yy, xx = np.mgrid[0 : HEIGHT + 64, 0 : WIDTH + 64].astype(np.float32)
        pattern = 45 * np.sin(xx / (4.0 + camera)) * np.cos(yy / 6.0) + 25 * np.sin((xx + 2 * yy) / 17.0)
    for i in range(length):
        frame = frames[i]
        if texture is None:
            frame[:] = base.astype(np.uint8)
        else:
            dy, dx = (i // 2) % 64, (3 * i) % 64
            view = pattern[dy : dy + HEIGHT, dx : dx + WIDTH, None] + base + texture.normal(0, 5, (HEIGHT, WIDTH, 3))
            frame[:] = view.clip(0, 255).astype(np.uint8)
        x = int((state[i, camera] + 1.2) / 2.4 * (WIDTH - 40))
        y = int((state[i, camera + 3] + 1.2) / 2.4 * (HEIGHT - 40))
        x, y = min(max(x, 0), WIDTH - 40), min(max(y, 0), HEIGHT - 40)
        shade = int(80 + 170 * state[i, 7])
        frame[y : y + 40, x : x + 40] = (shade, 255 - shade, 128)
    return frames


CODECS = ("av1", "h264")
CONTENTS = ("flat", "camera")
# LeRobot's DROID port: AV1 through SVT-AV1, a keyframe every 2 frames, CRF 30, yuv420p. The preset
# only trades encoding speed for size. H.264 (libx264) stays available for comparison.
ENCODERS = {"av1": ("libsvtav1", {"crf": "30", "preset": "10"}), "h264": ("libx264", {"crf": "23", "preset": "veryfast", "bf": "0"})}
DEFAULT_GOP = {"av1": 2, "h264": FPS}


@contextlib.contextmanager
def _scheduling_kept():
    """Restore the calling thread's scheduling policy afterwards. SVT-AV1, run as root, switches the
    thread that opens an encoder to SCHED_FIFO priority 99; every process started from it later
    (torchrun ranks, data workers, a policy server) would inherit real-time priority, and on a small
    machine spinning real-time threads starve the rest (a server that never exits, a test that hangs)."""
    try:
        policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    except (AttributeError, OSError):  # not Linux
        yield
        return
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority) != (policy, param.sched_priority):
            os.sched_setscheduler(0, policy, param)


def _encode(path: Path, frames: np.ndarray, codec: str = "av1", gop: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner per encoder otherwise; errors only
    name, options = ENCODERS[codec]
    with _scheduling_kept(), av.open(str(path), mode="w") as container:
        stream = container.add_stream(name, rate=Fraction(FPS))
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {**options, "g": str(gop or DEFAULT_GOP[codec])}
        for i, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            frame.time_base = Fraction(1, FPS)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _stats(x: np.ndarray) -> dict[str, list]:
    return {
        "min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(),
        "std": x.std(0).tolist(), "count": [int(len(x))],
        "q01": np.quantile(x, 0.01, axis=0).tolist(), "q99": np.quantile(x, 0.99, axis=0).tolist(),
    }


# Features whose per-episode stats the writer stores (meta/episodes in v3.0, episodes_stats.jsonl in v2.1).
EPISODE_STATS_KEYS = ("observation.state", "action", "is_episode_successful")


def _as_2d(x: np.ndarray) -> np.ndarray:
    return x.reshape(len(x), -1).astype(np.float64)


def _float_list(x: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), pa.float32()), x.shape[1])


def write_droid_sample(out: str | Path, num_episodes: int, seed: int = 0, episodes_per_file: int = 8,
                       min_length: int = 4, max_length: int = 60, format: str = "v3.0", codec: str = "av1",
                       gop: int | None = None, length: int | None = None, content: str = "flat") -> Path:
    """Write the dataset into ``out`` atomically (a temporary folder renamed at the end).

    ``format`` is the LeRobot layout: ``v3.0`` (``episodes_per_file`` episodes per parquet / mp4) or
    ``v2.1`` (one parquet and one mp4 per episode, jsonl metadata, per-episode stats). The same
    seed gives the same episodes in either layout. ``codec``: ``av1`` (SVT-AV1 at GOP 2 and CRF 30,
    as LeRobot's DROID port) or ``h264``; ``gop`` overrides the keyframe interval (frames);
    ``length`` makes every episode that long. ``content``: ``flat`` scenes, or ``camera`` (textured,
    drifting, noisy: decodes like camera footage; for benchmarks).
    """
    if content not in CONTENTS:
        raise ValueError(f"content={content!r} is not valid; choose one of {list(CONTENTS)}")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not valid; choose one of {list(FORMATS)}")
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r} is not valid; choose one of {list(CODECS)}")
    if gop is not None and gop < 1:
        raise ValueError(f"gop={gop} is not valid; it must be >= 1 (frames between keyframes)")
    video = (codec, gop)
    out = Path(out)
    if (out / "meta" / "info.json").is_file():
        raise FileExistsError(f"{out} already holds a dataset")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(seed)
    # A quarter of the episodes (and always the second) are shorter than a typical action chunk.
    lengths = [int(rng.integers(min_length, 8)) if (rng.random() < 0.25 or e == 1) else int(rng.integers(24, max_length + 1))
               for e in range(num_episodes)]
    if length is not None:  # every episode this long (benchmarks at DROID's episode lengths)
        lengths = [length] * num_episodes
    episodes = [_episode(rng, n) for n in lengths]
    tasks: list[str] = []
    rel_paths: dict[str, str] = {}
    per_episode = []  # (columns, frames per camera, metadata row)
    global_index = 0
    for e, (ep, n) in enumerate(zip(episodes, lengths)):
        obj, place = OBJECTS[ep["goal_id"]], PLACES[ep["goal_id"]]
        instructions = [f"put the {obj} in {place}", f"move the {obj} to {place}", ""]
        if rng.random() < 0.5:
            instructions[2] = f"place {obj} into {place}"
        if rng.random() < 0.2:
            instructions[1] = ""
        if instructions[0] not in tasks:
            tasks.append(instructions[0])
        success = bool(rng.random() < 0.8)
        episode_id = _episode_id(e)
        # A DROID-style relative path; the keep-ranges file drops the idle first and last steps of
        # long episodes and leaves every fifth episode out (such episodes are dropped by the filter).
        rel_paths[episode_id] = f"{LABS[e % len(LABS)]}/{'success' if success else 'failure'}/2023-10-{1 + e % 28:02d}/ep{e:05d}"
        cart_state, cart_action = _cartesian(ep["state"]), _cartesian(ep["action"])
        columns = {
            "observation.state": ep["state"],
            "observation.state.joint_position": ep["state"][:, :7],
            "observation.state.gripper_position": ep["state"][:, 7:],
            "observation.state.cartesian_position": cart_state,
            "action": ep["action"],
            "action.joint_position": ep["action"][:, :7],
            "action.gripper_position": ep["action"][:, 7:],
            "action.joint_velocity": ((ep["action"][:, :7] - ep["state"][:, :7]) * FPS).astype(np.float32),
            "action.gripper_velocity": ((ep["action"][:, 7:] - ep["state"][:, 7:]) * FPS).astype(np.float32),
            "action.cartesian_position": cart_action,
            "action.cartesian_velocity": ((cart_action - cart_state) * FPS).astype(np.float32),
            "timestamp": (np.arange(n) / FPS).astype(np.float32),
            "frame_index": np.arange(n, dtype=np.int64),
            "episode_index": np.full(n, e, dtype=np.int64),
            "index": np.arange(global_index, global_index + n, dtype=np.int64),
            "task_index": np.full(n, tasks.index(instructions[0]), dtype=np.int64),
            "is_episode_successful": np.full(n, success),
            # RLDS's step flags, as the DROID port keeps them (DROID's episodes end in a terminal step).
            "is_first": np.arange(n) == 0,
            "is_last": np.arange(n) == n - 1,
            "is_terminal": np.arange(n) == n - 1,
        }
        for k, key in enumerate(("language_instruction", "language_instruction_2", "language_instruction_3")):
            columns[key] = np.array([instructions[k]] * n, dtype=object)
        noise = np.random.default_rng([seed, e]) if content == "camera" else None
        frames = {cam: _render(ep["state"], ep["goal_id"], c, noise) for c, cam in enumerate(DROID_CAMERAS)}
        row = {"episode_index": e, "tasks": [instructions[0]], "length": n, "episode_id": episode_id}
        per_episode.append((columns, frames, row))
        global_index += n

    if format == "v3.0":
        _write_v3(tmp, per_episode, tasks, episodes_per_file, video)
    else:
        _write_v2(tmp, per_episode, tasks, video)
    keep = {}
    for e, n in enumerate(lengths):
        if e % 5 == 4:
            continue
        keep[episode_key(rel_paths[_episode_id(e)])] = [[1, n - 1]] if n > 12 else [[0, n]]
    (tmp / "keep_ranges_1_0_1.json").write_text(json.dumps(keep, indent=1))
    (tmp / "episode_id_to_path.json").write_text(json.dumps(rel_paths, indent=1))
    info = _info(format, num_episodes, global_index, len(tasks), codec)
    (tmp / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def _episode_id(e: int) -> str:
    return f"{LABS[e % len(LABS)]}+{(e * 2654435761) % 16**8:08x}+2023-10-{1 + e % 28:02d}-{e % 24:02d}h-{e % 60:02d}m-{(7 * e) % 60:02d}s"


def _table(columns: dict[str, np.ndarray]) -> pa.Table:
    arrays = {}
    for key, value in columns.items():
        if value.ndim == 2 and value.shape[1] == 1:
            # A shape-[1] feature is a plain scalar column, as LeRobot's writer stores it (datasets' Value).
            arrays[key] = pa.array(value[:, 0], pa.float32())
        elif value.ndim == 2:
            arrays[key] = _float_list(value)
        elif value.dtype == object:
            arrays[key] = pa.array(value.tolist(), pa.string())
        else:
            arrays[key] = pa.array(value)
    return pa.table(arrays)


def _write_v3(tmp: Path, per_episode: list, tasks: list[str], episodes_per_file: int, video: tuple) -> None:
    rows = []
    for file_index in range(0, len(per_episode), episodes_per_file):
        group = per_episode[file_index : file_index + episodes_per_file]
        f = file_index // episodes_per_file
        cursor = 0
        for columns, _, row in group:
            n = row["length"]
            start = int(columns["index"][0])
            row = {**row, "data/chunk_index": 0, "data/file_index": f, "dataset_from_index": start,
                   "dataset_to_index": start + n, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            for cam in DROID_CAMERAS:
                row.update({f"videos/{cam}/chunk_index": 0, f"videos/{cam}/file_index": f,
                            f"videos/{cam}/from_timestamp": cursor / FPS, f"videos/{cam}/to_timestamp": (cursor + n) / FPS})
            cursor += n
            # Per-episode stats, as LeRobot's writer keeps them beside the episode boundaries.
            for key in EPISODE_STATS_KEYS:
                row.update({f"stats/{key}/{name}": value for name, value in _stats(_as_2d(columns[key])).items()})
            rows.append(row)
        merged = {k: np.concatenate([c[k] for c, _, _ in group]) for k in group[0][0]}
        path = tmp / DATA_PATH.format(chunk_index=0, file_index=f)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(merged), path)
        for cam in DROID_CAMERAS:
            _encode(tmp / VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=f),
                    np.concatenate([frames[cam] for _, frames, _ in group]), *video)
    meta = tmp / "meta"
    (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), meta / "episodes" / "chunk-000" / "file-000.parquet")
    _write_tasks(meta / "tasks.parquet", tasks)
    state = np.concatenate([c["observation.state"] for c, _, _ in per_episode])
    action = np.concatenate([c["action"] for c, _, _ in per_episode])
    stats = {"observation.state": _stats(state), "action": _stats(action)}
    (meta / "stats.json").write_text(json.dumps(stats, indent=2))


def _write_tasks(path: Path, tasks: list[str]) -> None:
    """``meta/tasks.parquet`` as LeRobot writes it (a pandas frame indexed by the task string): LeRobot
    reads the string from the frame's index, and would take the row number for it without this metadata."""
    pandas_meta = {"index_columns": ["task"], "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode",
                                                                  "numpy_type": "object", "metadata": {"encoding": "UTF-8"}}],
                   "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
                                "metadata": None},
                               {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object",
                                "metadata": None}],
                   "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.0"}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "task": pa.array(tasks, pa.string())})
    pq.write_table(table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)}), path)


def _write_v2(tmp: Path, per_episode: list, tasks: list[str], video: tuple) -> None:
    meta = tmp / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    episode_lines, stats_lines = [], []
    for columns, frames, row in per_episode:
        e = row["episode_index"]
        path = tmp / V2_DATA_PATH.format(episode_chunk=0, episode_index=e)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(columns), path)
        for cam in DROID_CAMERAS:
            _encode(tmp / V2_VIDEO_PATH.format(episode_chunk=0, video_key=cam, episode_index=e), frames[cam], *video)
        episode_lines.append(json.dumps(row))
        # v2.1 per-episode stats carry no quantiles.
        ep_stats = {k: {s: v for s, v in _stats(_as_2d(columns[k])).items() if s not in ("q01", "q99")}
                    for k in EPISODE_STATS_KEYS}
        stats_lines.append(json.dumps({"episode_index": e, "stats": ep_stats}))
    (meta / "episodes.jsonl").write_text("\n".join(episode_lines) + "\n")
    (meta / "episodes_stats.jsonl").write_text("\n".join(stats_lines) + "\n")
    (meta / "tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n" for i, t in enumerate(tasks)))


def _info(format: str, num_episodes: int, num_frames: int, num_tasks: int, codec: str) -> dict:
    def vec(n: int, names: list[str]) -> dict:
        return {"dtype": "float32", "shape": [n], "names": names}

    joints = [f"joint_{i}" for i in range(7)]
    features = {
        cam: {
            "dtype": "video", "shape": [HEIGHT, WIDTH, 3], "names": ["height", "width", "channels"],
            "info": {"video.fps": FPS, "video.height": HEIGHT, "video.width": WIDTH, "video.channels": 3,
                     "video.codec": codec, "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "has_audio": False},
        }
        for cam in DROID_CAMERAS
    }
    features.update({
        "observation.state": vec(8, [*joints, "gripper"]),
        "observation.state.joint_position": vec(7, joints),
        "observation.state.gripper_position": vec(1, ["gripper"]),
        "observation.state.cartesian_position": vec(6, ["x", "y", "z", "roll", "pitch", "yaw"]),
        "action": vec(8, [*joints, "gripper"]),
        "action.joint_position": vec(7, joints),
        "action.gripper_position": vec(1, ["gripper"]),
        "action.joint_velocity": vec(7, joints),
        "action.gripper_velocity": vec(1, ["gripper"]),
        "action.cartesian_position": vec(6, ["x", "y", "z", "roll", "pitch", "yaw"]),
        "action.cartesian_velocity": vec(6, ["x", "y", "z", "roll", "pitch", "yaw"]),
        "language_instruction": {"dtype": "string", "shape": [1], "names": None},
        "language_instruction_2": {"dtype": "string", "shape": [1], "names": None},
        "language_instruction_3": {"dtype": "string", "shape": [1], "names": None},
        "is_episode_successful": {"dtype": "bool", "shape": [1], "names": None},
        "is_first": {"dtype": "bool", "shape": [1], "names": None},
        "is_last": {"dtype": "bool", "shape": [1], "names": None},
        "is_terminal": {"dtype": "bool", "shape": [1], "names": None},
        "timestamp": {"dtype": "float32", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "index": {"dtype": "int64", "shape": [1], "names": None},
        "task_index": {"dtype": "int64", "shape": [1], "names": None},
    })
    common = {"robot_type": "franka", "fps": FPS, "total_episodes": num_episodes, "total_frames": num_frames,
              "total_tasks": num_tasks, "chunks_size": 1000, "splits": {"train": f"0:{num_episodes}"}}
    if format == "v2.1":
        return {"codebase_version": "v2.1", **common, "total_chunks": 1, "total_videos": 3 * num_episodes,
                "data_path": V2_DATA_PATH, "video_path": V2_VIDEO_PATH, "features": features}
    return {"codebase_version": "v3.0", **common, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 500, "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": features}


def ensure_sample_dataset(cfg) -> None:  # noqa: ANN001 - a DataConfig
    """Write the sample dataset on first use when a dataset's root is null; a no-op otherwise."""
    if cfg.root is not None and all(m.root is not None for m in cfg.mixture.values()):
        return
    root = cfg.sample_root()
    if (root / "meta" / "info.json").is_file():
        return
    try:
        write_droid_sample(root, cfg.sample_episodes, seed=0, episodes_per_file=max(1, cfg.sample_episodes // 3))
    except OSError:
        # Another process (a second node sharing the cache) finished first: its copy is complete.
        if not (root / "meta" / "info.json").is_file():
            raise


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (must not hold a dataset yet)")
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes-per-file", type=int, default=8,
                        help="episodes packed into one parquet / mp4 file (LeRobot v3.0 packs many; default 8)")
    parser.add_argument("--format", choices=FORMATS, default="v3.0", help="LeRobot layout (default v3.0)")
    parser.add_argument("--codec", choices=CODECS, default="av1",
                        help="video codec: av1 (SVT-AV1, GOP 2, CRF 30: LeRobot's DROID port; default) or h264")
    parser.add_argument("--gop", type=int, default=None, help="keyframe interval in frames (default: 2 for av1, 15 for h264)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    problem = None
    if args.episodes < 1:
        problem = f"--episodes={args.episodes} must be >= 1"
    elif args.episodes_per_file < 1:
        problem = f"--episodes-per-file={args.episodes_per_file} must be >= 1"
    elif args.gop is not None and args.gop < 1:
        problem = f"--gop={args.gop} must be >= 1"
    elif (out / "meta" / "info.json").is_file():
        problem = f"--out={args.out!r} already holds a dataset; give a new or empty folder"
    elif out.exists() and not out.is_dir():
        problem = f"--out={args.out!r} is a file; give a new or empty folder"
    elif out.is_dir() and any(out.iterdir()):
        problem = f"--out={args.out!r} is a folder that holds other files; give a new or empty folder"
    if problem is None:
        try:
            path = write_droid_sample(out, args.episodes, seed=args.seed, episodes_per_file=args.episodes_per_file,
                                      format=args.format, codec=args.codec, gop=args.gop)
        except OSError as e:  # e.g. a folder that cannot be written
            problem = f"cannot write the dataset to --out={args.out!r}: {e.strerror or e}"
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.episodes} episodes to {path}")


if __name__ == "__main__":
    main()

