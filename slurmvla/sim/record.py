"""Record a scripted expert's demonstrations as a LeRobot v3.0 dataset, through the project's writer
(:mod:`slurmvla.data.writer`): the simulated pick task's in DROID's layout, or a Meta-World task's.

    python -m slurmvla.sim.record --out DIR [--episodes 100] [--first-seed 0] [--height 180 --width 320]
    python -m slurmvla.sim.record --task two_cubes --out DIR      # the pick task with a red and a blue cube
    python -m slurmvla.sim.record --env metaworld --task assembly-v3 --out DIR [--episodes 10] [--first-seed 0] [--noise 0.1]

Meta-World (:func:`slurmvla.sim.metaworld.record`): 200-step episodes at 128 x 128 from the ``corner2`` camera,
only those where the task succeeded on at least 5 steps (3D Diffusion Policy's rule), seeds tried from
``--first-seed`` on; beside the data ``metaworld.json`` lists every seed tried. The evaluation's seeds
(``rollout.first_seed``, 100000 by default) are none of them. ``--noise``: the executed end-effector displacement
perturbed, the expert's command for the reached state recorded (:func:`slurmvla.sim.metaworld.expert_episode`).

The pick task:

Episode ``e`` is the environment's seed ``first_seed + e``. Per step: the observed joint and gripper
positions (``observation.state``), DROID's action keys (``action.joint_velocity``: the commanded joint
velocities, DROID's action space; ``action.gripper_position``: the commanded gripper, 1 = closed;
``action``: the next joint positions and the commanded gripper, as DROID stores it), the gripper's
Cartesian pose, three instructions and the three cameras as AV1 video. Beside it: DROID's keep-ranges
file (every step kept: the expert never idles) and ``sim.json`` (the task, the seeds, the success
of each episode), so every data path the project has applies unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from slurmvla.cli import ArgumentParser, program
from slurmvla.config.rollout import PICK_TASKS, SIM_ENVS
from slurmvla.data.keep_ranges import episode_key
from slurmvla.data.writer import droid_columns, out_folder_problem, write_dataset
from slurmvla.droid_features import DROID_CAMERAS

# Steps recorded after the cube first counts as lifted: the demonstrations go on lifting, so a chunk
# predicted near the goal still lifts.
HOLD_STEPS = 6
MAX_STEPS = 120
INSTRUCTIONS = ("pick up the red cube", "lift the red cube off the table", "grasp the cube and lift it")
TWO_CUBES_INSTRUCTIONS = ("pick up the red cube or the blue cube", "lift a cube off the table", "grasp either cube and lift it")


def _cartesian(env) -> np.ndarray:  # noqa: ANN001 - a PickCube
    import mujoco

    quat = np.empty(4)
    mujoco.mju_mat2Quat(quat, env.data.xmat[env._hand])
    w, x, y, z = quat
    roll = np.arctan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y))
    pitch = np.arcsin(np.clip(2 * (w * y - z * x), -1, 1))
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return np.array([*env.tcp_position(), roll, pitch, yaw])


def expert_episode(env, seed: int, render: bool = True, noise: float = 0.0) -> dict:  # noqa: ANN001 - a PickCube
    """One seeded episode of the expert: per-step arrays, frames per camera and whether it succeeded.

    ``noise`` (rad/s): Gaussian noise added to the expert's joint velocities when they are executed
    (seeded by the episode), so the demonstrations visit states off the expert's path and show its
    corrections (DART, Laskey et al. 2017). What is recorded is the expert's command, not the noise: a
    policy that models the action distribution (flow matching) would otherwise learn to add the noise."""
    from slurmvla.sim.expert import Expert

    env.reset(seed)
    expert = Expert()
    rng = np.random.default_rng([7, seed])
    states, actions, cartesian, frames = [], [], [], {cam: [] for cam in env.cameras}
    success_at = None
    for t in range(MAX_STEPS):
        states.append([*env.joint_position(), env.gripper_position()])
        cartesian.append(_cartesian(env))
        if render:
            for cam in env.cameras:
                frames[cam].append(env.render(cam))
        action = expert.act(env)
        actions.append(action)
        executed = action.copy()
        if noise:
            executed[:7] += rng.normal(0.0, noise, size=7).astype(np.float32)
        step = env.step(executed)
        if step.success and success_at is None:
            success_at = t
        if success_at is not None and t >= success_at + HOLD_STEPS:
            break
    states, actions = np.asarray(states, np.float32), np.asarray(actions, np.float32)
    next_joints = np.concatenate([states[1:, :7], env.joint_position()[None].astype(np.float32)])
    cartesian = np.asarray(cartesian)
    next_cartesian = np.concatenate([cartesian[1:], _cartesian(env)[None]])
    return {"state": states, "joint_velocity": actions[:, :7],
            "action": np.concatenate([next_joints, actions[:, 7:]], axis=1),
            "cartesian_state": cartesian, "cartesian_action": next_cartesian,
            "frames": {cam: np.stack(f) for cam, f in frames.items()} if render else None,
            "success": success_at is not None, "seed": seed}


def record(out: str | Path, episodes: int, first_seed: int = 0, height: int = 180, width: int = 320,
           episodes_per_file: int = 25, noise: float = 0.0, cubes: int = 1) -> dict:
    """Write ``episodes`` expert demonstrations into ``out`` (of the task with ``cubes`` cubes); returns the
    ``sim.json`` summary."""
    from slurmvla.sim.env import PickCube

    env = PickCube(height=height, width=width, cameras=tuple(c.removeprefix("observation.images.") for c in DROID_CAMERAS),
                   cubes=cubes)
    instructions = INSTRUCTIONS if cubes == 1 else TWO_CUBES_INSTRUCTIONS
    per_episode, keep, seeds, successes, targets = [], {}, [], [], []
    start = 0
    try:
        for e in range(episodes):
            ep = expert_episode(env, first_seed + e, noise=noise)
            n = len(ep["state"])
            columns = droid_columns(ep["state"], ep["action"], ep["joint_velocity"], ep["cartesian_state"],
                                    ep["cartesian_action"], list(instructions), ep["success"], episode_index=e,
                                    start_index=start, task_index=0)
            frames = {f"observation.images.{cam}": f for cam, f in ep["frames"].items()}
            episode_id = f"SIM+{first_seed + e:08d}+2026-11-25-00h-00m-00s"
            per_episode.append((columns, frames, {"episode_index": e, "tasks": [instructions[0]], "length": n,
                                                  "episode_id": episode_id}))
            keep[episode_key(_rel_path(first_seed + e, ep["success"]))] = [[0, n]]
            seeds.append(first_seed + e)
            successes.append(ep["success"])
            targets.append(env.target)
            start += n
    finally:
        env.close()
    summary = {"task": "pick_cube" if cubes == 1 else "two_cubes", "instruction": instructions[0], "action_noise": noise,
               "seeds": seeds, "success": successes, "expert_success_rate": float(np.mean(successes)), "frames": start}
    if cubes > 1:  # the cube each demonstration went for (0: the red one, y > 0; 1: the blue one, its mirror image)
        summary["target"] = targets
    extra = {"keep_ranges_1_0_1.json": json.dumps(keep, indent=1), "sim.json": json.dumps(summary, indent=1),
             "episode_id_to_path.json": json.dumps({f"SIM+{s:08d}+2026-11-25-00h-00m-00s": _rel_path(s, ok)
                                                    for s, ok in zip(seeds, successes)}, indent=1)}
    write_dataset(out, per_episode, [instructions[0]], episodes_per_file=episodes_per_file, extra_files=extra,
                  robot_type="sim_franka")
    return summary


def _rel_path(seed: int, success: bool) -> str:
    return f"SIM/{'success' if success else 'failure'}/2026-11-25/seed{seed:08d}"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.sim.record"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (must not hold a dataset yet)")
    parser.add_argument("--env", default="pick", help="pick (default) or metaworld")
    parser.add_argument("--task", help="the Meta-World task, e.g. assembly-v3 (--env metaworld); for the pick task "
                                       f"one of {list(PICK_TASKS)} (default: one cube)")
    parser.add_argument("--episodes", type=int, default=None, help="demonstrations (default 100; Meta-World: 10)")
    parser.add_argument("--first-seed", type=int, default=0, help="episode e is the environment's seed first_seed + e")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="std of Gaussian noise added to the executed action, the expert's command being what is "
                             "recorded (default 0): the pick task's joint velocities (rad/s); Meta-World's end-effector "
                             "displacement (its [-1, 1] units)")
    parser.add_argument("--height", type=int, default=None, help="camera frames' height (default 180; Meta-World: 128)")
    parser.add_argument("--width", type=int, default=None, help="camera frames' width (default 320; Meta-World: 128)")
    args = parser.parse_args(argv)
    metaworld = args.env == "metaworld"
    args.episodes = args.episodes if args.episodes is not None else (10 if metaworld else 100)
    args.height = args.height if args.height is not None else (128 if metaworld else 180)
    args.width = args.width if args.width is not None else (128 if metaworld else 320)
    out = Path(args.out).expanduser()
    problem = None
    if args.env not in SIM_ENVS:
        problem = f"--env={args.env!r} is not valid; choose one of {list(SIM_ENVS)}"
    elif metaworld and not args.task:
        problem = "--env metaworld needs --task (a Meta-World v3 task, e.g. --task assembly-v3)"
    elif not metaworld and args.task and args.task not in PICK_TASKS:
        problem = (f"--task={args.task!r} is not a variant of the pick task; choose one of {list(PICK_TASKS)} or none "
                   "(one cube), or use --env metaworld")
    elif args.episodes < 1:
        problem = f"--episodes={args.episodes} must be >= 1"
    elif args.noise < 0:
        problem = f"--noise={args.noise} must be >= 0"
    elif min(args.height, args.width) < 16 or args.height % 2 or args.width % 2:
        problem = f"--height={args.height} --width={args.width}: each must be an even number >= 16 (the video is yuv420p)"
    else:
        problem = out_folder_problem(out)
    if problem is None:
        try:
            if metaworld:
                from slurmvla.sim.metaworld import check_task
                from slurmvla.sim.metaworld import record as record_metaworld

                check_task(args.task, "--task")
                summary = record_metaworld(out, args.task, args.episodes, args.first_seed, args.height, args.width,
                                           noise=args.noise)
            else:
                summary = record(out, args.episodes, args.first_seed, args.height, args.width, noise=args.noise,
                                 cubes=PICK_TASKS.get(args.task, 1))
        except OSError as e:
            problem = f"cannot write the dataset to --out={args.out!r}: {e.strerror or e}"
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.episodes} expert episodes ({summary['frames']} frames) to {out}; expert success rate "
          f"{summary['expert_success_rate']:.2f}")


if __name__ == "__main__":
    main()
