"""Meta-World as the closed loop's second embodiment (slurmvla/sim/metaworld.py): the environment, its
demonstrations as a LeRobot dataset read back through the data layer, and every convention between the
simulator, openpi's client and the server checked without learning: the scripted expert served as a policy
plays exactly the episodes it plays acting on the environment directly."""

from __future__ import annotations

import json

import numpy as np
import pytest

import slurmvla.sim  # noqa: F401 - chooses MuJoCo's offscreen backend before metaworld loads MuJoCo

pytest.importorskip("metaworld", reason="pip install -e '.[sim]'")
pytest.importorskip("openpi_client", reason="pip install --no-deps openpi-client")

from slurmvla.config.rollout import RolloutConfig  # noqa: E402
from slurmvla.sim.metaworld.dataset import expert_episode  # noqa: E402
from slurmvla.sim.metaworld.env import ACTION_DIM, ENV_STATE_KEY, IMAGE_KEY, STATE_KEY, MetaWorld  # noqa: E402
from slurmvla.sim.metaworld.expert import Expert  # noqa: E402


class ExpertPolicy:
    """A task's scripted expert as a policy server serves it (``infer(obs) -> {"actions"}``, ``metadata()``): it
    reads the full environment state the simulator offers (``observation/env_state``) and answers a chunk of one
    action. Served through openpi's client, it must reach the success it reaches acting on the environment
    directly; anything else is a convention broken between the two."""

    def __init__(self, task: str):
        self.task, self.expert = task, Expert(task)

    def metadata(self) -> dict:
        return {"server": "slurmvla", "policy": f"metaworld_expert:{self.task}", "action_horizon": 1,
                "action_dim": ACTION_DIM, "cameras": {"corner2": IMAGE_KEY}, "state": [ENV_STATE_KEY],
                "prompt": "prompt", "execution_modes": ["sync", "async"]}

    def infer(self, obs: dict) -> dict:
        return {"actions": self.expert.action(obs[ENV_STATE_KEY])[None]}

TASK = "button-press-v3"  # the expert presses it in ~60 steps, from every seed tried


def test_episodes_are_drawn_from_their_seed_and_observed_as_dp3_observes_them():
    env = MetaWorld(TASK, height=64, width=64)
    try:
        starts = {}
        for seed in (3, 4, 3):
            env.reset(seed)
            obs = env.observe()
            starts.setdefault(seed, []).append(obs[ENV_STATE_KEY])
        assert np.array_equal(*starts[3])  # the same seed, the same object and goal
        assert not np.array_equal(starts[3][0], starts[4][0])  # another seed, another place
        assert obs[IMAGE_KEY].shape == (64, 64, 3) and obs[IMAGE_KEY].dtype == np.uint8
        # DP3's agent_pos: the hand (Meta-World's own first 3 numbers), then both fingertips, a little below it
        # and on either side.
        state = obs[STATE_KEY]
        assert state.shape == (9,)
        np.testing.assert_allclose(state[:3], obs[ENV_STATE_KEY][:3], atol=1e-6)
        between = (state[3:6] + state[6:9]) / 2
        np.testing.assert_allclose(between[:2], state[:2], atol=0.01)
        assert 0.02 < state[2] - between[2] < 0.08 and np.linalg.norm(state[3:6] - state[6:9]) > 0.02
        with pytest.raises(ValueError, match=r"a Meta-World action is 4 numbers in \[-1, 1\].*got \[0.0, 0.0\]"):
            env.step(np.zeros(2))
    finally:
        env.close()


def test_the_first_frame_shows_its_own_episodes_scene():
    """assembly-v3 places its peg by the model's body position at reset, 5 cm below the goal its observation
    gives: the world the first frame is rendered from must already hold it there, whatever seed came before."""
    env = MetaWorld("assembly-v3", height=64, width=64)
    try:
        for seed in (3, 4):
            env.reset(seed)
            goal = env.observe()[ENV_STATE_KEY][36:39]
            np.testing.assert_allclose(env.env.data.body("peg").xpos, goal - [0.0, 0.0, 0.05], atol=1e-9)
    finally:
        env.close()


def test_demonstrations_read_back_through_the_data_layer_replay_the_episode(tmp_path, make_cfg):
    """A recorded episode, read as training reads it, is the episode: its states and actions replayed in a fresh
    environment from the same seed give the same states, and its frames decode to what the camera rendered
    (AV1 at DROID's settings: lossy, within a few grey levels on average)."""
    from slurmvla.data.mixture import Mixture
    from slurmvla.policy import sample_spec
    from slurmvla.sim.record import record

    summary = record(tmp_path / "demo", "metaworld", TASK, episodes=1, first_seed=7, height=64, width=64, steps=72)
    assert summary["seeds"] == [7] and summary["tried"][0]["success_steps"] >= 5
    assert json.loads((tmp_path / "demo" / "metaworld.json").read_text())["camera_position"] == [0.6, 0.295, 0.8]

    cfg = make_cfg("experiment=metaworld", f"rollout.task={TASK}", f"data.root={tmp_path / 'demo'}", "data.num_workers=0",
                   "policy.image_size=64")
    mixture = Mixture(cfg.data, sample_spec(cfg.policy), cfg.trainer.seed)
    source = mixture.sources[0]
    env = MetaWorld(TASK, height=64, width=64)
    try:
        again = expert_episode(env, 7, steps=72)
    finally:
        env.close()
    sample = source.sample(source.load_episode(0), 10, epoch=0)
    # Sample at frame 10: its history is frames 7 and 10 (experiment=metaworld: 3 steps apart, as the rollout asks
    # every 3 steps), its chunk actions 10..13.
    history = [7, 10]
    np.testing.assert_allclose(sample["state"].numpy(), again["state"][history], atol=1e-6)
    np.testing.assert_allclose(sample["actions"].numpy(), again["action"][10:14], atol=1e-6)
    assert sample["instruction"] == "press the button"
    frames = sample["images"].numpy()  # [history x cameras, H, W, 3] at the policy's size
    assert np.abs(frames.astype(int) - again["frames"][history].astype(int)).mean() < 6
    # The environment's 39 numbers as training labels (data.label_keys, which experiment=metaworld sets): the same
    # frames as the state's, raw; the state and everything else as without them. A dataset without the key fails by
    # name.
    np.testing.assert_allclose(sample["labels"].numpy(), again["env_state"][history], atol=1e-6)
    assert sample["labels"].shape == (2, 39) and source.label_dim == 39
    plain = make_cfg("experiment=metaworld", f"rollout.task={TASK}", f"data.root={tmp_path / 'demo'}",
                     "data.num_workers=0", "policy.image_size=64", "data.label_keys=[]")
    source = Mixture(plain.data, sample_spec(plain.policy), plain.trainer.seed).sources[0]
    without = source.sample(source.open_episode(0, 10, 10), 10, epoch=0)
    assert "labels" not in without
    for key in ("state", "actions", "images", "noise", "time_u"):
        assert np.array_equal(without[key].numpy(), sample[key].numpy()), key
    missing = make_cfg("experiment=metaworld", f"rollout.task={TASK}", f"data.root={tmp_path / 'demo'}",
                       "data.num_workers=0", "policy.image_size=64", "data.label_keys=[observation.object_pose]")
    with pytest.raises(ValueError, match=r"observation.object_pose.*data.label_keys=\[\] if the policy trains on none"):
        Mixture(missing.data, sample_spec(missing.policy), missing.trainer.seed)


def test_the_scripted_expert_served_through_openpis_client_plays_its_own_episodes():
    """The expert acting on the environment directly, and the same expert behind the policy server, asked by
    openpi's client at every step with what the simulator sends: the same success and length, seed by seed."""
    from slurmvla.inference.closed_loop import run_served, summarize
    from slurmvla.inference.server import PolicyServer

    seeds = [100000, 100001, 100002]
    env = MetaWorld(TASK, height=64, width=64)
    direct = {}
    try:
        for seed in seeds:
            expert = ExpertPolicy(TASK)
            env.reset(seed)
            for _ in range(120):
                step = env.step(expert.infer({ENV_STATE_KEY: env.env_state()})["actions"][0])
                if step.success:
                    break
            direct[seed] = (step.success, env.steps)
    finally:
        env.close()
    assert all(success for success, _ in direct.values())

    cfg = RolloutConfig(env="metaworld", task=TASK, episodes=len(seeds), first_seed=seeds[0], max_steps=120,
                        replan_steps=1, height=64, width=64, videos=0)
    served = run_served(PolicyServer(ExpertPolicy(TASK), "127.0.0.1", 0), cfg, seeds, None)
    assert {e["seed"]: (e["success"], e["length"]) for e in served} == direct
    assert summarize(served, 1.0)["rollout/success_rate"] == 1.0
    assert all(e["requests"] == e["length"] for e in served)  # one request a step: replan_steps=1, horizon 1


def test_noisy_demonstrations_record_the_experts_command_for_the_state_the_noise_led_to():
    """``--noise`` (DART): the executed displacement is perturbed, the recorded action is what the scripted expert
    commands in the state the perturbed arm reached (asked again here, state by state), the gripper's effort is
    executed unperturbed; without noise the episode is the expert's own, bitwise."""
    env = MetaWorld(TASK, height=64, width=64)
    try:
        clean = expert_episode(env, 7, steps=40, render=False)
        noisy = expert_episode(env, 7, steps=40, render=False, noise=0.3)
        assert np.array_equal(clean["state"][0], noisy["state"][0])  # the same start
        drift = np.abs(noisy["state"][1:, :3] - clean["state"][1:, :3]).max()
        assert drift > 1e-3, drift  # the perturbed arm went elsewhere
        expert = ExpertPolicy(TASK)
        asked = np.clip([expert.infer({ENV_STATE_KEY: s})["actions"][0] for s in noisy["env_state"]], -1.0, 1.0)
        # (the state is stored in float32: the expert asked again from it differs in the last bit)
        np.testing.assert_allclose(noisy["action"], asked, rtol=0, atol=1e-5)
        assert not np.array_equal(noisy["action"], clean["action"])
        # noise 0 is the expert acting alone, bitwise: the reference drives the environment directly.
        expert, env_states = ExpertPolicy(TASK), []
        env.reset(7)
        for _ in range(40):
            env_states.append(env.env_state())
            env.step(expert.infer({ENV_STATE_KEY: env_states[-1]})["actions"][0])
        np.testing.assert_array_equal(clean["env_state"], np.asarray(env_states, np.float32))
    finally:
        env.close()


def test_rollout_settings_name_the_embodiment_and_its_task():
    with pytest.raises(ValueError, match=r"rollout.env='libero' is not valid; choose one of \['metaworld', 'mt50', 'pick'\]"):
        RolloutConfig(env="libero")
    with pytest.raises(ValueError, match=r"rollout.env=metaworld needs rollout.task"):
        RolloutConfig(env="metaworld")
    with pytest.raises(ValueError, match=r"rollout.task='assembly-v3' is not a variant of the pick task \(rollout.env=pick\); "
                                         r"choose one of \['two_cubes'\] or null"):
        RolloutConfig(task="assembly-v3")
    assert RolloutConfig(task="two_cubes").task == "two_cubes"
    with pytest.raises(ValueError, match=r"rollout.task='assembly-v2' is not a Meta-World v3 task; choose one of "
                                         r"\['assembly-v3', 'basketball-v3'"):
        MetaWorld("assembly-v2")


def test_the_auxiliary_position_policy_acts_on_the_image_and_the_robot_alone():
    """examples/metaworld_study's AuxKeypointFlowPolicy: the environment's 39 numbers behind the robot's 9 are targets of the
    auxiliary head, never an input of an action; the targets are the positions' dims, normalized."""
    import torch
    from slurmvla_metaworld_study.auxiliary.model import POSITIONS, ROBOT, AuxKeypointFlowPolicy

    from slurmvla.policy.flow_vla.config import FlowVLAConfig

    torch.manual_seed(0)
    cfg = FlowVLAConfig(num_cameras=1, num_obs_history=2, state_dim=ROBOT + 39, action_dim=4, action_horizon=4,
                        image_size=32)
    stats = {"state_offset": torch.randn(48), "state_scale": torch.rand(48) + 0.5, "action_offset": torch.zeros(4),
             "action_scale": torch.ones(4)}
    policy = AuxKeypointFlowPolicy(cfg, stats).eval()
    batch = {"images": torch.randint(0, 256, (3, 2, 32, 32, 3), dtype=torch.uint8),
             "image_mask": torch.ones(3, 2, dtype=torch.bool), "state": torch.randn(3, 2, 48)}
    noise = torch.randn(3, 4, 4)
    acts = policy.sample_actions(batch, noise=noise)
    env = batch["state"].clone()
    env[..., ROBOT:] += 100 * torch.randn_like(env[..., ROBOT:])
    assert torch.equal(policy.sample_actions({**batch, "state": env}, noise=noise), acts)
    robot = batch["state"].clone()
    robot[..., :ROBOT] += 1.0
    assert (policy.sample_actions({**batch, "state": robot}, noise=noise) - acts).abs().max() > 1e-3
    dims = [ROBOT + d for d in POSITIONS]
    want = (batch["state"][:, -1, dims] - stats["state_offset"][dims]) / stats["state_scale"][dims]
    assert torch.allclose(policy.aux_target(batch), want)
    train = {**batch, "actions": torch.randn(3, 4, 4), "action_mask": torch.ones(3, 4, dtype=torch.bool),
             "noise": noise, "time_u": torch.rand(3)}
    out = policy.train()(train)
    assert out["loss"].isfinite() and out["components"]["aux"][0].min() > 0


@pytest.mark.parametrize("relative", [False, True])
def test_the_pixel_auxiliary_policy_ties_keypoints_to_the_points_pixels_and_acts_on_the_image_and_robot_alone(
        relative):
    """examples/metaworld_study's PixelAuxCropFlowPolicy: the 39 numbers behind the robot's 9 never move
    an action (with ``oracle`` they do: a diagnostic); its targets are where the spatial softmax puts a keypoint
    peaked at the point's pixel, on the encoder's own map; a keypoint on its target costs nothing, and an absent
    second object counts for nothing."""
    import torch
    from slurmvla_metaworld_study.auxiliary.model import ROBOT, PixelAuxCropFlowPolicy
    from slurmvla_metaworld_study.labelled_keypoints.model import (
        LabelledKeypointFlowPolicy,
        softmax_coordinates,
    )

    from slurmvla.policy.flow_vla.config import FlowVLAConfig
    from slurmvla.policy.keypoints.model import SpatialSoftmax

    # The coordinate convention against the spatial softmax itself: a map peaked at cell (row 5, column 2).
    peaked = torch.full((1, 1, 8, 8), -1e4)
    peaked[0, 0, 5, 2] = 0.0
    assert torch.allclose(SpatialSoftmax()(peaked).view(2), softmax_coordinates(torch.tensor([2.5, 5.5]), 8))
    torch.manual_seed(0)
    cfg = FlowVLAConfig(num_cameras=1, num_obs_history=2, state_dim=ROBOT + 39, action_dim=4, action_horizon=4,
                        image_size=128)
    stats = {"state_offset": torch.randn(48) * 0.01, "state_scale": torch.rand(48) + 0.5,
             "action_offset": torch.zeros(4), "action_scale": torch.ones(4)}
    policy = PixelAuxCropFlowPolicy(cfg, stats, global_size=96, relative=relative).eval()
    maps = policy.encoders[0][:-1](torch.zeros(1, 3, 96, 96))
    assert maps.shape[-2:] == (policy.map_size, policy.map_size) == (24, 24)
    state = torch.zeros(3, 2, 48)
    state[..., :ROBOT] = torch.tensor([0.0, 0.6, 0.15, 0.01, 0.6, 0.15, -0.01, 0.6, 0.15])
    state[..., ROBOT + 4:ROBOT + 7] = torch.tensor([0.1, 0.65, 0.02])  # the object; no second object
    state[..., ROBOT + 36:] = torch.tensor([-0.1, 0.7, 0.1])  # the goal
    batch = {"images": torch.randint(0, 256, (3, 2, 128, 128, 3), dtype=torch.uint8),
             "image_mask": torch.ones(3, 2, dtype=torch.bool), "state": state}
    noise = torch.randn(3, 4, 4)
    acts = policy.sample_actions(batch, noise=noise)
    env = state.clone()
    env[..., ROBOT:] += torch.randn_like(env[..., ROBOT:])
    assert torch.equal(policy.sample_actions({**batch, "state": env}, noise=noise), acts)
    robot = state.clone()
    robot[..., :3] += 0.05
    assert (policy.sample_actions({**batch, "state": robot}, noise=noise) - acts).abs().max() > 1e-4
    for option in ("oracle", "oracle_world"):
        oracle = PixelAuxCropFlowPolicy(cfg, stats, **{option: True}).eval()
        assert (oracle.sample_actions({**batch, "state": env}, noise=noise)
                - oracle.sample_actions(batch, noise=noise)).abs().max() > 1e-4
    # The loss: zero with every keypoint on its target, the absent second object never counted.
    cells, valid = policy.points(state[..., ROBOT:])
    assert valid[0, 0].tolist() == [True, False, True]
    from slurmvla_metaworld_study.hand_crop.model import project
    uv = project(torch.tensor([0.1, 0.65, 0.02]), policy.map_size)
    assert torch.allclose(cells[0, 0, 0], softmax_coordinates(uv, policy.map_size))
    policy.features(batch)
    err, count = policy.aux_error(batch)
    assert err.min() > 0 and count.tolist() == [4, 4, 4]  # two points in each of two frames
    for f, keypoints in enumerate(policy._whole):
        keypoints = keypoints.clone()
        k = keypoints.shape[1] // 2
        keypoints[:, [0, 2]], keypoints[:, [k, k + 2]] = cells[:, f, [0, 2], 0], cells[:, f, [0, 2], 1]
        keypoints[:, 1], keypoints[:, k + 1] = 0.7, -0.3  # the absent object's keypoint: anywhere
        policy._whole[f] = keypoints
    err, _ = policy.aux_error(batch)
    assert err.abs().max() < 1e-10
    # A point the frame does not show (stick-push's goal, 14 px above the top edge of its 128 px frame) trains no
    # keypoint: the second sample's goal moves there, and only its object is counted.
    above = torch.tensor([0.4, 0.575, 0.132])
    assert project(above, 128)[1] < -10 and 0 < project(above, 128)[0] < 128
    state[1, :, ROBOT + 36:] = above
    cells, valid = policy.points(state[..., ROBOT:])
    assert valid[:, 0].tolist() == [[True, False, True], [True, False, False], [True, False, True]]
    policy.features(batch)
    _, count = policy.aux_error(batch)
    assert count.tolist() == [4, 2, 4]
    # slurmvla's policy=keypoints_flow_labelled: the 39 numbers as training labels (data.label_keys), the state the
    # robot's 9; with the benchmark's weights the same loss and actions as the benchmark's policy with the 39 in the
    # state (the runs before the labels); served without them it acts; training without them says why.
    from slurmvla_metaworld_study.auxiliary.model import stats_of_robot
    robot_cfg = FlowVLAConfig(num_cameras=1, num_obs_history=2, state_dim=ROBOT, action_dim=4, action_horizon=4,
                              image_size=128)
    labelled = LabelledKeypointFlowPolicy(robot_cfg, stats_of_robot(stats), global_size=96, relative=relative,
                                          standardize=False)
    labelled.load_state_dict(policy.state_dict())
    labelled.train(), policy.train()
    split = {**batch, "state": state[..., :ROBOT], "labels": state[..., ROBOT:]}
    actions, t = torch.randn(3, 4, 4), torch.rand(3)
    ref = policy({**batch, "actions": actions, "action_mask": torch.ones(3, 4, dtype=torch.bool)}, noise, t)
    got = labelled({**split, "actions": actions, "action_mask": torch.ones(3, 4, dtype=torch.bool)}, noise, t)
    assert torch.equal(got["loss"], ref["loss"]) and got["components"]["aux"][1].tolist() == [4, 2, 4]
    labelled.eval(), policy.eval()
    served = {k: v for k, v in split.items() if k != "labels"}
    assert torch.equal(labelled.sample_actions(served, noise=noise), policy.sample_actions(batch, noise=noise))
    with pytest.raises(ValueError, match=r"data.label_keys=\[observation.environment_state\]"):
        labelled.train()({**served, "actions": actions, "action_mask": torch.ones(3, 4, dtype=torch.bool)}, noise, t)
    with pytest.raises(ValueError, match="policy.state_dim=9.*the state must carry them"):
        PixelAuxCropFlowPolicy(robot_cfg, None, oracle=True)


def test_the_pixel_policys_standardized_keypoints_are_its_plain_keypoints_at_the_datas_spread():
    """examples/metaworld_study's PixelAuxCropFlowPolicy with ``standardize=True``: the running statistics converge to the plain
    mean and spread of what training showed them (and stay put at evaluation); the policy's features are the same
    policy's unstandardized ones with the whole image's keypoints (and their offsets) standardized, a masked
    frame's still zeros, the crop's keypoints and the robot's state untouched."""
    import torch
    from slurmvla_metaworld_study.auxiliary.model import ROBOT, PixelAuxCropFlowPolicy
    from slurmvla_metaworld_study.labelled_keypoints.model import RunningStandardize

    from slurmvla.policy.flow_vla.config import FlowVLAConfig

    torch.manual_seed(0)
    norm = RunningStandardize(3, momentum=0.05)
    data = torch.randn(400, 64, 3) * torch.tensor([0.02, 1.0, 5.0]) + torch.tensor([0.5, -1.0, 2.0])
    for x in data:
        norm.train()(x)
    spread = data.reshape(-1, 3).std(0)  # within a tenth of each feature's own spread, whatever its scale
    assert ((norm.mean - data.reshape(-1, 3).mean(0)).abs() < 0.1 * spread).all()
    assert ((norm.var.sqrt() / spread - 1).abs() < 0.1).all()
    mean = norm.mean.clone()
    out = norm.eval()(data[0])
    assert torch.equal(norm.mean, mean)
    assert torch.allclose(out, (data[0] - mean) / (norm.var + norm.eps).sqrt())
    cfg = FlowVLAConfig(num_cameras=1, num_obs_history=2, state_dim=ROBOT + 39, action_dim=4, action_horizon=4,
                        image_size=128)
    for relative in (False, True):
        plain = PixelAuxCropFlowPolicy(cfg, None, global_size=96, relative=relative).eval()
        scaled = PixelAuxCropFlowPolicy(cfg, None, global_size=96, relative=relative, standardize=True)
        scaled.load_state_dict({**plain.state_dict(), **{k: v for k, v in scaled.state_dict().items()
                                                         if k.startswith("standardize.")}})
        state = torch.zeros(3, 2, 48)
        state[..., :ROBOT] = torch.tensor([0.0, 0.6, 0.15, 0.01, 0.6, 0.15, -0.01, 0.6, 0.15])
        batch = {"images": torch.randint(0, 256, (3, 2, 128, 128, 3), dtype=torch.uint8),
                 "image_mask": torch.tensor([[False, True], [True, True], [True, True]]), "state": state}
        with torch.no_grad():
            scaled.train().features(batch)  # statistics from one batch
            got, want = scaled.eval().features(batch), plain.features(batch)
        n = scaled.standardize.mean.numel() // (2 if relative else 1)  # the whole image's keypoints
        std = (scaled.standardize.var + scaled.standardize.eps).sqrt()
        mask = batch["image_mask"].repeat_interleave(n // 2, dim=1).float()
        rest = slice(n, want.shape[1] - (n if relative else 0))  # crop keypoints and robot state
        assert torch.allclose(got[:, :n], (want[:, :n] - scaled.standardize.mean[:n]) / std[:n] * mask, atol=1e-5)
        assert torch.equal(got[:, rest], want[:, rest])
        assert (got[0, :n // 2] == 0).all() and (got[:, :n].abs().max() > 0.5)
        if relative:
            assert torch.allclose(got[:, -n:], (want[:, -n:] - scaled.standardize.mean[n:]) / std[n:] * mask,
                                  atol=1e-5)


def test_the_hand_crop_policy_projects_the_world_as_the_camera_renders_it(make_cfg):
    """slurmvla_metaworld_study/hand_crop/model.py: its camera is the one the environment renders, its projection puts a visible
    part where MuJoCo's segmentation render shows it, its crop is the image's pixels around a point, and
    ``policy=keypoints_flow_crop`` builds it from the camera's full frame or says why not."""
    import mujoco
    import torch
    from slurmvla_metaworld_study.hand_crop.model import (
        HandCropFlowPolicy,
        HandCropPolicy,
        crop_around,
        project,
    )

    from slurmvla.policy import build_policy
    from slurmvla.policy.flow_vla.config import FlowVLAConfig
    from slurmvla.sim.metaworld.env import CAMERA, CAMERA_FOVY, CAMERA_POSITION, CAMERA_ROTATION

    env = MetaWorld("disassemble-v3", height=128, width=128)
    try:
        env.reset(3)
        robot = env.state()  # the hand and its fingertips, in view
        model, data = env.env.model, env.env.data
        cam = model.camera(CAMERA).id
        np.testing.assert_allclose(data.cam_xpos[cam], CAMERA_POSITION, atol=1e-9)
        np.testing.assert_allclose(data.cam_xmat[cam].reshape(3, 3), CAMERA_ROTATION, atol=1e-9)
        assert model.cam_fovy[cam] == CAMERA_FOVY
        renderer = mujoco.Renderer(model, 128, 128)
        renderer.enable_segmentation_rendering()
        renderer.update_scene(data, camera=CAMERA)
        seg = renderer.render()[..., 0]  # each pixel's geom
        renderer.close()
        visible = [g for g in range(model.ngeom) if (seg == g).any()]
        uv = project(torch.tensor(data.geom_xpos[visible]), 128).numpy()
        inside = [(g, u, v) for g, (u, v) in zip(visible, uv, strict=True) if 0 <= u < 128 and 0 <= v < 128]
        on_itself = sum(seg[int(v), int(u)] == g for g, u, v in inside)
        # A geom's centre may be hidden behind another or lie outside a mesh; most are where they show. (Upside down,
        # or with another field of view, none of 14 is.)
        assert len(inside) >= 8 and on_itself >= len(inside) / 3, (on_itself, len(inside))
    finally:
        env.close()

    # The crop of a pixel square at its own resolution is that square of the image, outside it zeros.
    image = torch.arange(2 * 3 * 32 * 32, dtype=torch.float32).view(2, 3, 32, 32)
    out = crop_around(image, torch.tensor([[10.0, 20.0], [0.0, 16.0]]), 4, 4)
    assert torch.equal(out[0], image[0, :, 18:22, 8:12])
    assert torch.equal(out[1, :, :, 2:], image[1, :, 14:18, 0:2]) and not out[1, :, :, :2].any()

    # The crop follows the fingertips, each frame its own step's; the whole image's keypoints do not move.
    torch.manual_seed(0)
    cfg = FlowVLAConfig(num_cameras=1, num_obs_history=2, state_dim=9, action_dim=4, action_horizon=4,
                        image_size=128)
    policy = HandCropFlowPolicy(cfg, None, crop=48, crop_size=32, global_size=48, spatial_norm=True).eval()
    state = torch.tensor(robot).repeat(3, 2, 1)
    batch = {"images": torch.randint(0, 256, (3, 2, 128, 128, 3), dtype=torch.uint8),
             "image_mask": torch.ones(3, 2, dtype=torch.bool), "state": state}
    noise = torch.randn(3, 4, 4)
    acts = policy.sample_actions(batch, noise=noise)
    whole = policy.features(batch)[:, :2 * 2 * 16]
    moved = state.clone()
    moved[..., 3:9] += 0.05
    assert torch.equal(policy.features({**batch, "state": moved})[:, :2 * 2 * 16], whole)  # the whole image's
    assert (policy.features({**batch, "state": moved}) - policy.features(batch)).abs().max() > 1e-3
    later = state.clone()
    later[:, 1, 3:9] += 0.05  # the second frame's fingertips only: its crop moves, the first frame's stays
    crops = policy.features(batch)[:, 64:128].view(3, 2, 32)
    crops_later = policy.features({**batch, "state": later})[:, 64:128].view(3, 2, 32)
    assert torch.equal(crops_later[:, 0], crops[:, 0]) and (crops_later[:, 1] - crops[:, 1]).abs().max() > 1e-3
    train = {**batch, "actions": torch.randn(3, 4, 4), "action_mask": torch.ones(3, 4, dtype=torch.bool),
             "noise": noise, "time_u": torch.rand(3)}
    assert policy.train()(train)["loss"].isfinite() and acts.shape == (3, 4, 4)
    regression = HandCropPolicy(cfg, None, crop=48, crop_size=32, global_size=48, spatial_norm=True).eval()
    assert regression.sample_actions(batch).shape == (3, 4, 4) and regression.train()(train)["loss"].isfinite()
    # Without the robot's numbers in the features, only the images (and where the crop is cut) move an action.
    blind = HandCropFlowPolicy(cfg, None, crop=48, crop_size=32, global_size=48, robot_state=False).eval()
    assert blind.features(batch).shape == (3, blind.feature_dim) == (3, 2 * 2 * 2 * 16)
    hand = state.clone()
    hand[..., :3] += 1.0  # the hand, not the fingertips: the crop stays where it was
    assert torch.equal(blind.sample_actions({**batch, "state": hand}, noise=noise), blind.sample_actions(batch, noise=noise))

    # The shipped config: the experiment's 96 px frames are refused by name, the camera's own 128 build the table's
    # policy (a 24 px crop beside the whole image at 96).
    with pytest.raises(ValueError, match=r"policy.image_size=96: .* set policy.image_size=128"):
        build_policy(make_cfg("experiment=metaworld", "policy=keypoints_flow_crop").policy)
    built = build_policy(make_cfg("experiment=metaworld", "policy=keypoints_flow_crop", "policy.image_size=128").policy)
    assert isinstance(built, HandCropFlowPolicy) and (built.crop, built.crop_size, built.global_size) == (24, 64, 96)
    # policy=keypoints_flow_labelled: the recipe of the last protocol table, from the experiment's training labels.
    from slurmvla_metaworld_study.labelled_keypoints.model import LabelledKeypointFlowPolicy
    labelled_cfg = make_cfg("experiment=metaworld", "policy=keypoints_flow_labelled", "policy.image_size=128")
    assert list(labelled_cfg.data.label_keys) == ["observation.environment_state"]
    assert list(labelled_cfg.serve.state) == ["observation/state"] and labelled_cfg.policy.state_dim == 9
    labelled = build_policy(labelled_cfg.policy)
    assert isinstance(labelled, LabelledKeypointFlowPolicy) and labelled.global_size == 128
    assert (labelled.aux_weight, labelled.relative, labelled.standardize is not None) == (10.0, True, True)


class _Still(ExpertPolicy):
    """An arm that never moves (the expert's metadata, a zero action every step)."""

    def infer(self, obs: dict) -> dict:
        return {"actions": np.zeros((1, 4))}


def test_a_rollout_tells_how_far_its_failed_episodes_got():
    """Each episode's diagnostics against what is known without them: an arm that never moves comes near nothing,
    grasps nothing, moves nothing and leaves the mug where the reset put it (its distance to the goal computed here
    from the 39 numbers); the scripted expert's successes come near the mug, move it and bring it within
    Meta-World's 7 cm. The summary counts the failed episodes' flags, and the rollout prints them."""
    from slurmvla.inference.closed_loop import run_served, summarize
    from slurmvla.inference.server import PolicyServer
    from slurmvla.rollout import _failures_line

    task, seeds = "coffee-pull-v3", [100000, 100001]
    env = MetaWorld(task, height=64, width=64)
    try:
        start = []
        for seed in seeds:
            env.reset(seed)
            s = env.env_state()
            start.append(float(np.linalg.norm(s[4:7] - s[36:39])))
    finally:
        env.close()

    def served(policy: ExpertPolicy, steps: int) -> list[dict]:
        cfg = RolloutConfig(env="metaworld", task=task, episodes=len(seeds), first_seed=seeds[0], max_steps=steps,
                            replan_steps=1, height=64, width=64, videos=0)
        return run_served(PolicyServer(policy, "127.0.0.1", 0), cfg, seeds, None)

    still = served(_Still(task), 30)
    for episode, distance in zip(still, start):
        d = episode["diagnostics"]
        assert not episode["success"]
        assert (d["near_object"], d["grasped"], d["moved_object"]) == (False, False, False)
        assert d["start_to_goal_m"] == pytest.approx(distance, abs=1e-9)
        assert d["closest_to_goal_m"] == pytest.approx(distance, abs=1e-3)  # the mug settles by < 1 mm
    expert = served(ExpertPolicy(task), 120)
    for episode in expert:
        d = episode["diagnostics"]
        assert episode["success"] and d["near_object"] and d["moved_object"]
        assert d["closest_to_goal_m"] <= 0.07

    failures = summarize(still + expert, 1.0)["failures"]
    assert {k: v for k, v in failures.items() if not k.endswith("_m")} == {
        "episodes": 2, "near_object": 0, "grasped": 0, "moved_object": 0}
    assert failures["start_to_goal_m"] == pytest.approx(float(np.median(start)), abs=1e-9)
    assert failures["closest_to_goal_m"] == pytest.approx(float(np.median(start)), abs=1e-3)
    assert _failures_line(failures) == (f"\nof the 2 failed episodes: near object 0, grasped 0, moved object 0, "
                                        f"start to goal {failures['start_to_goal_m']:.3f} m (median), "
                                        f"closest to goal {failures['closest_to_goal_m']:.3f} m (median)")
    assert "failures" not in summarize([{k: v for k, v in e.items() if k != "diagnostics"} for e in still], 1.0)
