"""Training-time real-time chunking (policy.rtc_training; slurmvla/policy/rtc.py): the delays against their
distribution by hand, a clean prefix that never reads its noise and leaves the loss, a time per action that
equals the shared time when all agree (so d = 0 trains the plain model), and serving by conditioning: the
served chunk starts with the previous chunk's actions, with no guidance. Every engine and LoRA: the parity
matrix (tests/test_distributed.py) trains its frozen and LoRA cells with it."""

from __future__ import annotations

import math

import pytest
import torch

from slurmvla.config.policy import RTCTrainingConfig
from slurmvla.policy import build_policy
from slurmvla.policy.flow_vla.config import FlowVLAConfig
from slurmvla.policy.rtc import Guidance, delay_probabilities, draw_delays, prefix_mask
from tests.policy.test_policy import make_batch

DELAYS = RTCTrainingConfig(max_delay=3)


def test_delays_follow_the_configured_distribution():
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    for cfg, want in [(RTCTrainingConfig(max_delay=3), [0.25] * 4),
                      (RTCTrainingConfig(min_delay=1, max_delay=4, distribution="exp", exp_decay=0.5),
                       [math.exp(-0.5 * k) / sum(math.exp(-0.5 * j) for j in range(4)) for k in range(4)])]:
        torch.testing.assert_close(delay_probabilities(cfg), torch.tensor(want, dtype=torch.float64))
        d = draw_delays(u, cfg)
        assert d.min() == cfg.min_delay and d.max() == cfg.max_delay
        share = torch.bincount(d - cfg.min_delay, minlength=4).double() / len(u)
        # 200k draws: the standard error of each share is below 0.0012; 0.006 is five of them.
        assert (share - torch.tensor(want, dtype=torch.float64)).abs().max() < 0.006, share
    # The inverse CDF at its edges, by hand: [0, 0.25) -> 0, [0.25, 0.5) -> 1, ..., up to 1 -> 3.
    edges = torch.tensor([0.0, 0.2499, 0.25, 0.5, 0.74999, 0.75, 0.9999999])
    assert draw_delays(edges, DELAYS).tolist() == [0, 0, 1, 2, 2, 3, 3]


def flow_vla(rtc: RTCTrainingConfig | None = None):
    torch.manual_seed(0)
    cfg = FlowVLAConfig(rtc_training=rtc or RTCTrainingConfig())
    return cfg, build_policy(cfg)


def pi0(name: str, rtc: RTCTrainingConfig | None = None):
    from tests.policy.test_pi0 import perturbed_policy

    cfg, policy = perturbed_policy(name, rtc_training=rtc or RTCTrainingConfig())
    return cfg, policy.train()


def keypoints(rtc: RTCTrainingConfig | None = None):
    """The keypoint flow policy with a velocity head (its loss is flow matching's on the velocity, as the
    others'; its default x-prediction head: tests/sim/test_sim.py)."""
    from slurmvla.policy.keypoints.model import KeypointFlowPolicy

    torch.manual_seed(0)
    cfg = FlowVLAConfig(rtc_training=rtc or RTCTrainingConfig(), num_cameras=3, image_size=32)
    return cfg, KeypointFlowPolicy(cfg, None, prediction="velocity")


POLICIES = {"flow_vla": flow_vla, "pi0_tiny": lambda rtc=None: pi0("pi0_tiny", rtc),
            "pi05_tiny": lambda rtc=None: pi0("pi05_tiny", rtc), "keypoints_flow": keypoints}


def training_batch(name: str, cfg) -> dict:  # noqa: ANN001
    if name.startswith("pi0"):
        from tests.policy.test_pi0 import batch_for

        batch = batch_for(cfg)
    else:
        batch = make_batch(b=3, cfg=cfg)
        g = torch.Generator().manual_seed(5)
        batch["noise"] = torch.randn(batch["actions"].shape, generator=g)
        batch["time_u"] = torch.rand(3, generator=g)
    # Delays 0, 2 and 3 (uniform over 0..3: u in [0, .25) -> 0, [.5, .75) -> 2, [.75, 1) -> 3).
    batch["delay_u"] = torch.tensor([0.1, 0.6, 0.9])
    return batch


def velocity_of(name: str, policy, batch: dict):  # noqa: ANN001
    """The policy's velocity at (x_t, t) for this batch, ``t`` shared ``[B]`` or per action ``[B, H]``."""
    if name == "keypoints_flow":
        features = policy.features(batch)
        return lambda x, t: policy.velocity(features, x, t)
    if name == "flow_vla":
        prefix, keep = policy._prefix(batch)
        return lambda x, t: policy._velocity(prefix, keep, x, t)
    prefix, keep = policy._prefix(batch)
    return lambda x, t: policy._velocity(prefix, keep, batch, x, t)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_time_per_action_equal_everywhere_is_the_shared_time(name):
    """A time per action ([B, H], training-time RTC's input) that is the same for every action gives the
    velocity of the shared time ([B]), to rounding: d = 0 trains the plain model (the keypoint head reads
    the times as an input of its own, so it is compared with itself)."""
    if name.startswith("pi0"):
        pytest.importorskip("transformers")
    cfg, policy = POLICIES[name](DELAYS if name == "keypoints_flow" else None)
    batch = training_batch(name, cfg)
    velocity = velocity_of(name, policy, batch)
    x = batch["noise"]
    t = torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        shared = velocity(x, t)
        per_action = velocity(x, t[:, None].expand(-1, x.shape[1]).contiguous())
        other = velocity(x, torch.where(prefix_mask(torch.tensor([0, 2, 3]), x.shape[1]), 0.0, t[:, None]))
    torch.testing.assert_close(per_action, shared, rtol=1e-5, atol=1e-6)
    # ... and the time does reach each action: a zero time on a prefix changes the velocity.
    assert not torch.allclose(other[1:], shared[1:], atol=1e-4)


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_clean_prefix_reads_no_noise_and_leaves_the_loss(name):
    if name.startswith("pi0"):
        pytest.importorskip("transformers")
    cfg, policy = POLICIES[name](DELAYS)
    batch = training_batch(name, cfg)
    loss = policy(batch)
    h = batch["actions"].shape[1]
    prefix = prefix_mask(torch.tensor([0, 2, 3]), h)
    # The noise on the prefix (samples 1 and 2) is never read: another noise there, the same loss, bit for bit.
    noisy = dict(batch, noise=torch.where(prefix[..., None], torch.randn_like(batch["noise"]) * 5, batch["noise"]))
    assert torch.equal(policy(noisy)["loss"], loss["loss"])
    # The prefix's own actions are inputs (clean, at time 0), not targets: moving them changes the loss, and the
    # per-sample error counts only the rest. The count is what the loss is divided by per sample: the valid
    # actions after the prefix, times the action dims.
    moved = dict(batch, actions=torch.where(prefix[..., None], batch["actions"] + 3.0, batch["actions"]))
    assert not torch.equal(policy(moved)["loss"], loss["loss"])
    _, count = loss["components"]["mse"]
    valid = batch["action_mask"].bool() if not name.startswith("pi0") else torch.ones(3, h, dtype=torch.bool)
    want = (valid & ~prefix).sum(dim=1) * cfg.action_dim
    assert count.tolist() == want.tolist()
    # By hand: the squared error of the velocity at the hand-built chunk (clean prefix at time 0, the rest
    # t * noise + (1 - t) * actions), over the actions after the prefix, divided by every element's count.
    actions = policy.normalize_actions(batch["actions"]) if hasattr(policy, "normalize_actions") else \
        (batch["actions"] - policy.action_offset) / policy.action_scale
    dims, noise = actions.shape[-1], batch["noise"]
    padded = torch.nn.functional.pad(actions, (0, noise.shape[-1] - dims))  # pi0: zeros up to max_action_dim
    t = batch["time_u"].pow(1 / 1.5) * 0.999 + 0.001
    times = torch.where(prefix, 0.0, t[:, None])
    x_t = torch.where(prefix[..., None], padded, t[:, None, None] * noise + (1 - t[:, None, None]) * padded)
    pred = velocity_of(name, policy, batch)(x_t, times)[..., :dims]
    keep = (valid & ~prefix)[..., None]
    want_loss = ((pred - (noise[..., :dims] - actions)).square() * keep).sum() / pred.numel()
    torch.testing.assert_close(loss["loss"], want_loss, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_policy_trained_for_delays_serves_rtc_by_its_prefix_without_guidance(name):
    if name.startswith("pi0"):
        pytest.importorskip("transformers")
    cfg, policy = POLICIES[name](DELAYS)
    policy.eval()
    batch = training_batch(name, cfg)
    for key in ("noise", "time_u", "delay_u", "actions", "action_mask"):
        batch.pop(key)
    if name.startswith("pi0"):
        batch = policy.prepare_inference(batch)
    b, h, dims = 3, cfg.action_horizon, cfg.action_dim
    width = getattr(cfg, "max_action_dim", dims)
    noise = torch.randn(b, h, width, generator=torch.Generator().manual_seed(1))
    prev = torch.randn(b, h, dims, generator=torch.Generator().manual_seed(2)) * 2
    plain = policy.sample_actions(batch, noise=noise)

    def rtc(d: int, beta: float) -> Guidance:
        return Guidance(prev, torch.full((b,), d), torch.full((b,), 6), beta)

    # Delay 0: no prefix, the plain chunk.
    torch.testing.assert_close(policy.sample_actions(batch, noise=noise, rtc=rtc(0, 5.0)), plain, rtol=1e-5, atol=1e-6)
    served = policy.sample_actions(batch, noise=noise, rtc=rtc(2, 5.0))
    assert torch.equal(served[:, :2], prev[:, :2])
    # No guidance: its weight changes nothing.
    assert torch.equal(policy.sample_actions(batch, noise=noise, rtc=rtc(2, 0.0)), served)
    # The prefix conditions the rest: by hand, Euler steps on the velocity with the prefix clean at time 0.
    velocity = velocity_of(name, policy, batch)
    target = torch.nn.functional.pad((prev - policy.action_offset) / policy.action_scale, (0, width - dims))
    mask = prefix_mask(torch.full((b,), 2), h)[..., None]
    x, steps = noise.clone(), cfg.num_inference_steps
    with torch.no_grad():
        for i in range(steps):
            x = torch.where(mask, target, x)
            t = torch.full((b,), 1.0 - i / steps)
            x = x - velocity(x, torch.where(mask[..., 0], 0.0, t[:, None])).float() / steps
    by_hand = x[..., :dims] * policy.action_scale + policy.action_offset
    torch.testing.assert_close(served[:, 2:], by_hand[:, 2:], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(served[:, 2:], plain[:, 2:], atol=1e-4)


def test_a_policy_without_training_time_rtc_refuses_it():
    from slurmvla.policy.base import as_policy_class, construct
    from slurmvla.policy.keypoints.model import KeypointPolicy

    cfg = FlowVLAConfig(rtc_training=DELAYS)
    with pytest.raises(ValueError, match=r"policy.rtc_training.max_delay=3: slurmvla.policy.keypoints.model.KeypointPolicy does "
                                         r"not support training-time real-time chunking"):
        construct(as_policy_class(KeypointPolicy), cfg, None)  # construct takes policy_class's


def test_the_server_says_how_it_answers_rtc(tmp_path):
    from slurmvla.compose import compose
    from slurmvla.inference.load import Loaded
    from slurmvla.inference.runner import PolicyRunner

    cfg = compose(["experiment=demo", f"data.root={tmp_path}", "policy.rtc_training.max_delay=3"])
    meta = PolicyRunner(Loaded(build_policy(cfg.policy).eval(), cfg, 0, "test")).metadata()
    assert meta["execution_modes"] == ["sync", "async", "rtc"]
    assert meta["rtc"] == {"method": "prefix", "trained_delays": [0, 3]}


def test_the_keypoint_flows_default_sample_head_trains_and_serves_a_clean_prefix():
    """x-prediction (the keypoint flow policy's default head): the prefix's velocity is never used (time 0), the
    loss is finite, and a served chunk starts with the previous chunk's actions, the rest finite."""
    from slurmvla.policy.keypoints.model import KeypointFlowPolicy

    torch.manual_seed(0)
    cfg = FlowVLAConfig(rtc_training=DELAYS, num_cameras=3, image_size=32)
    policy = KeypointFlowPolicy(cfg, None)
    batch = training_batch("keypoints_flow", cfg)
    assert torch.isfinite(policy(batch)["loss"])
    prev = torch.randn(3, cfg.action_horizon, cfg.action_dim)
    served = policy.eval().sample_actions(batch, rtc=Guidance(prev, torch.full((3,), 3), torch.full((3,), 6)))
    assert torch.equal(served[:, :3], prev[:, :3]) and torch.isfinite(served).all()
