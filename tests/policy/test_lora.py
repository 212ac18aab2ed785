"""LoRA (policy.lora, through peft): what is adapted and frozen, the adapted function against a hand-written
one, seeded and meta-built adapters, one-process training, checkpoints, bf16 and export. Every engine's
LoRA training against one process is in the parity matrix (tests/test_distributed.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.checkpoint import load_model_file
from slurmvla.compose import compose
from slurmvla.engine.materialize import materialize, parameters_on_meta
from slurmvla.export import export
from slurmvla.inference.load import load_exported
from slurmvla.parameters import has_adapters, is_adapter, plain_name
from slurmvla.policy import build_policy
from slurmvla.policy.lora import merge_adapters, trainable_summary
from slurmvla.seeding import seed_everything
from slurmvla.trainer import Trainer
from tests.policy.test_pi0 import batch_for, paligemma_dir  # noqa: F401 (a fixture)

if importlib.util.find_spec("peft") is None:  # not importorskip: importing peft costs every worker ~4 s at collection
    pytest.skip("the [lora] extra (peft)", allow_module_level=True)

LORA = ["policy.lora.enabled=true"]


def _policy(name: str, *extra: str, seed: int = 0):
    cfg = compose([f"policy={name}", *extra]).policy
    seed_everything(seed)
    return build_policy(cfg), cfg


@pytest.mark.parametrize("name", ["pi05_tiny", "tiny"])
def test_adapters_sit_on_the_language_models_and_only_they_and_the_rest_train(name):
    plain, _ = _policy(name)
    adapted, cfg = _policy(name, *LORA)
    trains = {n: p.requires_grad for n, p in plain.named_parameters()}
    parts = adapted.lora_parts()
    frozen_ids = {id(p) for part in ("backbone", "expert") for m in parts[part] for p in m.parameters()}
    vision_ids = {id(p) for m in parts["vision"] for p in m.parameters()}
    for n, p in adapted.named_parameters():
        if is_adapter(n):
            assert p.requires_grad, n
        elif id(p) in frozen_ids and id(p) not in vision_ids:
            assert not p.requires_grad, f"{n} is in an adapted part and must be frozen"
        else:  # vision tower, projections: trained as without LoRA (openpi)
            assert p.requires_grad == trains[plain_name(n)], n
    # Every adapted module is an nn.Linear of the backbone or expert, with openpi's ranks.
    ranks = {n.rsplit(".lora_A", 1)[0]: p.shape[0] for n, p in adapted.named_parameters() if ".lora_A." in n}
    assert ranks and all(".vision." not in f".{n}" for n in ranks)
    expert = {id(m) for m in parts["expert"] for m in m.modules()}
    for module_name, rank in ranks.items():
        assert rank == (32 if id(adapted.get_submodule(module_name)) in expert else 16), module_name
    if name == "pi05_tiny":  # openpi's targets: attention and MLP projections, not the adaptive norms' modulation
        assert {n.rsplit(".", 1)[-1] for n in ranks} == set(cfg.lora.targets)
        assert not any(".dense" in n for n in ranks)


def test_an_adapted_linear_computes_w_x_plus_scaled_b_a_x():
    """The adapted function, written out by hand for one backbone and one expert projection."""
    policy, cfg = _policy("pi0_tiny", *LORA, "policy.lora.rank=4", "policy.lora.alpha=8", "policy.lora.expert_rank=2",
                          "policy.lora.expert_alpha=6")
    for name, scale in (("layers.0.backbone.self_attn.q_proj", 8 / 4), ("layers.1.expert.mlp.down_proj", 6 / 2)):
        module = policy.get_submodule(name)
        w = module.base_layer.weight
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        x = torch.randn(3, w.shape[1])
        expected = x @ w.T + (module.base_layer.bias if module.base_layer.bias is not None else 0)
        expected = expected + scale * (x @ a.T) @ b.T
        torch.testing.assert_close(module(x), expected, rtol=1e-6, atol=1e-6)
        # openpi's initialisation: both factors from N(0, 0.01)
        assert abs(a.std().item() - 0.01) < 0.004 and abs(b.std().item() - 0.01) < 0.004


def test_peft_init_starts_from_exactly_the_base_policy_and_the_base_keeps_its_weights():
    plain, cfg = _policy("pi0_tiny")
    adapted, _ = _policy("pi0_tiny", *LORA, "policy.lora.init=peft")
    base = {plain_name(n): p for n, p in adapted.named_parameters() if not is_adapter(n)}
    assert set(base) == set(dict(plain.named_parameters()))
    assert all(torch.equal(base[n], p) for n, p in plain.named_parameters())
    batch = batch_for(cfg)
    noise = torch.randn(batch["state"].shape[0], cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        assert torch.equal(plain.eval().sample_actions(batch, noise=noise), adapted.eval().sample_actions(batch, noise=noise))


def test_a_meta_built_adapted_policy_materialises_to_the_whole_build():
    whole, cfg = _policy("pi05_tiny", *LORA)
    seed_everything(0)
    with parameters_on_meta():
        meta = build_policy(cfg)
    materialize(meta, torch.device("cpu"))
    a, b = whole.state_dict(), meta.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_target_that_matches_nothing_is_one_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"policy.lora.targets=\['qproj'\] matches no nn.Linear.*q_proj"):
        _policy("pi0_tiny", *LORA, "policy.lora.targets=[qproj]")
    with pytest.raises(ValueError, match=r"policy.lora.parts='arm' is not valid; choose one of \['backbone'"):
        _policy("pi0_tiny", *LORA, "policy.lora.parts=[arm]")


def _overrides(root, *extra):
    return [f"data.root={root}", "policy=pi0_tiny", *LORA, "logging.wandb.mode=disabled", "trainer.progress_bar=false",
            "data.num_workers=0", "data.loader=map", "trainer.max_steps=6", "trainer.global_batch_size=4",
            "checkpoint.every_steps=3", "optim.lr=1e-3", "scheduler.warmup_steps=1", *extra]


@pytest.fixture(scope="module")
def lora_run(sample_root, tmp_path_factory):
    """One LoRA run of 6 steps (pi0_tiny, one process), its full weights and its initial ones."""
    run = tmp_path_factory.mktemp("lora") / "run"
    trainer = Trainer(compose(_overrides(sample_root)), run)
    initial = trainer.engine.model_state_dict()
    trainer.fit()
    final = trainer.engine.model_state_dict()
    trainable = {n for n, p in trainer.policy.named_parameters() if p.requires_grad}
    trainer.close()
    return run, initial, final, trainable


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_resumes_bitwise_from_a_small_checkpoint(lora_run, sample_root, tmp_path):
    run, initial, final, trainable = lora_run
    for k in final:
        changed = not torch.equal(initial[k], final[k])
        assert changed == (k in trainable), f"{k}: changed={changed}, trainable={k in trainable}"
    # The checkpoint holds the trained tensors and the buffers, not the frozen base.
    checkpoint = run / "checkpoints" / "step_00000006"
    held = load_model_file(checkpoint)
    buffers = {k for k in final if k.endswith(("_offset", "_scale"))}
    assert set(held) == trainable | buffers
    assert json.loads((checkpoint / "meta.json").read_text())["lora_base"]["init_seed"] > 0
    # Stopped half-way and resumed: bitwise the straight run.
    resumed = tmp_path / "resumed"
    Trainer(compose(_overrides(sample_root)), resumed).fit(stop_at=3)
    trainer = Trainer(compose(_overrides(sample_root)), resumed)
    assert trainer.resumed_from.name == "step_00000003"
    trainer.fit()
    again = trainer.engine.model_state_dict()
    trainer.close()
    assert all(torch.equal(final[k], again[k]) for k in final)


@pytest.mark.slow
def test_the_merged_export_is_the_plain_policy_with_the_adapted_actions_and_adapters_export_alone(lora_run, tmp_path):
    run, _, final, trainable = lora_run
    adapted = load_exported(run, merge=False)
    assert has_adapters(adapted.policy)
    assert all(torch.equal(adapted.policy.state_dict()[k], final[k]) for k in final), "the base is rebuilt bitwise"
    merged_file = export(run, tmp_path / "merged.safetensors")
    adapters_file = export(run, tmp_path / "adapters.safetensors", adapters=True)
    merged = load_file(str(merged_file))
    plain, _ = _policy("pi0_tiny")
    assert set(merged) == set(plain.state_dict()), "merged: the plain policy's names"
    assert set(load_file(str(adapters_file))) == set(load_model_file(run / "checkpoints" / "step_00000006"))
    assert os.path.getsize(adapters_file) < 0.85 * os.path.getsize(merged_file)
    # W + scale * B A, by hand, for one adapted projection.
    name = "layers.0.backbone.self_attn.k_proj"
    scale = adapted.cfg.policy.lora.alpha / adapted.cfg.policy.lora.rank
    a, b = final[f"{name}.lora_A.default.weight"], final[f"{name}.lora_B.default.weight"]
    torch.testing.assert_close(merged[f"{name}.weight"], final[f"{name}.base_layer.weight"] + scale * b @ a)
    cfg = adapted.cfg.policy
    batch = batch_for(cfg)
    noise = torch.randn(batch["state"].shape[0], cfg.action_horizon, cfg.max_action_dim)
    with torch.no_grad():
        reference = adapted.policy.sample_actions(batch, noise=noise)
        for source in (merged_file, adapters_file, run):  # serve / evaluate load each, folded in
            loaded = load_exported(source)
            assert not has_adapters(loaded.policy) and not loaded.cfg.policy.lora.enabled
            torch.testing.assert_close(loaded.policy.sample_actions(batch, noise=noise), reference, rtol=0, atol=1e-5)
        unmerged = load_exported(adapters_file, merge=False).policy.sample_actions(batch, noise=noise)
    assert torch.equal(unmerged, reference)


@pytest.mark.slow
def test_bf16_holds_the_frozen_base_in_bf16_and_the_adapters_masters_and_state_in_fp32(sample_root, tmp_path):
    trainer = Trainer(compose(_overrides(sample_root, "precision=bf16", "trainer.max_steps=2")), tmp_path / "run")
    trainer.fit()
    frozen = {p.dtype for p in trainer.policy.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    steps = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in steps} == {torch.float32}
    assert {v.dtype for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
    assert sum(p.numel() for p in steps) == sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    trainer.close()


def test_merging_gives_back_the_plain_policys_parameters():
    policy, _ = _policy("tiny", *LORA)
    merge_adapters(policy)
    assert not has_adapters(policy)
    assert {n: p.shape for n, p in policy.named_parameters()} == \
        {n: p.shape for n, p in _policy("tiny")[0].named_parameters()}


@pytest.mark.slow
def test_export_adapters_of_a_full_fine_tune_is_one_error(sample_root, tmp_path):
    overrides = [o for o in _overrides(sample_root, "trainer.max_steps=1") if o not in LORA]
    Trainer(compose(overrides), tmp_path / "full").fit()
    res = subprocess.run([sys.executable, "-m", "slurmvla.export", str(tmp_path / "full"), str(tmp_path / "a.st"),
                          "--adapters"], capture_output=True, text=True)
    assert res.returncode == 2 and "is not from a LoRA run" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_adapters_load_onto_their_pretrained_base_only(paligemma_dir, sample_root, tmp_path):  # noqa: F811
    """A LoRA run from pretrained weights: the adapters export alone and load onto the base read again from
    policy.pretrained_path; once those files change, loading and resuming stop with one error naming them."""
    import shutil

    folder = tmp_path / "paligemma"
    shutil.copytree(paligemma_dir[0], folder)
    overrides = _overrides(sample_root, f"policy.pretrained_path={folder}", "trainer.max_steps=2",
                           "checkpoint.every_steps=2")
    trainer = Trainer(compose(overrides), tmp_path / "run")
    trainer.fit()
    final = trainer.engine.model_state_dict()
    trainer.close()
    adapters = export(tmp_path / "run", tmp_path / "adapters.safetensors", adapters=True)
    loaded = load_exported(adapters, merge=False).policy.state_dict()
    assert all(torch.equal(loaded[k], final[k]) for k in final), "the base is read again from the pretrained files"
    paligemma_dir[1].save_pretrained(folder, max_shard_size="100KB")  # other files: another base, as far as we know
    for source in (adapters, tmp_path / "run"):
        with pytest.raises(ValueError, match="its LoRA adapters were trained on the base loaded from files"):
            load_exported(source)
    with pytest.raises(ValueError, match="point policy.pretrained_path at it"):
        Trainer(compose([*overrides, "trainer.max_steps=4"]), tmp_path / "run")


def test_a_plug_in_policy_gets_adapters_on_every_linear_and_the_same_ones_from_the_same_seed(example_policy):
    from torch import nn

    policy, cfg = _policy("custom", f"policy.target={example_policy}", *LORA, "policy.lora.rank=4")
    again, _ = _policy("custom", f"policy.target={example_policy}", *LORA, "policy.lora.rank=4")
    other, _ = _policy("custom", f"policy.target={example_policy}", *LORA, "policy.lora.rank=4", seed=1)
    plain, _ = _policy("custom", f"policy.target={example_policy}")
    linears = {n for n, m in plain.named_modules() if isinstance(m, nn.Linear)}
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in policy.named_parameters() if ".lora_A." in n}
    assert adapted == linears and all(p.shape[0] == 4 for n, p in policy.named_parameters() if ".lora_A." in n)
    assert trainable_summary(policy)["other_trainable"] == 0  # everything is backbone by default: all frozen
    a, b, c = policy.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if ".lora_A." in k)
