"""A Meta-World experiment's policy: the keypoint flow policy whose image keypoints are also trained to predict
where the objects and the goal are (Meta-World's own observation, recorded beside each frame as
``observation.environment_state``), a training-time signal only (docs/benchmarks.md#meta-world).

The state the data layer hands it is the robot's 9 numbers followed by the environment's 39
(``data.state_keys=[observation.state,observation.environment_state]``); the policy acts on the images and the
first 9 alone (tests/sim/test_metaworld.py checks that the other 39 never move an action), and an auxiliary head
on the keypoints regresses the objects' and goal's positions among the 39 (normalized by the data's statistics),
added to the flow loss with weight ``aux_weight``. A policy of the study's plug-in (``policy=keypoints_flow_aux``):

    python -m slurmvla.train experiment=metaworld policy=keypoints_flow_aux rollout.task=disassemble-v3 \\
        'data.state_keys=[observation.state,observation.environment_state]' policy.state_dim=48 \\
        'serve.state=[observation/state,observation/env_state]'
    python -m slurmvla_metaworld_study.auxiliary RUN DATA_ROOT     # how well its keypoints locate the objects, in cm

The second command reads every frame of a recorded dataset (the training demonstrations, or new ones:
``python -m slurmvla.sim.record --env metaworld --task T --episodes 10 --first-seed 50000 --out DIR``) and prints,
per position, the auxiliary head's mean absolute error beside the positions' spread.

:class:`PixelAuxCropFlowPolicy` is slurmvla's labelled keypoints (``policy=keypoints_flow_labelled``,
:mod:`slurmvla_metaworld_study.labelled_keypoints.model`: the keypoints themselves trained onto the points' pixels) as the benchmarks
measured it, each option off unless named, with the oracle diagnostics
(``policy=keypoints_flow_pixel_aux policy.image_size=128 'data.label_keys=[observation.environment_state]'``, or
the 39 numbers in the state as the runs before the labels);
``python -m slurmvla_metaworld_study.auxiliary RUN --pixels 300000 300050`` prints how far its (or the labelled policy's)
keypoints sit from the true pixels on those seeds' first frames (docs/benchmarks.md, "Keypoints trained onto the
objects' pixels").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from slurmvla.policy.flow_matching import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.policy.keypoints.model import KeypointFlowPolicy
from slurmvla.sim.metaworld.env import STATE_DIM
from slurmvla_metaworld_study.labelled_keypoints.model import (
    ENVIRONMENT_DIM,
    POINTS,
    LabelledKeypointFlowPolicy,
)

ROBOT = STATE_DIM  # DP3's agent_pos: the hand and both fingertips (9 numbers)
# Meta-World's observation (slurmvla_metaworld_study.labelled_keypoints.model.POINTS): the positions are the targets.
POSITIONS = (4, 5, 6, 11, 12, 13, 36, 37, 38)


def stats_of_robot(stats: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """The data's statistics with the state's cut to the robot's 9 numbers (what the policies act on)."""
    return None if stats is None else {**stats, "state_offset": stats["state_offset"].reshape(-1)[:ROBOT],
                                       "state_scale": stats["state_scale"].reshape(-1)[:ROBOT]}


def state_stats(stats: dict[str, torch.Tensor] | None, state_dim: int, dims: list[int]) -> tuple[torch.Tensor, ...]:
    """The state's normalization ``(offset, scale)`` at ``dims`` (identity without statistics)."""
    offset = torch.zeros(state_dim) if stats is None else stats["state_offset"].float().reshape(-1)
    scale = torch.ones(state_dim) if stats is None else stats["state_scale"].float().reshape(-1)
    return offset[dims].clone(), scale[dims].clone()


class AuxKeypointFlowPolicy(KeypointFlowPolicy):
    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, aux_weight: float = 1.0,  # noqa: ANN001
                 **kwargs):
        super().__init__(dataclasses.replace(cfg, state_dim=ROBOT), stats_of_robot(stats), **kwargs)
        self.aux_weight = aux_weight
        dims = [ROBOT + d for d in POSITIONS]
        offset, scale = state_stats(stats, cfg.state_dim, dims)
        self.register_buffer("aux_index", torch.tensor(dims))
        self.register_buffer("aux_offset", offset)
        self.register_buffer("aux_scale", scale.clamp_min(1e-4))
        # A position that never varies in the data (assembly's nut) is no target.
        self.register_buffer("aux_valid", (scale > 1e-3).float())
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


class PixelAuxCropFlowPolicy(LabelledKeypointFlowPolicy):
    """slurmvla's labelled keypoints (``policy=keypoints_flow_labelled``,
    :class:`slurmvla_metaworld_study.labelled_keypoints.model.LabelledKeypointFlowPolicy`) as the benchmarks measured it: each option
    off unless named (the selection's rows name them), and the diagnostics below. The policy acts on the images and
    the robot's 9 numbers alone; Meta-World's 39 numbers only train it, read from the batch's training labels
    (``data.label_keys=[observation.environment_state]``: the state is the robot's 9, all a client sends) or from the
    state after the robot's 9 (``data.state_keys=[observation.state,observation.environment_state]
    policy.state_dim=48 serve.state=[observation/state,observation/env_state]``, as the runs before the labels
    trained, identically: tests/sim/test_metaworld.py).

    ``oracle=True`` is a diagnostic, not an image policy: the three points' true pixels (those the frame shows)
    join the features, read from the 39 numbers at every request too (what perfect 2-D localization would hand the
    head), standardized with the keypoints under ``standardize``. ``oracle_world=True``, the same diagnostic with
    the points' positions in the world (normalized by the data's statistics) in place of their pixels;
    ``oracle_dims`` (indices into the 39), with any other of the 39. Both need the 39 in the state."""

    def __init__(self, cfg, stats: dict[str, torch.Tensor] | None = None, aux_weight: float = 10.0,  # noqa: ANN001
                 relative: bool = False, oracle: bool = False, oracle_world: bool = False,
                 oracle_dims: list[int] | None = None, standardize: bool = False, **kwargs):
        if (oracle or oracle_world or oracle_dims) and cfg.state_dim != ROBOT + ENVIRONMENT_DIM:
            raise ValueError(f"policy.state_dim={cfg.state_dim}: the oracle diagnostics read Meta-World's 39 numbers "
                             "at every request, so the state must carry them: data.state_keys=[observation.state,"
                             "observation.environment_state] policy.state_dim=48")
        dims = list(POSITIONS) if oracle_world else [int(d) for d in oracle_dims or []]
        super().__init__(dataclasses.replace(cfg, state_dim=ROBOT), stats_of_robot(stats), aux_weight=aux_weight,
                         relative=relative, standardize=standardize,
                         scaled_extra=cfg.num_obs_history * 2 * len(POINTS) if oracle else 0,
                         extra=cfg.num_obs_history * len(dims), **kwargs)
        self.oracle, self.oracle_dims = oracle, dims
        if dims:  # their statistics (buffers only: the other options' weights are unchanged)
            offset, scale = state_stats(stats, cfg.state_dim, [ROBOT + d for d in dims])
            self.register_buffer("world_offset", offset)
            self.register_buffer("world_scale", scale.clamp_min(1e-2))

    def feature_parts(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        return super().feature_parts({**batch, "state": batch["state"][..., :ROBOT]})

    def environment(self, batch: dict) -> torch.Tensor:
        """The labels when the batch has them, else the state's numbers after the robot's 9."""
        if "labels" in batch:
            return super().environment(batch)
        state = batch["state"].float().reshape(batch["state"].shape[0], self.history, -1)
        if state.shape[-1] != ROBOT + ENVIRONMENT_DIM:
            raise ValueError(f"PixelAuxCropFlowPolicy trains its keypoints on Meta-World's 39 numbers, and this batch "
                             f"has neither labels nor them in its state ({state.shape[-1]} numbers): set "
                             "data.label_keys=[observation.environment_state]")
        return state[..., ROBOT:]

    def extra_features(self, batch: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        b = batch["state"].shape[0]
        env = batch["state"].float().reshape(b, self.history, -1)[..., ROBOT:]  # the state's, never the labels
        scaled, extra = [], []
        if self.oracle:
            cells, valid = self.points(env)
            scaled.append((cells * valid[..., None]).flatten(1))
        if self.oracle_dims:
            extra.append(((env[..., self.oracle_dims] - self.world_offset) / self.world_scale).flatten(1))
        return scaled, extra


def locate_pixels(run: str, seeds: list[int]) -> None:
    """The pixel policy's keypoints against the points' true pixels on each seed's first frame, in the camera's
    pixels: the demonstrations' own seeds, then ``seeds``."""
    import json

    import numpy as np

    from slurmvla.inference.load import load_exported
    from slurmvla.sim.metaworld.env import ENV_STATE_KEY, IMAGE_KEY, IMAGE_SIZE, STATE_KEY, MetaWorld

    loaded = load_exported(run, [])
    policy, cfg = loaded.policy.eval(), loaded.cfg
    env = MetaWorld(cfg.rollout.task)
    demos = json.loads((Path(cfg.data.root) / "metaworld.json").read_text())["seeds"]
    scale = IMAGE_SIZE / policy.map_size
    for name, group in (("the demonstrations' seeds", demos), (f"seeds {seeds[0]}-{seeds[-1]}", seeds)):
        errors = []
        for seed in group:
            env.reset(seed)
            obs = env.observe([IMAGE_KEY, STATE_KEY, ENV_STATE_KEY])
            image = torch.from_numpy(np.ascontiguousarray(obs[IMAGE_KEY]))[None, None].repeat(1, policy.history, 1, 1, 1)
            state, env_state = (torch.from_numpy(obs[key]).float()[None, None].repeat(1, policy.history, 1)
                                for key in (STATE_KEY, ENV_STATE_KEY))
            if getattr(policy, "oracle", False) or getattr(policy, "oracle_dims", []):  # they read the 39 in the state
                state = torch.cat([state, env_state], dim=-1)
            batch = {"images": image, "image_mask": torch.ones(1, policy.history, dtype=torch.bool), "state": state,
                     "labels": env_state}
            with torch.no_grad():
                policy.features(batch)
                cells, valid = policy.points(env_state[:, -1])
            k = policy._whole[-1].shape[1] // 2
            found = torch.stack([policy._whole[-1][:, :len(POINTS)], policy._whole[-1][:, k:k + len(POINTS)]], -1)
            dist = ((found - cells) / 2 * (policy.map_size - 1)).norm(dim=-1)[0] * scale
            errors.append(torch.where(valid[0], dist, torch.nan))
        mean = torch.stack(errors).nanmean(0)
        print(f"{cfg.rollout.task}, {name}: mean distance, keypoint to true pixel (first object, second object, "
              f"goal): {', '.join('-' if m.isnan() else f'{m:.1f} px' for m in mean)}")
    env.close()


def locate(run: str, root: str) -> None:
    from slurmvla.data.loader import build_validation_loader
    from slurmvla.data.mixture import Mixture
    from slurmvla.inference.load import load_exported

    loaded = load_exported(run, [f"data.root={root}"])
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


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="How well an auxiliary policy's keypoints locate the objects.")
    parser.add_argument("run", help="a run or checkpoint of AuxKeypointFlowPolicy or PixelAuxCropFlowPolicy")
    parser.add_argument("data_root", nargs="?", help="AuxKeypointFlowPolicy: a recorded dataset to read")
    parser.add_argument("--pixels", nargs=2, type=int, metavar=("FIRST_SEED", "END_SEED"),
                        help="PixelAuxCropFlowPolicy: its keypoints against the true pixels on these seeds' first frames")
    args = parser.parse_args()
    if (args.pixels is None) == (args.data_root is None):
        parser.error("give DATA_ROOT (AuxKeypointFlowPolicy) or --pixels FIRST_SEED END_SEED (PixelAuxCropFlowPolicy)")
    if args.pixels:
        locate_pixels(args.run, list(range(*args.pixels)))
    else:
        locate(args.run, args.data_root)
