"""openpi's own checkpoint directory (``params/`` written by orbax, ``assets/<id>/norm_stats.json``) as
``policy.pretrained_path``, against openpi's own conversion script.

tests/reference/generate_openpi_checkpoint.py wrote tests/golden/openpi_tiny_<pi0|pi05>/ in its own
environment (JAX + orbax, no slurmvla): the parameter tree in openpi's layout at pi0_tiny / pi05_tiny sizes,
saved by orbax as openpi saves it, and ``expected_lerobot.npz``, what a port of openpi's
examples/convert_jax_model_to_pytorch.py makes of the same tree under LeRobot's names. Here slurmvla reads
the committed checkpoint through orbax (the ``openpi`` extra, which scripts/test.sh installs) and must give
those tensors exactly, load them strictly, and act as the same weights loaded from a LeRobot file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from slurmvla.data.mixture import offset_scale
from slurmvla.policy import build_policy
from slurmvla.policy.pi0 import openpi as openpi_ckpt
from slurmvla.policy.pi0.weights import check_pretrained_path, lerobot_state_dict, read_pretrained
from slurmvla.policy.stats import checkpoint_stats

pytest.importorskip("transformers")
from tests.policy.test_pi0 import policy_cfg  # noqa: E402

GOLDEN = Path(__file__).parents[1] / "golden"
TOKENIZER = GOLDEN / "lerobot061" / "tokenizer"
NAMES = {"pi0": "pi0_tiny", "pi05": "pi05_tiny"}
DIMS = 8  # the statistics' width (generate_openpi_checkpoint.DATA_DIM)


def golden(kind: str) -> Path:
    return GOLDEN / f"openpi_tiny_{kind}"


def expected(kind: str) -> dict[str, np.ndarray]:
    with np.load(golden(kind) / "expected_lerobot.npz") as f:
        return {k: f[k] for k in f.files}


def built(kind: str, folder: Path | None, stats_from: Path | None = None, **over):
    """The tiny policy from ``folder`` (None: random weights), normalized by the openpi checkpoint's statistics."""
    cfg = policy_cfg(NAMES[kind], pretrained_path=folder and str(folder), tokenizer_path=str(TOKENIZER), state_dim=DIMS,
                     action_dim=DIMS, **over)
    raw, _ = checkpoint_stats(stats_from or golden(kind))
    mode = "quantile" if kind == "pi05" else "mean_std"
    stats = {**offset_scale(raw["state"], mode, DIMS, "state", "openpi"),
             **offset_scale(raw["action"], mode, DIMS, "action", "openpi")}
    return build_policy(cfg, stats).eval()


def observation(policy, seed: int = 0) -> dict:
    """A request as the server builds one: frames, state, instructions (tokenized where pi0's data layer would)."""
    cfg, g = policy.cfg, torch.Generator().manual_seed(seed)
    s = cfg.image_size
    obs = {"images": torch.randint(0, 256, (2, cfg.num_cameras, s, s, 3), dtype=torch.uint8, generator=g),
           "image_mask": torch.tensor([[True, True, False], [True, True, True]]),
           "state": torch.randn(2, DIMS, generator=g),
           "instruction": ["pick up the red block", "put the cup in the sink"]}
    tokenizer = type(policy).sample_spec(cfg).tokenizer
    if tokenizer is not None:
        ids, masks = zip(*(tokenizer(t) for t in obs["instruction"]))
        obs["text"], obs["text_mask"] = torch.stack(ids), torch.stack(masks)
    return obs


def test_golden_checkpoints_are_orbax_directories_in_openpis_layout():
    for kind in NAMES:
        root = golden(kind)
        assert openpi_ckpt.is_openpi_checkpoint(root)
        assert (root / "params" / "manifest.ocdbt").exists()  # OCDBT: only tensorstore reads it
        assert json.loads((root / "assets" / "droid" / "norm_stats.json").read_text())["norm_stats"].keys() == {
            "state", "actions"}


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_the_mapping_gives_openpis_conversion_tensor_by_tensor(kind):
    """pi0's tree is saved as openpi's training saves it (nnx.State: a 'value' level, float32), pi0.5's as the
    published checkpoints are (plain leaves, bfloat16)."""
    pytest.importorskip("orbax.checkpoint")
    flat = openpi_ckpt.read_tree(golden(kind))
    assert not any(k.endswith("/value") for k in flat)
    mine = openpi_ckpt.lerobot_tensors(flat)
    ref = expected(kind)
    assert sorted(mine) == sorted(ref)
    for k, v in ref.items():
        assert mine[k].dtype == np.float32 and mine[k].shape == v.shape, k
        assert np.array_equal(mine[k], v), k


@pytest.mark.parametrize("kind", ["pi0", "pi05"])
def test_a_policy_from_the_openpi_checkpoint_acts_as_the_same_weights_from_a_lerobot_file(kind, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    layout, tensors, files = read_pretrained(golden(kind))
    assert layout == "openpi" and files == [golden(kind) / "params"]
    lerobot = tmp_path / "lerobot"
    lerobot.mkdir()
    save_file({f"model.{k}": torch.from_numpy(v) for k, v in expected(kind).items()},
              str(lerobot / "model.safetensors"))
    from_openpi, from_lerobot = built(kind, golden(kind)), built(kind, lerobot)
    a, b = from_openpi.state_dict(), from_lerobot.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    obs = observation(from_openpi)
    noise = torch.randn(2, from_openpi.cfg.action_horizon, from_openpi.cfg.max_action_dim,
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        chunk = from_openpi.sample_actions(dict(obs), noise=noise)
        reference = from_lerobot.sample_actions(dict(obs), noise=noise)
    assert chunk.shape == (2, from_openpi.cfg.action_horizon, DIMS) and torch.isfinite(chunk).all()
    assert (chunk - reference).abs().max() <= 1e-6
    # The loaded weights decide the actions: the randomly initialised policy's differ.
    fresh = built(kind, None)
    with torch.no_grad():
        assert (fresh.sample_actions(dict(obs), noise=noise) - chunk).abs().max() > 1e-3


def test_export_takes_the_tensors_the_policy_lacks_from_the_openpi_checkpoint():
    pytest.importorskip("orbax.checkpoint")
    policy = built("pi0", golden("pi0"))
    out = lerobot_state_dict(policy, golden("pi0"))
    ref = expected("pi0")
    for key in ("paligemma_with_expert.paligemma.model.language_model.norm.weight",
                "paligemma_with_expert.paligemma.model.language_model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(out[f"model.{key}"], torch.from_numpy(ref[key])), key
    assert all(torch.equal(out[f"model.{k}"], torch.from_numpy(v)) for k, v in ref.items())


def _resave(src: Path, dst: Path, change) -> Path:
    """``src`` re-saved by orbax with ``change(flat tree)`` applied, its assets copied."""
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.restore((src / "params").resolve())
        flat = openpi_ckpt._flatten(tree["params"])
        change(flat)
        nested: dict = {}
        for path, value in flat.items():
            node = nested
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        ckptr.save((dst / "params").resolve(), {"params": nested})
    shutil.copytree(src / "assets", dst / "assets")
    return dst


def test_a_tensor_the_mapping_has_no_place_for_is_named(tmp_path):
    lora = "PaliGemma/llm/layers/attn/q_einsum/lora_a"
    folder = _resave(golden("pi05"), tmp_path / "ckpt", lambda flat: flat.update({lora: np.zeros((2, 8, 64, 4),
                                                                                             np.float32)}))
    with pytest.raises(ValueError, match=r"1 tensor\(s\) of openpi's parameter tree have no place .*q_einsum/lora_a"):
        built("pi05", folder)


def test_a_tensor_missing_from_the_tree_is_named():
    pytest.importorskip("orbax.checkpoint")
    flat = openpi_ckpt.read_tree(golden("pi0"))
    for gone in ("action_out_proj/bias", "PaliGemma/llm/layers/mlp_1/linear", "PaliGemma/img/head/kernel"):
        with pytest.raises(ValueError, match=f"lacks {gone} "):
            openpi_ckpt.lerobot_tensors({k: v for k, v in flat.items() if k != gone})


def test_a_checkpoint_of_the_other_model_is_named_by_the_strict_loader():
    """pi0's tree has a state projection and pi0's time MLP, and plain expert norms; pi0.5's policy none of
    those: every difference is an error naming tensors, as for a LeRobot file."""
    pytest.importorskip("orbax.checkpoint")
    with pytest.raises(ValueError, match=r"tensor\(s\) have no place in policy=pi05 .*(state_proj|action_time_mlp)"):
        built("pi05", golden("pi0"), stats_from=golden("pi05"))
    with pytest.raises(ValueError, match=r"tensor\(s\) have no place in policy=pi0 .*dense"):
        built("pi0", golden("pi05"), stats_from=golden("pi0"))
    with pytest.raises(ValueError, match="state_input=continuous"):
        built("pi05", golden("pi05"), state_input="continuous")


def test_without_orbax_the_error_is_one_line_naming_the_extra(monkeypatch):
    def missing():
        raise ImportError("No module named 'orbax'")

    monkeypatch.setattr(openpi_ckpt, "_import_orbax", missing)
    with pytest.raises(ValueError, match=r"openpi checkpoint .*the openpi extra: pip install -e '\.\[openpi\]'") as e:
        check_pretrained_path(golden("pi0"))
    assert "\n" not in str(e.value)
    # A policy that names it stops before its model is built, as for a missing file.
    with pytest.raises(ValueError, match=r"\[openpi\]"):
        read_pretrained(golden("pi0"))


def test_a_params_folder_orbax_did_not_write_is_not_taken_for_one(tmp_path):
    (tmp_path / "params").mkdir()
    assert not openpi_ckpt.is_openpi_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="no openpi params/"):
        check_pretrained_path(tmp_path)


def test_statistics_come_from_the_assets_and_several_need_an_asset_id(tmp_path):
    raw, where = checkpoint_stats(golden("pi05"))
    assert where == golden("pi05") / "assets" / "droid" / "norm_stats.json"
    saved = json.loads(where.read_text())["norm_stats"]
    assert np.array_equal(raw["state"]["q99"], np.asarray(saved["state"]["q99"]))
    assert np.array_equal(raw["action"]["mean"], np.asarray(saved["actions"]["mean"]))
    shutil.copytree(golden("pi05") / "assets", tmp_path / "assets")
    other = {"norm_stats": {k: {s: [x + 1 for x in v] for s, v in d.items()} for k, d in saved.items()}}
    (tmp_path / "assets" / "libero").mkdir()
    (tmp_path / "assets" / "libero" / "norm_stats.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"several openpi norm_stats.json .*policy.openpi_asset_id \(one of "
                                         r"\['droid', 'libero'\]\)"):
        checkpoint_stats(tmp_path)
    picked, where = checkpoint_stats(tmp_path, "libero")
    assert where.parent.name == "libero" and np.allclose(picked["state"]["q99"], raw["state"]["q99"] + 1)
    with pytest.raises(ValueError, match=r"policy.openpi_asset_id='bridge'.*its asset ids: \['droid', 'libero'\]"):
        checkpoint_stats(tmp_path, "bridge")


def test_the_asset_id_is_a_policy_option_the_run_reads(tmp_path):
    from omegaconf import OmegaConf

    from slurmvla.policy.stats import checkpoint_normalization

    shutil.copytree(golden("pi0") / "assets", tmp_path / "assets")
    shutil.copytree(golden("pi0") / "assets" / "droid", tmp_path / "assets" / "other")
    pc = policy_cfg("pi0_tiny", pretrained_path=str(tmp_path), stats_source="checkpoint", openpi_asset_id="other")
    cfg = OmegaConf.create({"policy": dataclasses.asdict(pc), "data": {"state_normalization": "mean_std",
                                                                       "action_normalization": "mean_std"}})
    _, where = checkpoint_normalization(cfg, DIMS, DIMS)
    assert where == tmp_path / "assets" / "other" / "norm_stats.json"
