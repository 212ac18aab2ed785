"""Record a simulator's scripted demonstrations as a LeRobot v3.0 dataset: one recorder for every simulator
(``--env``: a folder of ``slurmvla/sim/`` or a plug-in's, :data:`slurmvla.registry.SIMULATORS`), driving its
environment and its expert the same way and writing through the project's writer (:mod:`slurmvla.data.writer`).

    python -m slurmvla.sim.record --out DIR [--episodes 100] [--first-seed 0] [--height 180 --width 320]
    python -m slurmvla.sim.record --task two_cubes --out DIR      # the pick task with a red and a blue cube
    python -m slurmvla.sim.record --env metaworld --task assembly-v3 --out DIR [--episodes 10] [--noise 0.1]
    python -m slurmvla.sim.record --env mt50 --out DIR [--task easy] [--episodes 10] [--height 128 --width 128]

``--env mt50`` records every task ``--task`` names (null: Meta-World's fifty, in LeRobot's regime) into one dataset,
``--episodes`` each, each episode under its task's instruction, in ``lerobot/metaworld_mt50``'s layout.

Episode ``e`` is tried from the environment's seed ``first_seed + e`` on; the simulator decides which episodes it
keeps (the pick task: every one; Meta-World: those where the task succeeded on at least 5 steps, 3D Diffusion
Policy's rule) and what it writes beside the data (a summary listing every seed tried). ``--noise``: the executed
action perturbed (each simulator says which dimensions, in its own units), the expert's command recorded, so the
demonstrations show the expert correcting the drift a learned policy makes (DART, Laskey et al. 2017). The
evaluation's seeds (``rollout.first_seed``, 100000 by default) are none of them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from slurmvla.cli import ArgumentParser, program
from slurmvla.data.writer import out_folder_problem, write_dataset
from slurmvla.registry import SIMULATORS, SimulatorEntry
from slurmvla.sim.base import Demonstrations, Environment, Recording


def episode(demos: Demonstrations, env: Environment, seed: int, steps: int | None = None, render: bool = True,
            noise: float = 0.0) -> dict[str, Any]:
    """One seeded episode of the simulator's expert, at most ``steps`` control steps (default the
    demonstrations' own): what each step observed, the expert's commands, the outcomes, as ``demos.episode``
    arranges them. ``noise``: the standard deviation of the perturbation of the executed action (``demos.perturb``),
    drawn from a generator seeded by the episode (salted: a simulator that seeds its own generator with the bare
    seed must not see its stream replayed)."""
    expert = demos.expert(env)
    rng = np.random.default_rng([7, seed])
    env.reset(seed)
    observed, actions, outcomes = [], [], []
    for _ in range(demos.steps if steps is None else steps):
        observed.append(demos.observe(env, render))
        action = expert.act(env)
        actions.append(action)
        outcomes.append(env.step(demos.perturb(action, rng, noise) if noise else action))
        if demos.done(outcomes):
            break
    return demos.episode(env, observed, actions, outcomes, seed)


def record(out: str | Path, env: str = "pick", task: str | None = None, episodes: int = 100, first_seed: int = 0,
           height: int = 180, width: int = 320, noise: float = 0.0, max_tries: int | None = None,
           **options: Any) -> dict[str, Any]:
    """``episodes`` demonstrations of simulator ``env`` (task ``task``) into ``out``, from seeds ``first_seed``,
    ``first_seed + 1``, ...: each kept or skipped as the simulator says, at most ``max_tries`` seeds tried (default
    the simulator's). ``options``: the simulator's own (Meta-World's ``steps``, an episode's length). Returns the
    summary written beside the data."""
    recording: Recording = SIMULATORS.get(env).load_demonstrations()(task, height, width, **options)
    per_episode, tried, kept = [], [], []
    start = 0
    for demos in recording.parts():
        environment = demos.environment()
        tries = demos.max_tries(episodes) if max_tries is None else max_tries
        mine, seed, done = 0, first_seed, 0
        try:
            while done < episodes and mine < tries:
                ep = episode(demos, environment, seed, noise=noise)
                ok = demos.keep(ep)
                tried.append((ep, ok))
                mine += 1
                if ok:
                    per_episode.append(demos.columns(ep, len(per_episode), start))
                    kept.append(ep)
                    start += len(ep["action"])
                    done += 1
                seed += 1
        finally:
            environment.close()
        if done < episodes:
            where = f" {demos.task}" if demos.task else ""
            raise ValueError(f"the scripted expert of {env}{where} succeeded on {done} of {mine} seeds from "
                             f"{first_seed}; {episodes} demonstrations were asked for")
    summary = recording.summary(tried, noise, start)
    write_dataset(out, per_episode, recording.tasks(), episodes_per_file=recording.episodes_per_file,
                  extra_files=recording.files(summary, kept), robot_type=recording.robot_type, layout=recording.layout())
    return summary


def _problem(args: argparse.Namespace, entry: SimulatorEntry | None) -> str | None:
    if entry is None:
        return f"--env={args.env!r} is not valid; choose one of {list(SIMULATORS)}"
    if (problem := entry.task_problem(args.task, env_key=f"--env {args.env}", task_key="--task")) is not None:
        return problem
    if entry.suite:
        try:
            entry.tasks_of(args.task, "--task")
        except ValueError as e:
            return str(e)
    if args.episodes < 1:
        return f"--episodes={args.episodes} must be >= 1"
    if args.noise < 0:
        return f"--noise={args.noise} must be >= 0"
    if min(args.height, args.width) < 16 or args.height % 2 or args.width % 2:
        return f"--height={args.height} --width={args.width}: each must be an even number >= 16 (the video is yuv420p)"
    return out_folder_problem(Path(args.out).expanduser())


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.sim.record"), description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder (must not hold a dataset yet)")
    parser.add_argument("--env", default="pick", help=f"the simulator, one of {list(SIMULATORS)} (default pick)")
    parser.add_argument("--task", help="the simulator's task: for Meta-World one of its v3 tasks (e.g. assembly-v3); "
                                       "for mt50 a group (easy, medium, hard, very_hard) or tasks, comma-separated, or "
                                       "none (all fifty); for the pick task two_cubes, or none (one cube)")
    parser.add_argument("--episodes", type=int, default=None, help="demonstrations (default: the simulator's; pick 100, "
                                                                    "Meta-World 10)")
    parser.add_argument("--first-seed", type=int, default=0, help="episode e is tried from the environment's seed "
                                                                  "first_seed + e on")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="std of Gaussian noise added to the executed action, the expert's command being what is "
                             "recorded (default 0): the pick task's joint velocities (rad/s); Meta-World's end-effector "
                             "displacement (its [-1, 1] units)")
    parser.add_argument("--height", type=int, default=None, help="camera frames' height (default: the simulator's; "
                                                                 "pick 180, Meta-World 128)")
    parser.add_argument("--width", type=int, default=None, help="camera frames' width (default: the simulator's; "
                                                                "pick 320, Meta-World 128)")
    args = parser.parse_args(argv)
    entry = SIMULATORS.get(args.env) if args.env in SIMULATORS else None
    if entry is not None:
        args.episodes = entry.demo_episodes if args.episodes is None else args.episodes
        args.height = entry.demo_height if args.height is None else args.height
        args.width = entry.demo_width if args.width is None else args.width
    problem = _problem(args, entry)
    if problem is None:
        out = Path(args.out).expanduser()
        try:
            summary = record(out, args.env, args.task, args.episodes, args.first_seed, args.height, args.width,
                             noise=args.noise)
        except OSError as e:
            problem = f"cannot write the dataset to --out={args.out!r}: {e.strerror or e}"
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    each = f" of each of {len(entry.tasks_of(args.task, '--task'))} tasks" if entry.suite else ""
    print(f"wrote {args.episodes} expert episodes{each} ({summary['frames']} frames) to {out}; expert success rate "
          f"{summary['expert_success_rate']:.2f}")


if __name__ == "__main__":
    main()
