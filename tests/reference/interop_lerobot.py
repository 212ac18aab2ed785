"""Datasets move both ways between slurmvla and LeRobot 0.6.1, with the same values on each side.

    bash tests/reference/make_env.sh                 # once: LeRobot 0.6.1 in ../lerobot061
    python tests/reference/interop_lerobot.py [--lerobot-python ../lerobot061/bin/python] [--keep DIR]

Runs with slurmvla's own Python; LeRobot's half (tests/reference/lerobot_interop_side.py) runs in the
LeRobot virtualenv, in its own process. Checked, for frames at the start, middle and end of every
episode (where the action chunk runs past the end):

1. slurmvla -> LeRobot: datasets written by slurmvla's writer (v3.0, AV1 as DROID's port and H.264;
   several episodes per file) open in LeRobot's ``LeRobotDataset``, and every float and bool feature,
   the string features, the task string, the 16-step action chunk with its padding mask and each
   camera's decoded frame equal what slurmvla reads and samples for the same frame.
2. LeRobot -> slurmvla: a dataset recorded by LeRobot's own writer (``create``, ``add_frame``,
   ``save_episode``, video, no instruction columns so the task table gives the instruction) reads in
   slurmvla with the same values.
3. A Meta-World MT50 recording (``python -m slurmvla.sim.record --env mt50``: several tasks in one dataset, each
   episode under its instruction, lerobot/metaworld_mt50's features) opens in LeRobot with the same values, task
   strings and frames.

Numbers and strings must be equal exactly; frames to the codec's tolerance (both sides decode the same
stream; only the YUV -> RGB conversions of the two decoders' libraries may differ). Exits non-zero on a
mismatch, naming the dataset, frame and feature. Not part of the suite: it needs the LeRobot virtualenv.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from slurmvla.compose import compose
from slurmvla.data.lerobot_format import LeRobotMetadata
from slurmvla.data.source import LeRobotSource, dataset_specs
from slurmvla.data.spec import SampleSpec
from slurmvla.data.synthetic import write_droid_sample

HERE = Path(__file__).resolve().parent
SIDE = HERE / "lerobot_interop_side.py"
HORIZON = 16
# Decoded frames, uint8: both sides decode the same AV1 / H.264 stream (AV1 decoding is bit-exact by the
# standard); the YUV 4:2:0 -> RGB conversion differs between libswscale builds by a level or two.
FRAME_MEAN_ABS, FRAME_MAX_ABS = 1.0, 12


def frames_to_check(meta: LeRobotMetadata) -> list[tuple[int, int]]:
    out = []
    for pos, n in enumerate(meta.episodes["length"]):
        out += [(pos, t) for t in sorted({0, int(n) // 2, max(0, int(n) - 4), int(n) - 1})]
    return out


def lerobot_view(python: str, root: Path, frames: list[tuple[int, int]], out: Path) -> tuple[dict, dict]:
    subprocess.run([python, str(SIDE), "read", str(root), str(HORIZON), str(out), *(f"{e}:{t}" for e, t in frames)],
                   check=True)
    arrays = dict(np.load(out))
    return arrays, json.loads(out.with_suffix(".json").read_text())


def slurmvla_source(root: Path, state_keys: list[str], action_keys: list[str], instruction_keys: list[str],
                    cameras: list[str]) -> LeRobotSource:
    cfg = compose([f"data.root={root}", f"data.cameras=[{','.join(cameras)}]", f"data.state_keys=[{','.join(state_keys)}]",
                   f"data.action_keys=[{','.join(action_keys)}]", f"data.instruction_keys=[{','.join(instruction_keys)}]",
                   "data.num_workers=0"]).data
    return LeRobotSource(dataset_specs(cfg)[0], cfg, SampleSpec(image_size=None, action_horizon=HORIZON), seed=0)


class Check:
    def __init__(self, dataset: str):
        self.dataset, self.failures, self.count = dataset, [], 0
        self.frame_err: list[tuple[float, int]] = []

    def equal(self, where: str, ours, theirs) -> None:
        self.count += 1
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        if ours.shape != theirs.shape or not np.array_equal(ours, theirs):
            self.failures.append(f"{self.dataset} {where}: slurmvla {ours.tolist()!r:.200} != LeRobot {theirs.tolist()!r:.200}")

    def frame(self, where: str, ours: np.ndarray, theirs: np.ndarray) -> None:
        self.count += 1
        if ours.shape != theirs.shape:
            self.failures.append(f"{self.dataset} {where}: frame shape {ours.shape} != LeRobot's {theirs.shape}")
            return
        diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
        self.frame_err.append((float(diff.mean()), int(diff.max())))
        if diff.mean() > FRAME_MEAN_ABS or diff.max() > FRAME_MAX_ABS:
            self.failures.append(f"{self.dataset} {where}: frame differs from LeRobot's by mean {diff.mean():.3f}, "
                                 f"max {diff.max()} (tolerance {FRAME_MEAN_ABS}, {FRAME_MAX_ABS})")

    def summary(self) -> str:
        mean = max((m for m, _ in self.frame_err), default=0.0)
        worst = max((x for _, x in self.frame_err), default=0)
        return (f"{self.dataset}: {self.count} values compared, {len(self.failures)} differ; frames: worst mean abs "
                f"{mean:.3f}, worst max abs {worst} (uint8 levels)")


def compare(name: str, root: Path, python: str, work: Path, state_keys: list[str], action_keys: list[str],
            instruction_keys: list[str]) -> tuple[Check, dict]:
    meta = LeRobotMetadata(root)
    frames = frames_to_check(meta)
    theirs, info = lerobot_view(python, root, frames, work / f"{name}.npz")
    cameras = [k for k, f in meta.features.items() if f["dtype"] == "video"]
    src = slurmvla_source(root, state_keys, action_keys, instruction_keys, cameras)
    check = Check(name)
    scalar_keys = [k for k, f in meta.features.items() if f["dtype"] in ("float32", "float64", "int16", "int64", "bool")]
    string_keys = [k for k, f in meta.features.items() if f["dtype"] == "string"]
    chunked = [k for k in meta.features if k == "action" or k.startswith("action.")]
    for pos in sorted({e for e, _ in frames}):
        cols = meta.read_episode(pos, [*scalar_keys, *string_keys])
        episode = src.load_episode(pos)
        length = int(meta.episodes["length"][pos])
        for e, t in [f for f in frames if f[0] == pos]:
            at = f"episode {e} frame {t}"
            lr = {k.split("/", 1)[1]: v for k, v in theirs.items() if k.startswith(f"{e}:{t}/")}
            strings = {k.split("/", 1)[1]: v for k, v in info["strings"].items() if k.startswith(f"{e}:{t}/")}
            for key in scalar_keys:
                ours = cols[key].reshape(length, -1)[t]
                # LeRobot returns the chunk of an action feature (delta_timestamps); its first step is frame t.
                value = lr[key][0] if key in chunked else lr[key]
                check.equal(f"{at} {key}", ours.reshape(np.shape(value)), value)
            for key in string_keys:
                check.equal(f"{at} {key}", str(cols[key].reshape(-1)[t]), strings[key])
            # The task string: slurmvla's task table against LeRobot's.
            check.equal(f"{at} task", meta.tasks[int(cols["task_index"].reshape(-1)[t])], strings["task"])
            sample = src.sample(episode, t, epoch=0)
            # The action chunk and its padding past the episode's end.
            chunk = np.concatenate([lr[k].reshape(HORIZON, -1) for k in action_keys], axis=1)
            check.equal(f"{at} action chunk", sample["actions"].numpy(), chunk)
            for k in action_keys:
                check.equal(f"{at} {k} padding", ~sample["action_mask"].numpy(), lr[f"{k}_is_pad"])
            state = np.concatenate([lr[k].reshape(-1) for k in state_keys])
            check.equal(f"{at} state", sample["state"].numpy(), state)
            if not instruction_keys:
                check.equal(f"{at} instruction (the task)", sample["instruction"], strings["task"])
            for c, cam in enumerate(cameras):
                check.frame(f"{at} {cam}", sample["images"][c].numpy(), lr[cam])
    return check, info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lerobot-python", default=str(HERE.parents[2] / "lerobot061" / "bin" / "python"),
                        help="the LeRobot 0.6.1 virtualenv's python (default: ../lerobot061, as make_env.sh builds it)")
    parser.add_argument("--keep", default=None, help="write the datasets here and keep them (default: a temporary folder)")
    args = parser.parse_args()
    if not Path(args.lerobot_python).is_file():
        raise SystemExit(f"error: --lerobot-python={args.lerobot_python!r} does not exist; build it with "
                         "bash tests/reference/make_env.sh")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="interop-"))
    work.mkdir(parents=True, exist_ok=True)
    droid_state = ["observation.state.joint_position", "observation.state.gripper_position"]
    droid_action = ["action.joint_velocity", "action.gripper_position"]
    instructions = ["language_instruction", "language_instruction_2", "language_instruction_3"]
    checks = []
    for name, codec in (("slurmvla_v30_av1", "av1"), ("slurmvla_v30_h264", "h264")):
        root = write_droid_sample(work / name, num_episodes=5, seed=3, episodes_per_file=2, codec=codec)
        checks.append(compare(name, root, args.lerobot_python, work, droid_state, droid_action, instructions))
    written = work / "lerobot_written"
    subprocess.run([args.lerobot_python, str(SIDE), "write", str(written)], check=True)
    checks.append(compare("lerobot_written", written, args.lerobot_python, work, droid_state,
                          ["action"], []))
    from slurmvla.sim.record import record

    mt50 = work / "slurmvla_mt50"
    record(mt50, "mt50", "reach-v3,push-v3,push-back-v3", episodes=2, height=64, width=64)
    checks.append(compare("slurmvla_mt50", mt50, args.lerobot_python, work, ["observation.state"], ["action"], []))
    print(f"LeRobot side: {checks[0][1]['versions']}, video backend {checks[0][1]['video_backend']}")
    failures = []
    for check, _ in checks:
        print(check.summary())
        failures += check.failures
    for f in failures[:40]:
        print("MISMATCH", f)
    if failures:
        sys.exit(1)
    print("interop ok: LeRobot and slurmvla read the same values from each dataset")


if __name__ == "__main__":
    main()
