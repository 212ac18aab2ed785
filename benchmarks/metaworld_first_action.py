"""What a Meta-World policy does first, episode by episode, and whether its encoder sees where the object is.

    python benchmarks/metaworld_first_action.py RUN_DIR [--seeds 300000 300049] [--rollout ROLLOUT_JSON]

For each seed: the object's position (Meta-World's own observation, numbers 4-6), the scripted expert's first
action, the policy's first action (through the server's runner, as a rollout asks it) and how far its current frame's
keypoints lie from the first seed's (a keypoint policy: ``policy.features``). ``--rollout``: a rollout's JSON of
the same seeds, to print beside each seed whether it succeeded and to sum success by the side of the object's x.
A policy that sees the object acts differently for objects on either side of the hand; a blind one acts the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurmvla.inference.load import load_exported  # noqa: E402
from slurmvla.inference.runner import PolicyRunner  # noqa: E402
from slurmvla.sim.metaworld.env import MetaWorld  # noqa: E402
from slurmvla.sim.metaworld.expert import scripted_policy as expert  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--seeds", nargs=2, type=int, default=[300000, 300049], metavar=("FIRST", "LAST"))
    parser.add_argument("--rollout", type=Path)
    args = parser.parse_args()
    loaded = load_exported(args.run)
    cfg, runner = loaded.cfg, PolicyRunner(loaded)
    env = MetaWorld(cfg.rollout.task, height=cfg.rollout.height, width=cfg.rollout.width)
    scripted = expert(cfg.rollout.task)
    camera_key, state_key = runner.processor.camera_keys[0], cfg.serve.state[0]
    success = {}
    if args.rollout:
        success = {e["seed"]: e["success"] for e in json.loads(args.rollout.read_text())["episodes"]}
    first_points, rows = None, []
    print(f"{cfg.rollout.task}, {args.run}: seed, object x, expert's first action x, policy's first action x, "
          "keypoints' mean distance from the first seed's" + (", success" if success else ""))
    try:
        for seed in range(args.seeds[0], args.seeds[1] + 1):
            env.reset(seed)
            obs = env.observe()
            camera = next(iter(env.client_cameras))
            request = {camera_key: obs[camera], state_key: env.state(), cfg.serve.prompt: env.instruction}
            session = runner.session()
            action = session.infer(request)["actions"][0]
            points = float("nan")
            if hasattr(runner.policy, "features"):
                with torch.no_grad():
                    f = runner.policy.features(runner.processor.batch(session.past))[0].numpy()
                first_points = f if first_points is None else first_points
                points = float(np.abs(f - first_points).mean())
            x, hand = float(env.env_state()[4]), float(env.env_state()[0])
            rows.append((x - hand, success.get(seed)))
            print(f"{seed} {x:+.3f} {scripted.get_action(env.env_state())[0]:+.2f} {action[0]:+.2f} {points:.2e}"
                  + (f" {int(success[seed])}" if seed in success else ""))
    finally:
        env.close()
    if success:  # by the side of the hand's x the object stands on (to within 5 mm: either way)
        for name, side in (("object left of the hand (x - hand x < -0.005)", [s for d, s in rows if d < -0.005]),
                           ("within 5 mm", [s for d, s in rows if abs(d) <= 0.005]),
                           ("object right of the hand (x - hand x > 0.005)", [s for d, s in rows if d > 0.005])):
            print(f"{name}: {sum(map(bool, side))}/{len(side)} succeeded")


if __name__ == "__main__":
    main()
