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
import json
import sys
from pathlib import Path

import numpy as np

from slurmvla.cli import ArgumentParser, program
from slurmvla.data.keep_ranges import episode_key
from slurmvla.data.writer import (
    CODECS,
    FORMATS,
    FPS,
    check_layout,
    droid_columns,
    out_folder_problem,
    write_dataset,
)
from slurmvla.droid_features import DROID_CAMERAS

HEIGHT, WIDTH = 180, 320
OBJECTS = ["red cup", "blue block", "green marker", "yellow sponge", "black bowl", "white towel"]
PLACES = ["the drawer", "the shelf", "the sink", "the left bin", "the right bin", "the tray"]
LABS = ["AUTOLab", "ILIAD", "IRIS", "RAIL", "PennPAL", "REAL"]


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


CONTENTS = ("flat", "camera")


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
    check_layout(format, codec, gop)
    out = Path(out)
    if (out / "meta" / "info.json").is_file():
        raise FileExistsError(f"{out} already holds a dataset")
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
        columns = droid_columns(ep["state"], ep["action"], (ep["action"][:, :7] - ep["state"][:, :7]) * FPS, cart_state,
                                cart_action, instructions, success, episode_index=e, start_index=global_index,
                                task_index=tasks.index(instructions[0]))
        noise = np.random.default_rng([seed, e]) if content == "camera" else None
        frames = {cam: _render(ep["state"], ep["goal_id"], c, noise) for c, cam in enumerate(DROID_CAMERAS)}
        row = {"episode_index": e, "tasks": [instructions[0]], "length": n, "episode_id": episode_id}
        per_episode.append((columns, frames, row))
        global_index += n

    keep = {}
    for e, n in enumerate(lengths):
        if e % 5 == 4:
            continue
        keep[episode_key(rel_paths[_episode_id(e)])] = [[1, n - 1]] if n > 12 else [[0, n]]
    extra = {"keep_ranges_1_0_1.json": json.dumps(keep, indent=1), "episode_id_to_path.json": json.dumps(rel_paths, indent=1)}
    return write_dataset(out, per_episode, tasks, format=format, codec=codec, gop=gop,
                         episodes_per_file=episodes_per_file, extra_files=extra)


def _episode_id(e: int) -> str:
    return f"{LABS[e % len(LABS)]}+{(e * 2654435761) % 16**8:08x}+2023-10-{1 + e % 28:02d}-{e % 24:02d}h-{e % 60:02d}m-{(7 * e) % 60:02d}s"


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
    parser = ArgumentParser(prog=program("slurmvla.data.synthetic"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    else:
        problem = out_folder_problem(out)
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

