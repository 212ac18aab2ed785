"""Where a Meta-World policy parts from the scripted expert, on one seed (docs/benchmarks.md#meta-world).

    python benchmarks/metaworld_follow.py RUN --seed 1                  # closed loop beside the expert's episode
    python benchmarks/metaworld_follow.py RUN --seed 1 --open --draws 4 # open loop along the expert's own path

Closed loop: the policy drives the arm in-process through the rollout's own executor (the run's
``rollout.execution``, ``replan_steps`` and delay) while the expert's episode of the same seed is replayed beside
it; every ``--every`` steps the line shows the hand and the first object for both, and both commands. Open loop: at every ``--every``-th
step of the expert's own episode, the policy's first action for the expert's observation, under ``--draws``
different noise seeds (``serve.seed``). ``--frames decoded``: the observations' images are those of the recorded
dataset (``RUN``'s ``data.root``, the seed's episode decoded from its video) instead of fresh renders.
A plug-in policy is found as the run found it (``PYTHONPATH=benchmarks`` for the benchmarks' own).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import slurmvla.sim  # noqa: F401 - chooses MuJoCo's offscreen backend before metaworld loads MuJoCo
from slurmvla.inference.build import build_runner
from slurmvla.inference.closed_loop import executor_of, replan_of
from slurmvla.sim.metaworld.dataset import expert_episode
from slurmvla.sim.metaworld.env import ENV_STATE_KEY, IMAGE_KEY, STATE_KEY, MetaWorld, instruction


def decoded_frames(runner, seed: int) -> np.ndarray:  # noqa: ANN001
    """The recorded episode of ``seed`` in the run's dataset, decoded by the data layer's reader at the camera's
    own size: what training read (before its resize)."""
    from slurmvla.data.lerobot_format import LeRobotMetadata
    from slurmvla.data.video import decode_range

    root = Path(runner.cfg.data.root).expanduser()
    seeds = json.loads((root / "metaworld.json").read_text())["seeds"]
    if seed not in seeds:
        raise SystemExit(f"--frames decoded: seed {seed} is not one of {root}'s demonstrations {seeds}")
    meta = LeRobotMetadata(root)
    where = meta.video_location(runner.cfg.data.cameras[0])
    pos = list(meta.episodes["episode_index"]).index(seeds.index(seed))
    return decode_range(where.paths[pos], where.from_ts[pos], where.to_ts[pos], meta.fps, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--open", action="store_true", help="open loop along the expert's path")
    p.add_argument("--draws", type=int, default=1, help="noise seeds per observation (open loop)")
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--frames", choices=("render", "decoded"), default="render")
    args = p.parse_args()
    runners = [build_runner(args.run, [f"serve.seed={s}"]) for s in range(max(args.draws, 1))]
    cfg = runners[0].cfg
    task = cfg.rollout.task
    env = MetaWorld(task, cfg.rollout.height, cfg.rollout.width)
    expert = expert_episode(env, args.seed)
    frames = expert["frames"] if args.frames == "render" else decoded_frames(runners[0], args.seed)
    np.set_printoptions(precision=3, suppress=True)
    if args.open:
        errors = []
        for t in range(0, min(args.steps, len(frames)), args.every):
            obs = {IMAGE_KEY: frames[t], STATE_KEY: expert["state"][t], "prompt": instruction(task)}
            acts = np.stack([r.infer(obs)["actions"][0] for r in runners])
            errors.append(np.abs(acts - expert["action"][t]).mean(0))
            print(f"step {t:3d} expert {expert['action'][t]}  policy " + " | ".join(str(a) for a in acts))
        print(f"mean |policy - expert| per dim {np.mean(errors, 0)} over {len(errors)} steps")
        return
    # The rollout's own executor: its execution mode, replanning and delay, as slurmvla.rollout runs the run.
    rollout = cfg.rollout
    executor = executor_of(runners[0], rollout, replan_of(rollout, cfg.policy.action_horizon), env.fps)
    env.reset(args.seed)
    executor.reset(rest=env.rest_action())
    success = False
    for t in range(rollout.max_steps):
        obs = env.observe()
        action = executor.step(lambda obs=obs: {**obs, "prompt": instruction(task)}).action
        if t % args.every == 0 and t < args.steps:
            print(f"step {t:3d} hand {obs[STATE_KEY][:3]} (expert {expert['state'][t][:3]}) object "
                  f"{obs[ENV_STATE_KEY][4:7]} (expert {expert['env_state'][t][4:7]}) action {action} (expert "
                  f"{expert['action'][t]})")
        success |= env.step(action).success
    print(f"seed {args.seed}: policy {'succeeded' if success else 'failed'}, the expert "
          f"{'succeeded' if expert['success'].any() else 'failed'}")


if __name__ == "__main__":
    main()
