"""A Meta-World experiment's policy: the keypoint flow policy whose image keypoints are also trained to predict
where the objects and the goal are (Meta-World's own observation, recorded beside each frame as
``observation.environment_state``), a training-time signal only (docs/benchmarks.md#meta-world).

The state the data layer hands it is the robot's 9 numbers followed by the environment's 39
(``data.state_keys=[observation.state,observation.environment_state]``); the policy acts on the images and the
first 9 alone (tests/sim/test_metaworld.py checks that the other 39 never move an action), and an auxiliary head
on the keypoints regresses the objects' and goal's positions among the 39 (normalized by the data's statistics),
added to the flow loss with weight ``aux_weight``. A plug-in through the policy contract, as a user's own class:

    PYTHONPATH=benchmarks python -m slurmvla.train experiment=metaworld rollout.task=disassemble-v3 \\
        'data.state_keys=[observation.state,observation.environment_state]' policy.state_dim=48 \\
        'serve.state=[observation/state,observation/env_state]' policy.target=metaworld_aux_policy.AuxKeypointFlowPolicy
    python benchmarks/metaworld_aux_policy.py RUN DATA_ROOT     # how well its keypoints locate the objects, in cm

The second command reads every frame of a recorded dataset (the training demonstrations, or new ones:
``python -m slurmvla.sim.record --env metaworld --task T --episodes 10 --first-seed 50000 --out DIR``) and prints,
per position, the auxiliary head's mean absolute error beside the positions' spread.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from slurmvla.policy.flow import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.sim.policies import KeypointFlowPolicy

ROBOT = 9  # DP3's agent_pos: the hand and both fingertips
# Meta-World's observation: hand 0:3, gripper 3, first object 4:7 (+ quaternion 7:11), second object 11:14
# (+ 14:18), the previous frame's 18 numbers 18:36, goal 36:39. The positions are the targets.
POSITIONS = (4, 5, 6, 11, 12, 13, 36, 37, 38)


class AuxKeypointFlowPolicy(KeypointFlowPolicy):
    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, aux_weight: float = 1.0,  # noqa: ANN001
                 **kwargs):
        sub = None if stats is None else {**stats, "state_offset": stats["state_offset"].reshape(-1)[:ROBOT],
                                          "state_scale": stats["state_scale"].reshape(-1)[:ROBOT]}
        super().__init__(dataclasses.replace(cfg, state_dim=ROBOT), sub, **kwargs)
        self.aux_weight = aux_weight
        dims = [ROBOT + d for d in POSITIONS]
        offset = torch.zeros(cfg.state_dim) if stats is None else stats["state_offset"].float().reshape(-1)
        scale = torch.ones(cfg.state_dim) if stats is None else stats["state_scale"].float().reshape(-1)
        self.register_buffer("aux_index", torch.tensor(dims))
        self.register_buffer("aux_offset", offset[dims].clone())
        self.register_buffer("aux_scale", scale[dims].clamp_min(1e-4).clone())
        # A position that never varies in the data (assembly's nut) is no target.
        self.register_buffer("aux_valid", (scale[dims] > 1e-3).float())
        self.keypoint_dim = self.feature_dim - cfg.num_obs_history * ROBOT
        self.aux_head = nn.Sequential(nn.Linear(self.keypoint_dim, 256), nn.ReLU(), nn.Linear(256, len(dims)))

    def features(self, batch: dict) -> torch.Tensor:
        return super().features({**batch, "state": batch["state"][..., :ROBOT]})

    def aux_target(self, batch: dict) -> torch.Tensor:
        """The current frame's normalized positions ``[B, 9]``."""
        state = batch["state"][:, -1] if batch["state"].dim() == 3 else batch["state"]
        return (state.float()[:, self.aux_index] - self.aux_offset) / self.aux_scale

    def forward(self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None) -> dict:
        if self.prediction != "sample" or self.rtc_training.enabled:
            raise ValueError("AuxKeypointFlowPolicy trains the default x-prediction head without policy.rtc_training")
        features = self.features(batch)
        actions = (batch["actions"].float() - self.action_offset) / self.action_scale
        noise, t = noise_and_time(batch, actions, noise, t)
        out = flow_matching_loss(noise - self.head(noisy_actions(actions, noise, t), t, features), noise, actions,
                                 batch["action_mask"])
        err = (self.aux_head(features[:, :self.keypoint_dim]) - self.aux_target(batch)).square() * self.aux_valid
        err = err.sum(1) / self.aux_valid.sum().clamp_min(1)
        out["loss"] = out["loss"] + self.aux_weight * err.mean()
        out["components"]["aux"] = (err.detach(), torch.ones_like(err))
        return out


def locate(run: str, root: str) -> None:
    from slurmvla.data.loader import build_validation_loader
    from slurmvla.data.mixture import Mixture
    from slurmvla.inference.load import load_exported

    loaded = load_exported(run, [f"data.root={root}", "policy.target=metaworld_aux_policy.AuxKeypointFlowPolicy"])
    policy, cfg = loaded.policy.eval(), loaded.cfg
    mixture = Mixture(cfg.data, type(policy).sample_spec(cfg.policy), cfg.trainer.seed)
    errors, targets = [], []
    with torch.no_grad():
        for batch in build_validation_loader(mixture, cfg.data, 64, split="all"):
            found = policy.aux_head(policy.features(batch)[:, :policy.keypoint_dim])
            target = policy.aux_target(batch)
            errors.append((found - target) * policy.aux_scale)
            targets.append(target * policy.aux_scale)
    error, target = torch.cat(errors), torch.cat(targets)
    names = [f"{what} {axis}" for what in ("first object", "second object", "goal") for axis in "xyz"]
    for i, name in enumerate(names):
        if policy.aux_valid[i]:
            print(f"{name}: mean |error| {100 * error[:, i].abs().mean():.2f} cm, "
                  f"spread (std) {100 * target[:, i].std():.2f} cm")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.modules.setdefault("metaworld_aux_policy", sys.modules["__main__"])
    if len(sys.argv) != 3:
        sys.exit(f"usage: python {sys.argv[0]} RUN DATA_ROOT")
    locate(sys.argv[1], sys.argv[2])
