"""Inference-time real-time chunking (slurmvla/policy/rtc.py) and its protocol keys (prev_actions, delay):
the weights against the paper's formulas by hand, guidance off (beta = 0) against plain sampling, the frozen
actions against the prefix, a two-mode toy flow whose analytic velocity is written here, and the server through
openpi's own client."""

from __future__ import annotations

import collections
import math
import re

import numpy as np
import pytest
import torch
from torch import nn

from slurmvla.compose import compose
from slurmvla.inference.harness import serving_in_thread
from slurmvla.inference.load import Loaded
from slurmvla.inference.runner import PolicyRunner, request_seed
from slurmvla.inference.server import PolicyServer
from slurmvla.policy import build_policy
from slurmvla.policy.base import supports_rtc
from slurmvla.policy.flow_vla.config import FlowVLAConfig
from slurmvla.policy.rtc import Guidance, guidance_weight, integrate, prefix_weights
from tests.policy.test_policy import make_batch


def guidance(prev: torch.Tensor, delay: int, overlap: int, beta: float = 5.0, schedule: str = "exp") -> Guidance:
    b = prev.shape[0]
    return Guidance(prev, torch.full((b,), delay), torch.full((b,), overlap), beta, schedule)


def test_prefix_weights_are_the_papers_soft_mask_by_hand():
    d, k, h = 2, 6, 8
    want = []
    for i in range(h):
        if i < d:
            want.append(1.0)
        elif i < k:
            c = (k - i) / (k - d + 1)
            want.append(c * (math.exp(c) - 1) / (math.e - 1))
        else:
            want.append(0.0)
    got = prefix_weights(torch.tensor([d, 0]), torch.tensor([k, 3]), h)
    torch.testing.assert_close(got[0], torch.tensor(want), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], torch.tensor([3 / 4 * math.expm1(3 / 4) / (math.e - 1),
                                                     2 / 4 * math.expm1(2 / 4) / (math.e - 1),
                                                     1 / 4 * math.expm1(1 / 4) / (math.e - 1), 0, 0, 0, 0, 0]))
    assert prefix_weights(torch.tensor([2]), torch.tensor([6]), h, "zeros")[0].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert prefix_weights(torch.tensor([2]), torch.tensor([6]), h, "ones")[0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("t", [1.0, 0.9, 0.5, 0.3, 0.1, 0.02])
def test_guidance_weight_is_the_papers_clipped_weight_in_its_time(t):
    tau = 1 - t  # the paper's time: 0 noise, 1 actions
    r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
    want = 5.0 if tau == 0 else min(5.0, (1 - tau) / (tau * r2))
    assert guidance_weight(t, 5.0) == pytest.approx(want, rel=1e-12)
    assert guidance_weight(t, 0.0) == 0.0


# -- a toy flow with two modes: every chunk is all +1 or all -1, half and half -------------------------------

class TwoModes(nn.Module):
    """The exact velocity of the target {+1, -1} (whole chunk, equal odds) under x_t = t noise + (1 - t) a:
    the posterior of a given x_t weighs exp(-|x_t - (1 - t) a|^2 / (2 t^2)), and u = (x_t - E[a | x_t]) / t."""

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t[:, None, None]
        modes = torch.tensor([1.0, -1.0])
        logits = torch.stack([-(x - (1 - t) * a).square().sum(dim=(1, 2)) for a in modes], dim=1) / (2 * t[:, 0] ** 2)
        mean = (logits.softmax(dim=1) @ modes)[:, None, None]
        return (x - mean) / t


def test_plain_sampling_picks_either_mode_and_rtc_follows_the_previous_chunks():
    flow, h, seeds = TwoModes(), 8, 24
    noise = torch.randn(seeds, h, 1, generator=torch.Generator().manual_seed(0))
    plain = integrate(flow, noise, 10)
    signs = plain.mean(dim=(1, 2)).sign()
    assert (signs > 0).any() and (signs < 0).any()
    torch.testing.assert_close(plain.abs(), torch.ones_like(plain), rtol=0, atol=0.05)
    zero, one = torch.zeros(1), torch.ones(1)
    for mode in (1.0, -1.0):
        prev = torch.full((seeds, h, 1), mode)
        prev[:, 5:] = 0  # k = 5 rows of the previous chunk, padded
        guide = guidance(prev, 2, 5).guide(zero, one)
        chunk = guide.freeze(integrate(flow, noise, 10, guide))
        assert (chunk.mean(dim=(1, 2)).sign() == mode).all(), chunk.mean(dim=(1, 2))
        torch.testing.assert_close(chunk, torch.full_like(chunk, mode), rtol=0, atol=0.05)
    # Without guidance (beta = 0) the same loop is plain sampling, frozen rows aside.
    guide = guidance(torch.ones(seeds, h, 1), 0, h, beta=0.0).guide(zero, one)
    assert torch.equal(integrate(flow, noise, 10, guide), plain)


# -- the built-in policies ------------------------------------------------------------------------------

def flow_vla_case():
    torch.manual_seed(0)
    cfg = FlowVLAConfig()
    policy = build_policy(cfg).eval()
    policy.action_offset.uniform_(-1, 1)
    policy.action_scale.uniform_(0.5, 2)
    batch = make_batch(b=2, cfg=cfg)
    return policy, batch, (2, cfg.action_horizon, cfg.action_dim)


def pi0_case(name):
    from tests.policy.test_pi0 import batch_for, perturbed_policy

    cfg, policy = perturbed_policy(name)
    policy.action_offset.uniform_(-1, 1)
    policy.action_scale.uniform_(0.5, 2)
    batch = batch_for(cfg)
    del batch["noise"]
    return policy, batch, (batch["state"].shape[0], cfg.action_horizon, cfg.max_action_dim)


CASES = {"flow_vla": flow_vla_case, "pi0_tiny": lambda: pi0_case("pi0_tiny"), "pi05_tiny": lambda: pi0_case("pi05_tiny")}


@pytest.mark.parametrize("name", list(CASES))
def test_without_guidance_rtc_is_plain_sampling_and_the_frozen_actions_are_the_prefix(name):
    if name != "flow_vla":
        pytest.importorskip("transformers")
    policy, batch, shape = CASES[name]()
    assert supports_rtc(policy)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    plain = policy.sample_actions(batch, noise=noise)
    b, h, dims = plain.shape
    prev = torch.randn(b, h, dims, generator=torch.Generator().manual_seed(2)) * 3
    # beta = 0 and no delay: guidance computed and weighted by zero, the same chunk.
    off = policy.sample_actions(batch, noise=noise, rtc=guidance(prev, 0, h, beta=0.0))
    torch.testing.assert_close(off, plain, rtol=1e-6, atol=1e-6)
    d = 3
    frozen = policy.sample_actions(batch, noise=noise, rtc=guidance(prev, d, 5, beta=0.0))
    assert torch.equal(frozen[:, :d], prev[:, :d])
    torch.testing.assert_close(frozen[:, d:], plain[:, d:], rtol=1e-6, atol=1e-6)
    guided = policy.sample_actions(batch, noise=noise, rtc=guidance(prev, d, 5))
    assert torch.equal(guided[:, :d], prev[:, :d]) and torch.isfinite(guided).all()
    # The guided overlap is pulled towards the previous chunk.
    assert (guided[:, d:5] - prev[:, d:5]).norm() < (plain[:, d:5] - prev[:, d:5]).norm()
    # Plain sampling is untouched by the feature: the same numbers as before, bit for bit.
    assert torch.equal(policy.sample_actions(batch, noise=noise), plain)


def test_the_graphed_sampler_replays_rtc_requests_from_static_tensors_or_runs_them_eagerly(caplog):
    """An RTC request's previous chunk, delay and overlap are static inputs of its own graph: the graph's function
    rebuilt from them gives the policy's guided chunk. Where its capture fails (here: no GPU), that shape's RTC
    requests run eagerly with one warning (the graphed answer on a GPU: tests/test_gpu.py)."""
    pytest.importorskip("transformers")
    from slurmvla.inference.graphs import RTC_FIELDS, GraphedSampler

    policy, batch, shape = pi0_case("pi0_tiny")
    sampler = object.__new__(GraphedSampler)  # its constructor needs a GPU
    sampler.policy, sampler.graphs, sampler.eager, sampler.warmup = policy, collections.OrderedDict(), set(), 1
    noise = torch.randn(shape)
    prev = torch.randn(shape[0], shape[1], policy.cfg.action_dim)
    rtc = guidance(prev, 2, 6)
    prepared = policy.prepare_inference(batch)
    want = policy.sample_actions(prepared, noise=noise, rtc=rtc)
    static = {**prepared, **dict(zip(RTC_FIELDS, (rtc.prev_actions, rtc.delay, rtc.overlap), strict=True))}
    assert torch.equal(sampler._run(static, noise, (rtc.max_guidance, rtc.schedule)), want)
    with caplog.at_level("WARNING"):
        assert torch.equal(sampler.sample_actions(batch, noise, rtc=rtc), want)
        assert torch.equal(sampler.sample_actions(batch, noise, rtc=rtc), want)
    assert not sampler.graphs and len(sampler.eager) == 1
    assert sum("run eagerly" in r.message for r in caplog.records) == 1


# -- the protocol -----------------------------------------------------------------------------------------

def demo_runner(root, *overrides: str) -> PolicyRunner:
    """The demo's tiny policy behind a runner (serve.seed=7), its action statistics moved off the identity."""
    cfg = compose(["experiment=demo", f"data.root={root}", "serve.seed=7", *overrides])
    torch.manual_seed(0)
    policy = build_policy(cfg.policy).eval()
    with torch.no_grad():
        policy.action_offset.uniform_(-1, 1)
        policy.action_scale.uniform_(0.5, 2)
    return PolicyRunner(Loaded(policy, cfg, 0, "test"))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return demo_runner(tmp_path_factory.mktemp("unused"))


def droid_obs(runner: PolicyRunner, seed: int) -> dict:
    g = np.random.default_rng(seed)
    size = runner.spec.image_size
    return {"observation/exterior_image_1_left": g.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "observation/wrist_image_left": g.integers(0, 256, (size, size, 3), dtype=np.uint8),
            "observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
            "prompt": "pick up the cup"}


def plain_chunk(runner: PolicyRunner, obs: dict, rtc: Guidance | None = None) -> np.ndarray:
    """The chunk without the server: the batch as the runner reads it, the noise drawn from serve.seed as
    seeded_sample_actions draws it, sample_actions called here."""
    batch = runner.processor.batch(collections.deque([runner.processor.read(obs)]))
    pc = runner.cfg.policy
    g = torch.Generator().manual_seed(request_seed(7, batch))
    noise = torch.randn((1, pc.action_horizon, pc.action_dim), generator=g)
    with torch.no_grad():
        return runner.policy.sample_actions(batch, noise=noise, **({"rtc": rtc} if rtc else {}))[0].numpy()


def test_the_server_serves_rtc_requests_and_refuses_bad_ones_through_openpis_client(runner):
    wcp = pytest.importorskip("openpi_client.websocket_client_policy")
    pc = runner.cfg.policy
    h, dims = pc.action_horizon, pc.action_dim
    obs = droid_obs(runner, 0)
    prev = np.random.default_rng(1).normal(size=(6, dims))
    with serving_in_thread(PolicyServer(runner, "127.0.0.1", 0)) as port:
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        meta = client.get_server_metadata()
        assert meta["execution_modes"] == ["sync", "async", "rtc"]
        assert meta["rtc"] == {"method": "guidance", "max_guidance": 5.0, "schedule": "zeros", "jacobian": "identity",
                               "guided_dims": None}
        # A client that sends neither key (or delay 0 alone) gets today's chunk, bit for bit.
        want = plain_chunk(runner, obs)
        np.testing.assert_array_equal(client.infer(obs)["actions"], want)
        np.testing.assert_array_equal(client.infer({**obs, "delay": 0})["actions"], want)
        got = client.infer({**obs, "prev_actions": prev, "delay": 2})["actions"]
        np.testing.assert_array_equal(got[:2], prev[:2].astype(np.float32))
        padded = torch.zeros(1, h, dims)
        padded[0, :6] = torch.from_numpy(prev).float()
        # serve.rtc_schedule's and serve.rtc_jacobian's defaults
        rtc = Guidance(padded, torch.tensor([2]), torch.tensor([6]), schedule="zeros", jacobian="identity")
        np.testing.assert_allclose(got, plain_chunk(runner, obs, rtc), rtol=1e-5, atol=1e-6)
        # The hard mask guides the delay's actions only, and through them the rest of the chunk moves too; with
        # no delay nothing is guided: the plain chunk, bit for bit.
        assert np.abs(got[2:] - want[2:]).max() > 1e-3
        np.testing.assert_array_equal(client.infer({**obs, "prev_actions": prev, "delay": 0})["actions"], want)
        bad = [({"prev_actions": prev[:, :3], "delay": 1}, f"prev_actions: expected numbers shaped [k, {dims}]"),
               ({"prev_actions": np.zeros((h + 1, dims)), "delay": 1}, "prev_actions: expected numbers shaped"),
               ({"prev_actions": np.full((6, dims), np.nan), "delay": 1}, "prev_actions hold NaN or inf"),
               ({"prev_actions": np.zeros((h, dims)), "delay": h}, f"delay={h}: expected 0 <= delay <= {h}"),
               ({"prev_actions": prev, "delay": 7}, "delay=7: expected 0 <= delay <= 6"),
               ({"prev_actions": prev, "delay": 1.5}, "delay: expected an integer"),
               ({"delay": 2}, "delay=2 without prev_actions")]
        for extra, expected in bad:
            client = wcp.WebsocketClientPolicy("127.0.0.1", port)
            with pytest.raises(RuntimeError, match="bad request: " + re.escape(expected)):
                client.infer({**obs, **extra})
        # Another connection keeps being served, plainly and with RTC.
        client = wcp.WebsocketClientPolicy("127.0.0.1", port)
        np.testing.assert_array_equal(client.infer(obs)["actions"], want)
        np.testing.assert_array_equal(client.infer({**obs, "prev_actions": prev, "delay": 2})["actions"], got)


def test_a_policy_without_rtc_offers_no_rtc_and_refuses_prev_actions(runner):
    class Plain(type(runner.policy)):
        supports_rtc = False

    plain = Plain.__new__(Plain)
    plain.__dict__.update(runner.policy.__dict__)
    other = PolicyRunner(Loaded(plain, runner.cfg, 0, "test"))
    assert other.metadata()["execution_modes"] == ["sync", "async"] and "rtc" not in other.metadata()
    obs = droid_obs(runner, 0)
    np.testing.assert_array_equal(other.infer(obs)["actions"], plain_chunk(runner, obs))
    with pytest.raises(ValueError, match="does not support real-time chunking"):
        other.infer({**obs, "prev_actions": np.zeros((4, runner.cfg.policy.action_dim)), "delay": 1})


@pytest.mark.parametrize("over, error", [("serve.rtc_max_guidance=-1", "serve.rtc_max_guidance=-1"),
                                         ("serve.rtc_schedule=cosine", "serve.rtc_schedule='cosine'")])
def test_bad_rtc_options_name_themselves(tmp_path, over, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        compose(["experiment=demo", f"data.root={tmp_path}", over])


@pytest.mark.parametrize("jacobian", ["model", "identity"])
@pytest.mark.parametrize("guided_dims", [None, (0, 2)])
def test_guidance_variants_match_a_hand_computation(jacobian, guided_dims):
    """One guided step on a linear velocity ``u(x) = x A + c`` (actions mixing through A), against the formula:
    the clean estimate ``x - t u``, the error ``(Y - clean) * W`` (W: the schedule's weight per action, zero on
    unguided dims), pulled back through ``I - t A`` (``model``) or not at all (``identity``), scaled by the
    clipped guidance weight."""
    g = torch.Generator().manual_seed(0)
    h, d, t = 5, 3, 0.6
    a, c = torch.randn(d, d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    x, prev = torch.randn(1, h, d, generator=g, dtype=torch.float64), torch.randn(1, h, d, generator=g, dtype=torch.float64)
    rtc = Guidance(prev, torch.tensor([1]), torch.tensor([4]), 5.0, "exp", jacobian, guided_dims)
    guide = rtc.guide(torch.zeros(d, dtype=torch.float64), torch.ones(d, dtype=torch.float64))
    got = guide.velocity(lambda xt: xt.double() @ a + c, x, t)

    u = x @ a + c
    w = prefix_weights(torch.tensor([1]), torch.tensor([4]), h, "exp")[0][:, None].double().expand(h, d).clone()
    if guided_dims is not None:
        w[:, [i for i in range(d) if i not in guided_dims]] = 0
    error = (prev - (x - t * u)) * w
    pull = error @ (torch.eye(d, dtype=torch.float64) - t * a).T if jacobian == "model" else error
    want = u - guidance_weight(t, 5.0) * pull
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    if jacobian == "identity" and guided_dims is not None:
        torch.testing.assert_close(got[..., 1].double(), u[..., 1], rtol=1e-6, atol=1e-6)  # an unguided dim: the policy's


def test_guidance_settings_name_their_value_and_choices():
    prev = torch.zeros(1, 4, 3)
    with pytest.raises(ValueError, match=r"rtc jacobian='none' is not one of \['model', 'identity'\]"):
        Guidance(prev, torch.tensor([0]), torch.tensor([2]), jacobian="none")
    with pytest.raises(ValueError, match=r"rtc guided_dims=\[0, 3\]: each must be an action dim in 0..2"):
        Guidance(prev, torch.tensor([0]), torch.tensor([2]), guided_dims=(0, 3))


def test_the_guidance_variants_are_serve_options_the_requests_carry(tmp_path):
    """serve.rtc_jacobian / serve.rtc_guided_dims / serve.rtc_schedule reach each request's guidance and the
    metadata; a model-Jacobian request (the paper's form; identity is the default) samples the chunk the hand-made
    Guidance gives; a dim beyond the actions is one line naming it."""
    runner = demo_runner(tmp_path, "serve.rtc_jacobian=model", "serve.rtc_guided_dims=[0,1,2]",
                         "serve.rtc_schedule=exp")
    pc = runner.cfg.policy
    prev = np.random.default_rng(1).normal(size=(4, pc.action_dim))
    obs = droid_obs(runner, 0)
    guidance = runner.read_rtc({"prev_actions": prev, "delay": 1}, runner.processor.read(obs).state)
    assert (guidance.jacobian, guidance.guided_dims, guidance.schedule) == ("model", (0, 1, 2), "exp")
    assert runner.rtc_metadata()["jacobian"] == "model" and runner.rtc_metadata()["guided_dims"] == [0, 1, 2]
    got = runner.session().infer({**obs, "prev_actions": prev, "delay": 1})["actions"]
    padded = torch.zeros(1, pc.action_horizon, pc.action_dim)
    padded[0, :4] = torch.from_numpy(prev).float()
    want = plain_chunk(runner, obs, Guidance(padded, torch.tensor([1]), torch.tensor([4]), jacobian="model",
                                             guided_dims=(0, 1, 2)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=rf"serve.rtc_guided_dims=\[0, {pc.action_dim}\] names dim {pc.action_dim}"):
        compose(["experiment=demo", f"data.root={tmp_path}", f"serve.rtc_guided_dims=[0,{pc.action_dim}]"])
    with pytest.raises(ValueError, match=r"serve.rtc_jacobian='none' is not one of model, identity"):
        compose(["experiment=demo", f"data.root={tmp_path}", "serve.rtc_jacobian=none"])


@pytest.mark.parametrize("experiment", ["sim_pick", "metaworld", "droid", "droid_small_gpu", "pi05_droid",
                                        "pi05_full_droid"])
def test_each_embodiment_leaves_its_gripper_unguided_by_default(experiment, tmp_path):
    """The defaults docs/serving.md gives: the identity Jacobian, and every action dim guided but the gripper's, the
    last one in DROID's action space (7 joints, then the gripper position) and in Meta-World's (the end effector's
    displacement, then the gripper's effort): the experiment that declares an embodiment says so."""
    # pi0.5's experiments read their statistics beside a checkpoint this test does not have.
    extra = ["policy.stats_source=data"] if experiment.startswith("pi05") else []
    cfg = compose([f"experiment={experiment}", f"data.root={tmp_path}", *extra])
    gripper = {"metaworld": 3}.get(experiment, 7)
    assert cfg.policy.action_dim == gripper + 1
    assert cfg.serve.rtc_jacobian == "identity"
    assert sorted(cfg.serve.rtc_guided_dims) == [d for d in range(cfg.policy.action_dim) if d != gripper]
