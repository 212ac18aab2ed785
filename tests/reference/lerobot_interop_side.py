"""LeRobot's half of tests/reference/interop_lerobot.py; runs in the LeRobot 0.6.1 virtualenv only.

    python lerobot_interop_side.py read ROOT HORIZON OUT.npz EPISODE:FRAME ...
        LeRobot opens ROOT (LeRobotDataset, its default video backend) and saves, per requested frame:
        every float / bool feature, the chunk of HORIZON steps (delta_timestamps) of every action feature
        with its padding mask, the task string, the string features and each camera's decoded frame (uint8, H x W x 3).
    python lerobot_interop_side.py write ROOT
        LeRobot's own writer (LeRobotDataset.create, add_frame, save_episode, finalize) records a small
        DROID-shaped dataset with video; the frames it was given go to ROOT/../written_frames.npz.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

import numpy as np
import torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset

CAMERAS = ("observation.images.exterior_1_left", "observation.images.exterior_2_left", "observation.images.wrist_left")
FPS = 15


def versions() -> dict:
    return {k: md.version(k) for k in ("lerobot", "torch", "datasets", "av", "torchcodec")}


def read(root: str, horizon: int, out: str, wanted: list[str]) -> None:
    probe = LeRobotDataset("local/interop", root=root)
    chunked = [k for k in probe.meta.features if k == "action" or k.startswith("action.")]
    ds = LeRobotDataset("local/interop", root=root,
                        delta_timestamps={k: [i / probe.meta.fps for i in range(horizon)] for k in chunked})
    starts = np.asarray(ds.meta.episodes["dataset_from_index"])
    saved: dict[str, np.ndarray] = {}
    strings: dict[str, str] = {}
    for spec in wanted:
        e, t = (int(x) for x in spec.split(":"))
        item = ds[int(starts[e]) + t]
        assert int(item["episode_index"]) == e and int(item["frame_index"]) == t, (spec, item["episode_index"])
        for key, value in item.items():
            name = f"{e}:{t}/{key}"
            if isinstance(value, str):
                strings[name] = value
            elif key in ds.meta.video_keys:
                # float [3, H, W] in [0, 1] from LeRobot's decoder, back to the uint8 it decoded
                saved[name] = (value.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
            elif isinstance(value, torch.Tensor):
                saved[name] = value.numpy()
    np.savez(out, **saved)
    Path(out).with_suffix(".json").write_text(json.dumps({"strings": strings, "versions": versions(),
                                                          "video_backend": ds._video_backend}))


def _frames(rng: np.random.Generator, n: int, cam: int) -> np.ndarray:
    """Frames that decode like camera footage: a textured background that drifts, a moving object, noise."""
    h, w = 180, 320
    yy, xx = np.mgrid[0:h, 0:w]
    texture = (np.sin(xx / (5.0 + cam)) * np.cos(yy / 7.0) * 60 + 120).astype(np.float32)
    out = np.empty((n, h, w, 3), dtype=np.uint8)
    for i in range(n):
        img = np.stack([np.roll(texture, 2 * i + cam, axis=1), np.roll(texture, i, axis=0), texture[::-1]], axis=-1)
        cx, cy = 40 + 6 * i % (w - 80), 50 + 3 * i % (h - 100)
        img[cy:cy + 40, cx:cx + 40] = (200, 60 + 20 * cam, 40)
        img += rng.normal(0, 6, img.shape).astype(np.float32)
        out[i] = np.clip(img, 0, 255).astype(np.uint8)
    return out


def write(root: str) -> None:
    vec = lambda n: {"dtype": "float32", "shape": (n,), "names": None}  # noqa: E731
    features = {cam: {"dtype": "video", "shape": (180, 320, 3), "names": ["height", "width", "channels"]} for cam in CAMERAS}
    features.update({"observation.state": vec(8), "observation.state.joint_position": vec(7),
                     "observation.state.gripper_position": vec(1), "action": vec(8),
                     "action.gripper_position": vec(1), "is_first": {"dtype": "bool", "shape": (1,), "names": None}})
    ds = LeRobotDataset.create("local/interop_written", fps=FPS, features=features, root=root, robot_type="franka",
                               use_videos=True)
    rng = np.random.default_rng(0)
    given = {}
    tasks = ["put the cup in the sink", "open the drawer", "put the cup in the sink"]
    for e, n in enumerate((23, 9, 31)):
        frames = {cam: _frames(rng, n, c) for c, cam in enumerate(CAMERAS)}
        state = rng.normal(size=(n, 8)).astype(np.float32)
        action = rng.normal(size=(n, 8)).astype(np.float32)
        for i in range(n):
            ds.add_frame({**{cam: frames[cam][i] for cam in CAMERAS}, "observation.state": state[i],
                          "observation.state.joint_position": state[i, :7],
                          "observation.state.gripper_position": state[i, 7:], "action": action[i],
                          "action.gripper_position": action[i, 7:], "is_first": np.array([i == 0]), "task": tasks[e]})
        ds.save_episode()
        given.update({f"{e}/{cam}": frames[cam] for cam in CAMERAS})
        given.update({f"{e}/observation.state": state, f"{e}/action": action})
    ds.finalize()
    np.savez(Path(root).parent / "written_frames.npz", **given)


if __name__ == "__main__":
    if sys.argv[1] == "read":
        read(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:])
    elif sys.argv[1] == "write":
        write(sys.argv[2])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}; choose read or write")
