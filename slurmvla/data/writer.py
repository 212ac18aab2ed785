"""The project's LeRobot writer: episodes in DROID's layout as LeRobot v3.0 (or v2.1) files, with real video.

Every dataset slurmvla writes goes through here (the sample dataset, :mod:`slurmvla.data.synthetic`, and
the simulator's demonstrations, :mod:`slurmvla.sim.record`): the layout LeRobot's own writer produces
(shape-[1] features as scalar columns, ``meta/tasks.parquet`` indexed by the task string, per-episode
stats beside the episode boundaries), DROID's feature names, and the video as LeRobot's DROID port
encodes it (AV1 through SVT-AV1 at GOP 2 / CRF 30, yuv420p).

An episode is ``(columns, frames, row)``: :func:`droid_columns` builds the columns from states and
actions, ``frames`` maps each camera key to ``[T, H, W, 3]`` uint8, ``row`` holds ``episode_index``,
``tasks``, ``length`` and ``episode_id``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from slurmvla.data.checksums import write_checksums
from slurmvla.droid_features import DROID_CAMERAS

FPS = 15  # DROID's rate
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V2_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V2_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
FORMATS = ("v3.0", "v2.1")

CODECS = ("av1", "h264")
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


def encode_video(path: Path, frames: np.ndarray, codec: str = "av1", gop: int | None = None, fps: int = FPS) -> None:
    """``frames`` ``[T, H, W, 3]`` uint8 as one mp4 at ``fps`` (DROID's rate by default)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner per encoder otherwise; errors only
    name, options = ENCODERS[codec]
    with _scheduling_kept(), av.open(str(path), mode="w") as container:
        stream = container.add_stream(name, rate=Fraction(fps))
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        stream.options = {**options, "g": str(gop or DEFAULT_GOP[codec])}
        for i, img in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = i
            frame.time_base = Fraction(1, fps)
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


def _write_v3(tmp: Path, per_episode: list, tasks: list[str], episodes_per_file: int, video: tuple,
              layout: Layout) -> None:
    rows, fps = [], layout.fps
    for file_index in range(0, len(per_episode), episodes_per_file):
        group = per_episode[file_index : file_index + episodes_per_file]
        f = file_index // episodes_per_file
        cursor = 0
        for columns, _, row in group:
            n = row["length"]
            start = int(columns["index"][0])
            row = {**row, "data/chunk_index": 0, "data/file_index": f, "dataset_from_index": start,
                   "dataset_to_index": start + n, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0}
            for cam in layout.cameras:
                row.update({f"videos/{cam}/chunk_index": 0, f"videos/{cam}/file_index": f,
                            f"videos/{cam}/from_timestamp": cursor / fps, f"videos/{cam}/to_timestamp": (cursor + n) / fps})
            cursor += n
            # Per-episode stats, as LeRobot's writer keeps them beside the episode boundaries.
            for key in layout.episode_stats:
                row.update({f"stats/{key}/{name}": value for name, value in _stats(_as_2d(columns[key])).items()})
            rows.append(row)
        merged = {k: np.concatenate([c[k] for c, _, _ in group]) for k in group[0][0]}
        path = tmp / DATA_PATH.format(chunk_index=0, file_index=f)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(merged), path)
        for cam in layout.cameras:
            encode_video(tmp / VIDEO_PATH.format(video_key=cam, chunk_index=0, file_index=f),
                         np.concatenate([frames[cam] for _, frames, _ in group]), *video, fps=fps)
    meta = tmp / "meta"
    (meta / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), meta / "episodes" / "chunk-000" / "file-000.parquet")
    write_tasks(meta / "tasks.parquet", tasks)
    # Every float feature's stats, as LeRobot's writer keeps them: a policy may train on any sub-key
    # (e.g. action.joint_velocity, DROID's action space).
    first = per_episode[0][0]
    stats = {key: _stats(_as_2d(np.concatenate([c[key] for c, _, _ in per_episode])))
             for key in first if first[key].dtype.kind == "f" and key != "timestamp"}
    (meta / "stats.json").write_text(json.dumps(stats, indent=2))


def write_tasks(path: Path, tasks: list[str]) -> None:
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


def _write_v2(tmp: Path, per_episode: list, tasks: list[str], video: tuple, layout: Layout) -> None:
    meta = tmp / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    episode_lines, stats_lines = [], []
    for columns, frames, row in per_episode:
        e = row["episode_index"]
        path = tmp / V2_DATA_PATH.format(episode_chunk=0, episode_index=e)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(_table(columns), path)
        for cam in layout.cameras:
            encode_video(tmp / V2_VIDEO_PATH.format(episode_chunk=0, video_key=cam, episode_index=e), frames[cam], *video,
                         fps=layout.fps)
        episode_lines.append(json.dumps(row))
        # v2.1 per-episode stats carry no quantiles.
        ep_stats = {k: {s: v for s, v in _stats(_as_2d(columns[k])).items() if s not in ("q01", "q99")}
                    for k in layout.episode_stats}
        stats_lines.append(json.dumps({"episode_index": e, "stats": ep_stats}))
    (meta / "episodes.jsonl").write_text("\n".join(episode_lines) + "\n")
    (meta / "episodes_stats.jsonl").write_text("\n".join(stats_lines) + "\n")
    (meta / "tasks.jsonl").write_text("".join(json.dumps({"task_index": i, "task": t}) + "\n" for i, t in enumerate(tasks)))


def vec(n: int, names: list[str]) -> dict:
    """A float32 feature of ``n`` named values, as ``meta/info.json`` describes it."""
    return {"dtype": "float32", "shape": [n], "names": names}


@dataclass(frozen=True)
class Layout:
    """What a dataset holds besides its bookkeeping columns: its cameras (video features), its other features
    (``meta/info.json``'s entries; each episode's columns must match them), its rate, and the features whose
    per-episode statistics are kept. :func:`droid_layout` by default; an embodiment's recorder gives its own."""

    cameras: tuple[str, ...]
    features: dict
    fps: int = FPS
    episode_stats: tuple[str, ...] = ("observation.state", "action")


# Every dataset's bookkeeping features, after its own.
BOOKKEEPING = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}


def bookkeeping(n: int, episode_index: int, start_index: int, fps: int, task_index: int = 0) -> dict[str, np.ndarray]:
    """An episode's :data:`BOOKKEEPING` columns: ``n`` frames at ``fps``, the episode's global frames from
    ``start_index`` on."""
    return {"timestamp": (np.arange(n) / fps).astype(np.float32), "frame_index": np.arange(n, dtype=np.int64),
            "episode_index": np.full(n, episode_index, dtype=np.int64),
            "index": np.arange(start_index, start_index + n, dtype=np.int64),
            "task_index": np.full(n, task_index, dtype=np.int64)}


def droid_layout() -> Layout:
    """DROID's layout, as LeRobot's port of DROID 1.0.1 has it (:func:`droid_columns` writes its columns)."""
    joints = [f"joint_{i}" for i in range(7)]
    features = {}
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
    })
    return Layout(DROID_CAMERAS, features, FPS, EPISODE_STATS_KEYS)


def _info(format: str, num_episodes: int, num_frames: int, num_tasks: int, codec: str, height: int, width: int,
          robot_type: str, layout: Layout) -> dict:
    features = {
        cam: {
            "dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
            "info": {"video.fps": layout.fps, "video.height": height, "video.width": width, "video.channels": 3,
                     "video.codec": codec, "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "has_audio": False},
        }
        for cam in layout.cameras
    }
    features.update(layout.features)
    features.update(BOOKKEEPING)
    common = {"robot_type": robot_type, "fps": layout.fps, "total_episodes": num_episodes, "total_frames": num_frames,
              "total_tasks": num_tasks, "chunks_size": 1000, "splits": {"train": f"0:{num_episodes}"}}
    if format == "v2.1":
        return {"codebase_version": "v2.1", **common, "total_chunks": 1, "total_videos": len(layout.cameras) * num_episodes,
                "data_path": V2_DATA_PATH, "video_path": V2_VIDEO_PATH, "features": features}
    return {"codebase_version": "v3.0", **common, "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 500, "data_path": DATA_PATH, "video_path": VIDEO_PATH, "features": features}


def droid_columns(state: np.ndarray, action: np.ndarray, joint_velocity: np.ndarray, cartesian_state: np.ndarray,
                  cartesian_action: np.ndarray, instructions: list[str], success: bool, episode_index: int,
                  start_index: int, task_index: int) -> dict[str, np.ndarray]:
    """One episode's columns under DROID's names. ``state`` / ``action``: ``[T, 8]`` (7 joint positions
    and the gripper position: the observed one, and the commanded next one); ``joint_velocity``: the
    commanded ``[T, 7]`` (DROID's action space); ``cartesian_*``: ``[T, 6]``; three instructions."""
    n = len(state)
    columns = {
        "observation.state": state.astype(np.float32),
        "observation.state.joint_position": state[:, :7].astype(np.float32),
        "observation.state.gripper_position": state[:, 7:].astype(np.float32),
        "observation.state.cartesian_position": cartesian_state.astype(np.float32),
        "action": action.astype(np.float32),
        "action.joint_position": action[:, :7].astype(np.float32),
        "action.gripper_position": action[:, 7:].astype(np.float32),
        "action.joint_velocity": joint_velocity.astype(np.float32),
        "action.gripper_velocity": ((action[:, 7:] - state[:, 7:]) * FPS).astype(np.float32),
        "action.cartesian_position": cartesian_action.astype(np.float32),
        "action.cartesian_velocity": ((cartesian_action - cartesian_state) * FPS).astype(np.float32),
        **bookkeeping(n, episode_index, start_index, FPS, task_index),
        "is_episode_successful": np.full(n, bool(success)),
        # RLDS's step flags, as the DROID port keeps them (DROID's episodes end in a terminal step).
        "is_first": np.arange(n) == 0,
        "is_last": np.arange(n) == n - 1,
        "is_terminal": np.arange(n) == n - 1,
    }
    for k, key in enumerate(("language_instruction", "language_instruction_2", "language_instruction_3")):
        columns[key] = np.array([instructions[k]] * n, dtype=object)
    return columns


def check_layout(format: str, codec: str, gop: int | None) -> None:
    """A ValueError naming the value and the choices, before any episode is made."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not valid; choose one of {list(FORMATS)}")
    if codec not in CODECS:
        raise ValueError(f"codec={codec!r} is not valid; choose one of {list(CODECS)}")
    if gop is not None and gop < 1:
        raise ValueError(f"gop={gop} is not valid; it must be >= 1 (frames between keyframes)")


def out_folder_problem(out: Path, flag: str = "--out") -> str | None:
    """Why ``out`` cannot take a new dataset (one line naming it), or None: it must be new or an empty folder."""
    if (out / "meta" / "info.json").is_file():
        return f"{flag}={str(out)!r} already holds a dataset; give a new or empty folder"
    if out.exists() and not out.is_dir():
        return f"{flag}={str(out)!r} is a file; give a new or empty folder"
    if out.is_dir() and any(out.iterdir()):
        return f"{flag}={str(out)!r} is a folder that holds other files; give a new or empty folder"
    return None


def write_dataset(out: str | Path, per_episode: list, tasks: list[str], format: str = "v3.0", codec: str = "av1",
                  gop: int | None = None, episodes_per_file: int = 8, extra_files: dict[str, str] | None = None,
                  robot_type: str = "franka", layout: Layout | None = None) -> Path:
    """Write the episodes into ``out`` atomically (a temporary folder renamed at the end); ``extra_files``
    (name -> text) go beside ``meta/`` (e.g. DROID's keep-ranges file). ``layout``: the cameras and features
    (default DROID's, :func:`droid_layout`)."""
    layout = layout or droid_layout()
    check_layout(format, codec, gop)
    out = Path(out)
    if (out / "meta" / "info.json").is_file():
        raise FileExistsError(f"{out} already holds a dataset")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    video = (codec, gop)
    if format == "v3.0":
        _write_v3(tmp, per_episode, tasks, episodes_per_file, video, layout)
    else:
        _write_v2(tmp, per_episode, tasks, video, layout)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    height, width = next(iter(per_episode[0][1].values())).shape[1:3]
    num_frames = sum(row["length"] for _, _, row in per_episode)
    info = _info(format, len(per_episode), num_frames, len(tasks), codec, height, width, robot_type, layout)
    (tmp / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    write_checksums(tmp)  # last: every file as written, checked when read (slurmvla.data.checksums)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out
