"""pi0 / pi0.5 on transformers' PaliGemma: the layers against transformers' own forwards, pretrained
weights in both layouts (written by transformers' save_pretrained and safetensors' save_file), the
LeRobot name table against a golden file, and the errors a bad file gives."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from slurmvla.config.policy import PolicyConfig, policy_schema
from slurmvla.inference.optimize import fuse_projections
from slurmvla.policy import build_policy, sample_spec
from slurmvla.policy.pi0.model import rope
from slurmvla.policy.pi0.weights import lerobot_state_dict

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parents[1] / "golden"
B = 3


def policy_cfg(name: str, **over) -> PolicyConfig:
    """The shipped option conf/policy/NAME.yaml as its schema's dataclass (its defaults list left out)."""
    raw = {k: v for k, v in yaml.safe_load((REPO / "conf" / "policy" / f"{name}.yaml").read_text()).items()
           if k != "defaults"}
    return policy_schema(raw["name"])(**{**raw, **over})


def batch_for(cfg: PolicyConfig, seed: int = 0, text: bool | None = None) -> dict:
    """A batch as the data layer builds it for ``cfg``: with ``text`` / ``text_mask`` when the policy's sample
    spec has a tokenizer (pi0.5's discrete-state prompt is written by the policy: none), unless ``text`` says."""
    if text is None:
        text = sample_spec(cfg).tokenizer is not None
    g = torch.Generator().manual_seed(seed)
    h, s = cfg.action_horizon, cfg.image_size
    batch = {
        "images": torch.randint(0, 256, (B, cfg.num_cameras, s, s, 3), dtype=torch.uint8, generator=g),
        "image_mask": torch.ones(B, cfg.num_cameras, dtype=torch.bool),
        "state": torch.randn(B, cfg.state_dim, generator=g),
        "actions": torch.randn(B, h, cfg.action_dim, generator=g),
        "action_mask": torch.ones(B, h, dtype=torch.bool),
        "noise": torch.randn(B, h, cfg.max_action_dim, generator=g),
        "time_u": torch.rand(B, generator=g),
        "instruction": ["pick up the red block", "put the cup in the sink", "open the drawer"][:B],
    }
    batch["image_mask"][1, 2] = False
    batch["action_mask"][2, h // 2:] = False
    if text:
        batch["text"] = torch.randint(3, 250, (B, cfg.max_text_len), generator=g)
        batch["text_mask"] = torch.arange(cfg.max_text_len)[None, :] < torch.tensor([[5], [12], [24]])
    return batch


def write_tokenizer(folder: Path) -> None:
    """A tiny BPE tokenizer saved by transformers' own writer (as a PaliGemma directory holds one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tok.train_from_iterator(["pick up the red block", "put the cup in the sink", "open the drawer slowly"] * 20,
                            trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(folder)


def paligemma_for(cfg: PolicyConfig):
    vision = dict(hidden_size=cfg.vision_width, intermediate_size=cfg.vision_mlp_dim,
                  num_hidden_layers=cfg.vision_depth, num_attention_heads=cfg.vision_heads,
                  image_size=cfg.image_size, patch_size=cfg.patch_size, projection_dim=cfg.width)
    text = dict(hidden_size=cfg.width, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.depth,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                vocab_size=cfg.vocab_size, hidden_activation="gelu_pytorch_tanh")
    config = transformers.PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=cfg.width,
                                          image_token_index=cfg.vocab_size - 1)
    torch.manual_seed(7)
    model = transformers.PaliGemmaForConditionalGeneration(config).eval()
    with torch.no_grad():  # RMSNorm weights start at 0 in transformers: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def paligemma_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("paligemma")
    model = paligemma_for(policy_cfg("pi0_tiny"))
    model.save_pretrained(folder, max_shard_size="200KB")  # several shards + index, as the real one
    write_tokenizer(folder)
    return folder, model


def test_paligemma_directory_initialises_the_backbone_as_transformers_computes_it(paligemma_dir):
    folder, hf = paligemma_dir
    assert (folder / "model.safetensors.index.json").exists()
    cfg = policy_cfg("pi0_tiny", pretrained_path=str(folder))
    torch.manual_seed(0)
    policy = build_policy(cfg).eval()
    torch.manual_seed(0)
    fresh = build_policy(policy_cfg("pi0_tiny")).eval()
    batch = batch_for(cfg)
    with torch.no_grad():
        # Vision tower + projector against PaliGemma's own image features.
        pixels = batch["images"][:, 0].permute(0, 3, 1, 2).float() / 127.5 - 1.0
        ours = policy.projector(policy.vision(pixels))
        theirs = hf.model.get_image_features(pixels).pooler_output
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        # Text embeddings: Gemma scales by sqrt(width).
        ids = batch["text"]
        torch.testing.assert_close(policy.embed_tokens(ids) * cfg.width ** 0.5,
                                   hf.model.language_model.embed_tokens(ids), rtol=1e-6, atol=1e-6)
        # The first joint layer's prefix stream against transformers' GemmaDecoderLayer.forward on the
        # same tokens, with the same bidirectional padding mask and positions.
        prefix, keep = policy._prefix(batch)
        suffix, lead, cond = policy._suffix(batch, batch["noise"], torch.full((B,), 0.5))
        rotary, masks = policy._masks(keep, suffix.shape[1], lead)
        out, _, _ = policy.layers[0](prefix, suffix, rotary, masks, cond)
        positions = keep.long().cumsum(1) - 1
        mask = torch.where(masks[0], 0.0, float("-inf"))
        hf_layer = hf.model.language_model.layers[0]
        expected = hf_layer(prefix, attention_mask=mask, position_embeddings=rope(positions, cfg.head_dim))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The action expert and heads start fresh (exactly as without pretrained weights).
    fresh_state = fresh.state_dict()
    for name, p in policy.named_parameters():
        if ".expert." in name or name.startswith(("action_", "state_proj", "expert_norm")):
            assert torch.equal(p, fresh_state[name]), name
    # The tokenizer is the directory's.
    tok = sample_spec(cfg).tokenizer
    ids, mask = tok("pick up the red block")
    expected = transformers.AutoTokenizer.from_pretrained(folder)("<bos>pick up the red block\n",
                                                                   add_special_tokens=False)["input_ids"]
    assert ids[: int(mask.sum())].tolist() == expected


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_lerobot_checkpoint_loads_back_to_the_same_outputs(name, paligemma_dir, tmp_path):
    torch.manual_seed(3)
    source = build_policy(policy_cfg(name, tokenizer_path=str(paligemma_dir[0]))).eval()  # pi0.5 tokenizes its prompt
    with torch.no_grad():  # non-trivial values everywhere (zero-initialised adaRMS projections too)
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_file(lerobot_state_dict(source), str(tmp_path / "model.safetensors"))
    cfg = policy_cfg(name, pretrained_path=str(tmp_path), tokenizer_path=str(paligemma_dir[0]))
    torch.manual_seed(99)
    loaded = build_policy(cfg).eval()
    own = source.state_dict()
    assert all(torch.equal(v, own[k]) for k, v in loaded.state_dict().items() if "offset" not in k and "scale" not in k)
    batch = batch_for(cfg)
    with torch.no_grad():
        assert torch.equal(loaded(batch)["loss"], source(batch)["loss"])
        noise = torch.randn(B, cfg.action_horizon, cfg.action_dim)
        assert torch.equal(loaded.sample_actions(batch, noise=noise), source.sample_actions(batch, noise=noise))


# LeRobot 0.6.1's key names and shapes, the completeness of the export and the strict load are
# checked against LeRobot's own state dict and saved file in tests/policy/test_pi0_parity.py.


# -- a bad file fails at start-up, naming it ---------------------------------------------------------


def test_a_folder_without_weights_names_itself(tmp_path):
    with pytest.raises(ValueError, match=rf"policy.pretrained_path='{tmp_path}' holds no model.safetensors"):
        build_policy(policy_cfg("pi0_tiny", pretrained_path=str(tmp_path), tokenizer_path=None))


def test_a_checkpoint_of_another_size_names_the_file_and_the_first_mismatched_keys(paligemma_dir, tmp_path):
    folder, _ = paligemma_dir
    cfg = policy_cfg("pi0_tiny", pretrained_path=str(folder), vision_width=48, vision_mlp_dim=96)
    with pytest.raises(ValueError, match=r"model-0000\d-of-0000\d.safetensors.*shape\(s\) differ.*vision\."):
        build_policy(cfg)


def test_unknown_and_missing_keys_are_named(paligemma_dir, tmp_path):
    source = build_policy(policy_cfg("pi0_tiny"))
    state = lerobot_state_dict(source)
    bad = {**state, "model.paligemma_with_expert.something_else.weight": torch.zeros(2)}
    (tmp_path / "a").mkdir()
    save_file(bad, str(tmp_path / "a" / "model.safetensors"))
    cfg = policy_cfg("pi0_tiny", pretrained_path=str(tmp_path / "a"), tokenizer_path=str(paligemma_dir[0]))
    with pytest.raises(ValueError, match=r"1 key\(s\) fit no entry.*something_else"):
        build_policy(cfg)
    missing = {k: v for k, v in state.items() if "action_out_proj" not in k}
    (tmp_path / "b").mkdir()
    save_file(missing, str(tmp_path / "b" / "model.safetensors"))
    cfg = policy_cfg("pi0_tiny", pretrained_path=str(tmp_path / "b"), tokenizer_path=str(paligemma_dir[0]))
    with pytest.raises(ValueError, match=r"b/model.safetensors: 2 tensor\(s\).*missing.*action_out_proj"):
        build_policy(cfg)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors").write_bytes(b"not a safetensors file")
    cfg = policy_cfg("pi0_tiny", pretrained_path=str(tmp_path / "c"), tokenizer_path=str(paligemma_dir[0]))
    with pytest.raises(ValueError, match=r"cannot read .*c/model.safetensors"):
        build_policy(cfg)


def test_a_checkpoint_without_a_tokenizer_asks_for_one(tmp_path):
    save_file(lerobot_state_dict(build_policy(policy_cfg("pi0_tiny"))), str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds no tokenizer.*policy.tokenizer_path"):
        sample_spec(policy_cfg("pi0_tiny", pretrained_path=str(tmp_path)))


# -- the policy itself -------------------------------------------------------------------------------


def perturbed_policy(name: str, **over):
    """``(cfg, policy)``: the toy-size policy in eval mode, its initial weights moved off their exact zeros
    and ones (zero-initialised projections would make every path agree trivially)."""
    cfg = policy_cfg(name, **over)
    torch.manual_seed(0)
    policy = build_policy(cfg).eval()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, policy


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_prefix_cache_inference_equals_the_full_integration(name):
    """sample_actions runs the prefix once; integrating with the whole model at every step (the
    training forward's velocity) must give the same chunk."""
    cfg, policy = perturbed_policy(name)
    batch = batch_for(cfg)
    noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        fast = policy.sample_actions(batch, noise=noise)
        x = noise.clone()
        for i in range(cfg.num_inference_steps):
            t = torch.full((B,), 1.0 - i / cfg.num_inference_steps)
            prefix, keep = policy._prefix(batch)
            x = x - policy._velocity(prefix, keep, batch, x, t).float() / cfg.num_inference_steps
        slow = x[..., : cfg.action_dim] * policy.action_scale + policy.action_offset
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_a_batch_prepared_for_inference_gives_the_same_chunk(name):
    """prepare_inference (the host's part: the prompt tokenized and cut to a multiple of 32 columns, so
    the model never waits on the device and its shapes take few values) changes no action: against
    sample_actions on the batch as it came, which trims the prompt to the exact longest one."""
    from slurmvla.policy.pi0.model import PROMPT_BUCKET, PROMPT_IDS

    cfg, policy = perturbed_policy(name)
    batch = batch_for(cfg)
    noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim)
    prepared = policy.prepare_inference(batch)
    width = prepared[PROMPT_IDS].shape[1]
    assert "instruction" not in prepared and "text" not in prepared
    assert width % PROMPT_BUCKET == 0 or width == cfg.max_text_len
    assert prepared["prompt_mask"][:, max(0, width - PROMPT_BUCKET):].any()  # the smallest such width
    with torch.no_grad():
        torch.testing.assert_close(policy.sample_actions(prepared, noise=noise), policy.sample_actions(batch, noise=noise),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_fused_projections_give_the_same_actions_and_loss_and_change_no_weight(name):
    """fuse_projections (the server's and evaluator's default: q/k/v and gate/up as one product each) against
    the same policy unfused: the same chunk and loss, the same state_dict (names, values; no tensor added),
    no copy of a fused weight (the parameters are views of it), and an in-place update of a parameter is
    what the fused product reads."""
    cfg, plain = perturbed_policy(name)
    _, fused = perturbed_policy(name)
    assert fuse_projections(fused) == 2 * cfg.depth * 2 - 1  # the last backbone layer has no MLP
    batch = batch_for(cfg)
    noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        torch.testing.assert_close(fused.sample_actions(batch, noise=noise), plain.sample_actions(batch, noise=noise),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused(batch)["loss"], plain(batch)["loss"], rtol=1e-5, atol=1e-6)
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    attn = fused.layers[0].expert.self_attn
    assert attn.q_proj.weight.data_ptr() == attn.fused_qkv.data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.fused_qkv.untyped_storage().data_ptr()
    with torch.no_grad():
        for policy in (plain, fused):
            policy.layers[0].expert.mlp.up_proj.weight.mul_(1.5)
            policy.layers[1].expert.self_attn.v_proj.weight.add_(0.01)
        # a copied fused weight would still hold the old values
        torch.testing.assert_close(fused.sample_actions(batch, noise=noise), plain.sample_actions(batch, noise=noise),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_matmul_attention_equals_torchs_attention_with_the_heads_repeated(kv_heads):
    """The folded form (query heads that share a key / value head as extra rows) against
    F.scaled_dot_product_attention with each key / value head copied to its query heads: the same output,
    with a mask that differs per sample and per query."""
    from slurmvla.policy.attention import grouped_matmul_attention, repeat_heads

    g = torch.Generator().manual_seed(0)
    b, heads, n, keys, d = 2, 8, 5, 13, 16
    q = torch.randn(b, heads, n, d, generator=g)
    k, v = (torch.randn(b, kv_heads, keys, d, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, n, keys, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key
    want = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_heads(k, heads // kv_heads), repeat_heads(v, heads // kv_heads), attn_mask=mask)
    torch.testing.assert_close(grouped_matmul_attention(q, k, v, mask), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_denoise_attention_as_matrix_products_gives_the_same_chunk(name, monkeypatch):
    """policy.denoise_attention=matmul (the default) changes how the cached denoising steps attend (every layer
    of every step after the first), not the actions: sdpa gives the same chunk."""
    from slurmvla.policy.pi0 import model as pi0

    calls = []
    folded = pi0.grouped_matmul_attention
    monkeypatch.setattr(pi0, "grouped_matmul_attention", lambda *a: calls.append(1) or folded(*a))
    cfg, sdpa = perturbed_policy(name, denoise_attention="sdpa")
    _, matmul = perturbed_policy(name, denoise_attention="matmul")
    batch = batch_for(cfg)
    noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        want = sdpa.sample_actions(batch, noise=noise)
        assert calls == []
        torch.testing.assert_close(matmul.sample_actions(batch, noise=noise), want, rtol=1e-5, atol=1e-5)
    assert len(calls) == (cfg.num_inference_steps - 1) * cfg.depth
    with pytest.raises(ValueError, match=r"policy.denoise_attention='flash' is not valid; choose one of \['sdpa', 'matmul'\]"):
        policy_cfg(name, denoise_attention="flash")
    with pytest.raises(ValueError, match=r"policy.prompt_bucket=0 is not valid; it must be > 0"):
        policy_cfg(name, prompt_bucket=0)


def test_projections_wrapped_by_lora_stay_unfused():
    """A LoRA-adapted projection's output is its base product plus the adapter's: fusing its base weight
    with the others would drop the adapter, so those groups are left alone (and the rest still fuse)."""
    pytest.importorskip("peft")
    from slurmvla.compose import compose

    cfg = compose(["policy=pi0_tiny", "policy.lora.enabled=true", "policy.lora.parts=[expert]"]).policy
    torch.manual_seed(0)
    policy = build_policy(cfg).eval()
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # adapters that change the output
    batch = batch_for(cfg)
    noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        before = policy.sample_actions(batch, noise=noise)
        assert fuse_projections(policy) == cfg.depth * 2 - 1  # the backbone's groups only
        torch.testing.assert_close(policy.sample_actions(batch, noise=noise), before, rtol=1e-5, atol=1e-5)
    assert getattr(policy.layers[0].expert.self_attn, "fused_qkv", None) is None


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_a_training_batch_cut_to_the_prompt_bucket_has_the_same_loss_and_gradients(name):
    """prepare_training (the trainer's host part) cuts the prompt to a multiple of policy.prompt_bucket
    columns, so a GPU's attention kernels and compiled layers see a few prompt lengths, not one per batch:
    the loss and every gradient are those of the batch cut to its exact longest prompt (1 column), as the
    forward trims a batch that comes unprepared. On the CPU the default is that exact cut."""
    from slurmvla.policy.pi0.model import PROMPT_IDS

    cfg, exact = perturbed_policy(name)
    assert exact.prepare_training(batch_for(cfg))[PROMPT_IDS].shape[1] == \
        exact.prepare_inference(batch_for(cfg), bucket=1)[PROMPT_IDS].shape[1]
    cfg, bucketed = perturbed_policy(name, prompt_bucket=20)
    batch = batch_for(cfg)
    prepared = bucketed.prepare_training(batch)
    width = prepared[PROMPT_IDS].shape[1]
    assert width % 20 == 0 or width == cfg.max_text_len
    assert width > exact.prepare_inference(batch, bucket=1)[PROMPT_IDS].shape[1]  # padding added, and masked
    exact.load_state_dict(bucketed.state_dict())
    results = []
    for policy, b in ((exact, batch), (bucketed, prepared)):
        policy.zero_grad()
        loss = policy(b)["loss"]
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[1][1].keys() == results[0][1].keys()
    for n, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_actions_never_leak_into_the_prefix_and_padding_changes_nothing(name):
    """Block-causal attention: the prefix's output does not depend on the actions; a padded text
    token's id does not change the loss."""
    cfg = policy_cfg(name)
    torch.manual_seed(0)
    policy = build_policy(cfg).eval()
    batch = batch_for(cfg)
    with torch.no_grad():
        if "text" in batch:  # pi0.5's prompt is the policy's own: no padded tokens come with the batch
            other = {**batch, "text": batch["text"].clone()}
            other["text"][0, 10:] = 5  # sample 0 has 5 valid text tokens
            assert torch.allclose(policy(batch)["components"]["mse"][0][0], policy(other)["components"]["mse"][0][0],
                                  rtol=1e-6, atol=1e-7)
        prefix, keep = policy._prefix(batch)
        outs = []
        for noise in (batch["noise"], torch.randn_like(batch["noise"])):
            suffix, lead, cond = policy._suffix(batch, noise, torch.full((B,), 0.3))
            rotary, masks = policy._masks(keep, suffix.shape[1], lead)
            outs.append(policy.layers[0](prefix, suffix, rotary, masks, cond)[0])
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("name", "over", "with_text", "error"), [
    ("pi0_tiny", {}, False, "policy=pi0 was built to read 'text' .* this batch has no 'text'"),
    ("pi05_tiny", {"state_input": "continuous"}, False, "policy=pi05 was built to read 'text' .* has no 'text'"),
    ("pi05_tiny", {}, True, "policy=pi05 was built not to read 'text' .* but this batch has 'text'"),
])
def test_a_batch_not_made_to_the_sample_spec_names_the_field(name, over, with_text, error):
    """The policy reads the fields its sample spec decided at build time and asks no other rank: a batch
    without them (or, for pi0.5's own prompt, with them) is a ValueError naming the field."""
    cfg = policy_cfg(name, **over)
    policy = build_policy(cfg)
    with pytest.raises(ValueError, match=error):
        policy(batch_for(cfg, text=with_text))


def test_no_weight_decay_on_embeddings_and_norms():
    policy = build_policy(policy_cfg("pi0_tiny"))
    groups = {g["name"]: g["param_names"] for g in policy.param_groups(0.1, 1e-3)}
    no_decay = set(groups["backbone_no_decay"]) | set(groups["expert_no_decay"])
    assert {"embed_tokens.weight", "vision.embeddings.position_embedding.weight",
            "layers.0.backbone.input_layernorm.weight", "layers.0.expert.post_attention_layernorm.weight",
            "expert_norm.weight"} <= no_decay
    assert "layers.0.backbone.self_attn.q_proj.weight" in groups["backbone_decay"]
    assert "layers.0.expert.mlp.up_proj.weight" in groups["expert_decay"]


@pytest.mark.parametrize("name", ["pi0_tiny", "pi05_tiny"])
def test_a_meta_device_build_materialises_to_the_same_weights(name):
    """What an FSDP engine does: parameters on the meta device at build (no memory), buffers real,
    then each parameter initialised alone from its own generator: bitwise the whole build."""
    from slurmvla.engine.materialize import materialize, parameters_on_meta

    stats = {"state_offset": torch.arange(8.0), "state_scale": torch.full((8,), 2.0),
             "action_offset": torch.ones(8), "action_scale": torch.full((8,), 3.0)}
    torch.manual_seed(5)
    whole = build_policy(policy_cfg(name), stats)
    torch.manual_seed(5)
    with parameters_on_meta():
        deferred = build_policy(policy_cfg(name), stats)
    assert all(p.is_meta for p in deferred.parameters())
    assert not any(b.is_meta for b in deferred.buffers())
    materialize(deferred, torch.device("cpu"))
    ref = whole.state_dict()
    assert ref.keys() == deferred.state_dict().keys()
    assert all(torch.equal(v, ref[k]) for k, v in deferred.state_dict().items())


@pytest.mark.slow
def test_pi0_trains_from_a_paligemma_directory_and_exports_without_it(make_cfg, paligemma_dir, tmp_path):
    """Loss falls on the sample dataset; the export rebuilds the policy (tokenizer from the config's
    directory) without reading the pretrained weights again, and acts as the trained policy."""
    import json
    import shutil

    from safetensors.torch import load_file

    from slurmvla.export import export
    from slurmvla.inference.load import load_exported
    from slurmvla.trainer import Trainer

    folder = tmp_path / "paligemma"
    shutil.copytree(paligemma_dir[0], folder)
    # 200 steps: the last ten logged losses average 0.71 of the first three's (0.64 after 300, 0.76 after 150).
    cfg = make_cfg("policy=pi0_tiny", f"policy.pretrained_path={folder}", "trainer.max_steps=200", "optim.lr=1e-3",
                   "trainer.global_batch_size=16", "trainer.log_every_steps=10", "checkpoint.every_steps=200")
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.fit()
    batch = next(trainer.data.iterate(0, 0))
    trainer.close()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:3]) / 3, losses
    out = export(tmp_path / "run", tmp_path / "policy.safetensors")
    for f in folder.glob("model*.safetensors*"):
        f.unlink()  # the weights are gone; the tokenizer stays
    loaded = load_exported(out)
    trained = build_policy(dataclasses.replace(cfg.policy, pretrained_path=None))
    trained.load_state_dict(load_file(str(out)))
    noise = torch.randn(batch["actions"].shape, generator=torch.Generator().manual_seed(0))
    obs = {k: batch[k] for k in ("images", "image_mask", "state", "text", "text_mask")}
    assert torch.equal(loaded.policy.sample_actions(obs, noise=noise), trained.eval().sample_actions(obs, noise=noise))
    assert loaded.policy.sample_actions(obs, noise=noise).shape == batch["actions"].shape


def test_an_export_loads_into_a_meta_built_policy_with_its_values_and_frozen_parts(tmp_path):
    """load_exported builds pi0.5 on the meta device and takes the file's tensors as its parameters
    (no random initialisation first): every value, every requires_grad flag (a frozen vision tower stays
    frozen) and the actions equal the policy that was saved."""
    from omegaconf import OmegaConf

    from slurmvla.compose import compose
    from slurmvla.inference.load import load_exported

    cfg = compose(["policy=pi05_tiny", "policy.freeze_vision_encoder=true"])
    torch.manual_seed(0)
    saved = build_policy(cfg.policy).eval()
    path = tmp_path / "policy.safetensors"
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, str(path),
              metadata={"config_yaml": OmegaConf.to_yaml(OmegaConf.structured(cfg)), "step": "0", "engine": "none"})
    loaded = load_exported(path).policy
    assert not any(p.is_meta for p in loaded.parameters())
    assert {n: p.requires_grad for n, p in loaded.named_parameters()} == \
        {n: p.requires_grad for n, p in saved.named_parameters()}
    assert not loaded.vision.embeddings.patch_embedding.weight.requires_grad
    for (name, a), b in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    batch = batch_for(policy_cfg("pi05_tiny"))
    noise = torch.randn(B, cfg.policy.action_horizon, cfg.policy.max_action_dim)
    with torch.no_grad():
        assert torch.equal(loaded.sample_actions(batch, noise=noise), saved.sample_actions(batch, noise=noise))


def test_every_checkpointing_setting_gives_pi05s_gradients():
    """pi0.5's joint layers and its vision tower under each activation-checkpointing setting
    (policy/recompute.py): the plain gradients, and the recomputation each setting promises."""
    from tests.policy.test_policy import CountMatmuls, checkpointing_cases

    def run(**kw):
        cfg = policy_cfg("pi05_tiny", **kw)
        torch.manual_seed(0)
        policy = build_policy(cfg).train()
        batch = batch_for(cfg)
        g = torch.Generator().manual_seed(1)
        noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim, generator=g)
        loss = policy(batch, noise=noise, t=torch.rand(B, generator=g))["loss"]
        with CountMatmuls() as counter:
            loss.backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}, counter.count

    checkpointing_cases(run)
