"""The reference policy against its contract, with independent references for each claim."""

from __future__ import annotations

import warnings

import pytest
import torch

from slurmvla.policy import attention, build_policy
from slurmvla.policy.flow_vla import model as flow_vla
from slurmvla.policy.flow_vla.config import FlowVLAConfig
from slurmvla.policy.tokenizer import tokenize


def make_batch(b: int = 4, cfg: FlowVLAConfig | None = None, seed: int = 0) -> dict:
    cfg = cfg or FlowVLAConfig()
    g = torch.Generator().manual_seed(seed)
    texts = [tokenize(["pick the cup", "open the drawer", "", "wipe"][i % 4], cfg.max_text_len) for i in range(b)]
    mask = torch.ones(b, cfg.action_horizon, dtype=torch.bool)
    mask[1:2, 5:] = False
    mask[2:3, 1:] = False
    return {
        "images": torch.randint(0, 256, (b, cfg.num_cameras, cfg.image_size, cfg.image_size, 3), generator=g, dtype=torch.uint8),
        "image_mask": torch.ones(b, cfg.num_cameras, dtype=torch.bool),
        "state": torch.randn(b, cfg.state_dim, generator=g),
        "actions": torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g),
        "action_mask": mask,
        "text": torch.stack([t for t, _ in texts]),
        "text_mask": torch.stack([m for _, m in texts]),
    }


def fixed_noise(batch, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch["actions"].shape, generator=g), torch.rand(batch["actions"].shape[0], generator=g)


def policy(**kw):
    torch.manual_seed(0)
    return build_policy(FlowVLAConfig(**kw))


def test_per_sample_sums_disaggregate_without_cross_contamination():
    p = policy()
    batch = make_batch()
    noise, t = fixed_noise(batch)
    out = p(batch, noise=noise, t=t)
    sums, counts = out["components"]["mse"]
    assert torch.allclose(out["loss"], sums.sum() / (4 * 64), rtol=1e-6)
    assert counts.tolist() == [64.0, 40.0, 8.0, 64.0]  # valid steps x 8 action dims
    for i in range(4):
        one = {k: v[i : i + 1] for k, v in batch.items()}
        alone = p(one, noise=noise[i : i + 1], t=t[i : i + 1])
        assert torch.allclose(alone["loss"], sums[i] / 64, rtol=1e-5, atol=1e-6)
        assert torch.allclose(alone["components"]["mse"][0], sums[i : i + 1], rtol=1e-5, atol=1e-6)


def test_loss_of_a_batch_is_the_mean_of_its_shards():
    """What makes DDP / accumulation equal to one big batch: shard losses average to the whole."""
    p = policy()
    batch = make_batch()
    noise, t = fixed_noise(batch)
    whole = p(batch, noise=noise, t=t)["loss"]
    halves = [p({k: v[s] for k, v in batch.items()}, noise=noise[s], t=t[s])["loss"] for s in (slice(0, 2), slice(2, 4))]
    assert torch.allclose(whole, (halves[0] + halves[1]) / 2, rtol=1e-6)


def test_noise_and_time_come_from_the_batch():
    p = policy()
    batch = make_batch()
    noise, u = fixed_noise(batch)
    explicit = p(batch, noise=noise, t=u.pow(1 / 1.5) * 0.999 + 0.001)["loss"]
    from_batch = p({**batch, "noise": noise, "time_u": u})["loss"]
    assert torch.equal(explicit, from_batch)


def test_loss_is_the_masked_mse_of_the_velocity_by_hand():
    """Recompute the flow-matching target and the masked MSE from the captured prediction: per sample
    (the validation components), and the scalar training loss bitwise (the bookkeeping changes nothing)."""
    p = policy()
    p.action_offset.uniform_(-1, 1)
    p.action_scale.uniform_(0.5, 2)
    batch = make_batch()
    noise, t = fixed_noise(batch)
    captured = {}
    p.expert_out.register_forward_hook(lambda m, i, o: captured.update(pred=o.detach()))
    out = p(batch, noise=noise, t=t)
    actions = (batch["actions"] - p.action_offset) / p.action_scale
    target = noise - actions
    m = batch["action_mask"]
    for i in range(4):
        err = (captured["pred"][i][m[i]] - target[i][m[i]]) ** 2
        assert torch.allclose(out["components"]["mse"][0][i], err.sum(), rtol=1e-5)
        assert out["components"]["mse"][1][i] == err.numel()
    mask = m[:, :, None].float().expand_as(target)
    plain = (((captured["pred"] - target) ** 2) * mask).sum(dim=(1, 2)).sum() / target.numel()
    assert torch.equal(out["loss"], plain)


def test_sdpa_and_eager_agree():
    batch = make_batch()
    noise, t = fixed_noise(batch)
    a = policy(attention_implementation="sdpa")(batch, noise=noise, t=t)["loss"]
    b = policy(attention_implementation="eager")(batch, noise=noise, t=t)["loss"]
    assert torch.allclose(a, b, rtol=1e-5)


def test_unavailable_attention_warns_once_and_falls_back():
    attention._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p1 = policy(attention_implementation="fa2")
        policy(attention_implementation="fa2")
    assert sum("falling back to 'sdpa'" in str(w.message) for w in caught) == 1
    assert p1.layers[0].impl == "sdpa"


def _grads(p, batch, noise, t):
    p.zero_grad()
    p(batch, noise=noise, t=t)["loss"].backward()
    return {n: q.grad.clone() for n, q in p.named_parameters() if q.grad is not None}


class CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def checkpointing_cases(grads_and_backward_matmuls, **base):
    """Every checkpointing setting gives the plain gradients; what it recomputes shows in the backward
    pass's matrix products: all of the forward's (every layer, inputs kept), about half (every other
    layer), none (matmul outputs kept), against the plain backward's count."""
    plain, plain_mm = grads_and_backward_matmuls(**base)
    counts = {}
    for name, kw in {"every layer": {}, "every 2nd": {"checkpoint_every": 2},
                     "matmuls kept": {"checkpoint_saves": "matmuls"}}.items():
        grads, counts[name] = grads_and_backward_matmuls(**base, gradient_checkpointing=True, **kw)
        assert grads.keys() == plain.keys(), name
        for n in plain:
            assert torch.allclose(plain[n], grads[n], rtol=1e-5, atol=1e-7), (name, n)
    assert counts["matmuls kept"] == plain_mm < counts["every 2nd"] < counts["every layer"], (plain_mm, counts)


def test_gradient_checkpointing_gives_the_same_gradients():
    batch = make_batch()
    noise, t = fixed_noise(batch)

    def run(**kw):
        p = policy(**kw)
        p.zero_grad()
        loss = p(batch, noise=noise, t=t)["loss"]
        with CountMatmuls() as counter:
            loss.backward()
        return {n: q.grad.clone() for n, q in p.named_parameters() if q.grad is not None}, counter.count

    checkpointing_cases(run, depth=4)


def test_every_parameter_gets_a_gradient():
    """No dead parameters: DDP would need find_unused_parameters, and Adam would drift on them."""
    p = policy()
    batch = make_batch()
    grads = _grads(p, batch, *fixed_noise(batch))
    assert set(grads) == {n for n, _ in p.named_parameters()}


def test_param_groups_partition_the_trainable_parameters():
    p = policy()
    groups = p.param_groups(weight_decay=0.1, lr=1e-3, backbone_lr_scale=0.5)
    assert [g["name"] for g in groups] == ["backbone_decay", "backbone_no_decay", "expert_decay", "expert_no_decay"]
    seen = [id(q) for g in groups for q in g["params"]]
    assert sorted(seen) == sorted(id(q) for q in p.parameters()) and len(seen) == len(set(seen))
    for g in groups:
        decay = g["name"].endswith("_decay") and not g["name"].endswith("no_decay")
        assert g["weight_decay"] == (0.1 if decay else 0.0)
        assert g["lr"] == (5e-4 if g["name"].startswith("backbone") else 1e-3)
        for name, q in zip(g["param_names"], g["params"]):
            assert (q.ndim <= 1 or name.endswith("_embedding")) == (not decay), name
            assert ("expert" in name) == g["name"].startswith("expert"), name


def test_freezing_options():
    p = policy(freeze_vision_encoder=True)
    names = {n for g in p.param_groups(0.1, 1e-3) for n in g["param_names"]}
    assert names and not any(n.startswith("vision.") for n in names) and any(n.startswith("layers.") for n in names)
    p = policy(train_expert_only=True)
    groups = p.param_groups(0.1, 1e-3)
    assert [g["name"] for g in groups] == ["expert_decay", "expert_no_decay"]
    batch = make_batch()
    grads = _grads(p, batch, *fixed_noise(batch))
    assert grads and all("expert" in n for n in grads)


def test_wrap_units_are_the_bundled_layers():
    p = policy()
    units = p.wrap_units()
    assert all(isinstance(u, (flow_vla.VLALayer, flow_vla.VisionBlock)) for u in units)
    assert sum(isinstance(u, flow_vla.VLALayer) for u in units) == p.cfg.depth
    layer = p.layers[0]
    assert hasattr(layer, "backbone_attn") and hasattr(layer, "expert_attn")


def test_sample_actions_returns_unnormalized_chunks():
    p = policy()
    p.action_offset.fill_(5.0)
    batch = make_batch(b=2)
    acts = p.sample_actions(batch, noise=torch.zeros(2, 8, 8), num_steps=3)
    assert acts.shape == (2, 8, 8) and torch.isfinite(acts).all()
    assert (acts.mean() - 5.0).abs() < 1.0


def test_sample_actions_reuses_the_prefix_and_equals_the_full_integration():
    """Inference runs the prefix stream once and reuses its keys / values at every denoising step; the
    chunk equals the one that recomputes every layer's prefix at each step (the training path's
    ``_velocity``), bit for bit, including with a masked camera and padded text."""
    p = policy().eval()
    batch = make_batch(b=3)
    batch["image_mask"][0, 1] = False
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = p.sample_actions(batch, noise=noise, num_steps=5)
        x = noise.clone()
        prefix, keep = p._prefix(batch)
        for i in range(5):
            x = x - p._velocity(prefix, keep, x, torch.full((3,), 1.0 - i / 5)).float() / 5
    assert torch.equal(got, x * p.action_scale + p.action_offset)


def test_a_batch_without_the_instruction_tokens_names_the_field():
    """The reference policy's sample spec has a tokenizer, so its samples always carry ``text`` /
    ``text_mask`` (an episode without an instruction gives only BOS / EOS): a batch without them was not
    made to its spec and fails on this rank, naming the field, without asking any other rank."""
    batch = make_batch(b=2)
    with pytest.raises(ValueError, match="was built to read 'text' .* this batch has no 'text'"):
        policy()({k: v for k, v in batch.items() if k != "text"})
    with pytest.raises(ValueError, match="this batch has no 'text_mask'"):
        policy()({k: v for k, v in batch.items() if k != "text_mask"})


@pytest.mark.parametrize("size", ["small", "base"])
def test_larger_sizes_build(size):
    from slurmvla.compose import compose


    cfg = compose([f"policy={size}"]).policy
    with torch.device("meta"):
        p = build_policy(cfg)
    n = sum(q.numel() for q in p.parameters())
    assert n > (20e6 if size == "small" else 300e6)



def test_grouped_attention_with_a_mask_through_expanded_heads_equals_the_grouped_kernel():
    """On a GPU, masked grouped-query attention runs with the key / value heads expanded (no fused kernel
    takes both): the same numbers as torch's grouped path and as the explicit softmax."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    grouped = attention.attention(q, k, v, mask, "sdpa")
    expanded = attention.attention(q, k, v, mask, "sdpa", expand_heads=True)
    explicit = attention.attention(q, k, v, mask, "eager")
    torch.testing.assert_close(expanded, grouped, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expanded, explicit, rtol=1e-5, atol=1e-6)
    # Query head h reads key / value head h // 4: swapping the two kv heads changes the output.
    assert not torch.allclose(attention.attention(q, k.flip(1), v.flip(1), mask, "sdpa", expand_heads=True), expanded)


def test_a_checkpointed_layer_is_recomputed_under_its_forwards_context():
    """The policy's choice of attention kernels (policy.attention_kernels) holds in the backward pass's
    recomputation too: torch's CPU kernels save other tensors (math: none; flash: its log-sum-exp), and
    checkpointing refuses a recomputation that saves other tensors than the forward did."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from slurmvla.policy.recompute import Recompute

    def layer(x):
        q = x.view(1, 2, 8, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).flatten()

    entered = []

    def math_only():
        entered.append(1)
        return sdpa_kernel([SDPBackend.MATH])

    for saves in ("inputs", "matmuls"):
        entered.clear()
        x = torch.randn(64, requires_grad=True)
        with math_only():  # the forward's choice, as the policy's forward makes it
            y = Recompute(saves=saves, context=math_only)(layer, 0, x)
        y.sum().backward()  # outside it, as autograd runs the backward
        plain = torch.autograd.grad(layer(x).sum(), x)[0]
        torch.testing.assert_close(x.grad, plain)
        assert len(entered) == 3, saves  # the caller's, the checkpointed forward's, the recomputation's
