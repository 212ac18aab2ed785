"""A second oracle: does LeRobot 0.4.4 (openpi's patched transformers) compute what LeRobot 0.6.1 computed?

Run in the 0.4.4 reference environment (never slurmvla's):

    bash tests/reference/make_env_lerobot044.sh ../lerobot044
    ../lerobot044/bin/python tests/reference/compare_lerobot044.py
        # writes tests/golden/lerobot061/agreement_lerobot044.json

Everything possible is reused from tests/reference/generate_pi0_golden.py (imported, not copied): its
``build`` (config, policy, seeded weights, processors with the committed tokenizer), ``patch_sizes``,
``lerobot_batch``, ``inputs``, the size constants and ``_stats``; weights come from
tests/reference/tiny_weights.py with the same seed.

What is patched in LeRobot 0.4.4, and nothing else: the same size tables as in 0.6.1.
  * ``get_gemma_config`` (in 0.4.4 it also lives in ``lerobot/policies/{pi0,pi05}/modeling_*.py``, beside
    its ``GemmaConfig`` class) learns gemma_tiny_backbone / gemma_tiny_expert, via the generator's own
    ``patch_sizes``.
  * PaliGemma's config: 0.4.4 builds it exactly as 0.6.1 does (``CONFIG_MAPPING["paligemma"]()`` with the
    published SigLIP / vocabulary sizes written in) but instantiates transformers' own (openpi-patched)
    ``PaliGemmaForConditionalGeneration`` / ``GemmaForCausalLM``, where 0.6.1 instantiates its
    ``PaliGemmaForConditionalGenerationWithPiGemma`` / ``PiGemmaForCausalLM``. The generator's
    ``patch_sizes`` subclasses those two names; here they are aliased to 0.4.4's names around that call, so
    the same tiny SigLIP sizes, projection_dim = backbone width and the 320-id vocabulary go in before
    the model is built.
Import shims, which compute nothing: 0.4.4's ``_transformers_available`` is forced to True (it looks for a
distribution named ``transformers`` and finds ``transformers-openpi``, so without this its modeling modules
bind the transformers classes to None); 0.4.4's ``lerobot.configs`` is a namespace package without the
``FeatureType`` / ``PolicyFeature`` re-exports that ``build`` imports (they are taken from
``lerobot.configs.types``), and ``_stats`` returns the statistics read from the committed checkpoint
(tests/golden/lerobot061/{kind}/checkpoint/*normalizer_processor.safetensors) instead of recomputing them
(they are compared with the recomputed ones and recorded). The committed tokenizer is loaded from a temporary
copy whose tokenizer_config.json names ``PreTrainedTokenizerFast`` instead of transformers 5's
``TokenizersBackend`` (unknown to transformers 4.53); tokenizer.json is used as committed.

Inputs are the golden ones (frames, state, actions, noise, time, sampling noise) read from
tests/golden/lerobot061/{kind}/golden.safetensors. Two passes per policy:
  end_to_end   LeRobot 0.4.4's own processors and image preprocessing from the raw frames and tasks.
  model_only   0.4.4's model fed the golden pixels and the golden prompt ids / mask (so differences in
               preprocessing are taken out and only the network and the flow matching are compared).
Figures: max abs difference and relative = max abs difference / max abs of the golden value.
"""

from __future__ import annotations

import importlib.metadata as md
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import generate_pi0_golden as gen  # noqa: E402
from tiny_weights import fingerprint, tiny_state_dict  # noqa: E402

GOLD = gen.OUT
OUT_JSON = GOLD / "agreement_lerobot044.json"
REL_TOL = 1e-5
QUANTITIES = ("pixels", "prompt_ids", "velocity", "losses", "loss", "chunk_normalized", "chunk")


# ----------------------------------------------------------------------------------------------- patches
def _shim_transformers_available() -> None:
    """0.4.4 decides whether transformers is installed from the *distribution* name ``transformers``
    (importlib.metadata.version); openpi's is installed as ``transformers-openpi``, so 0.4.4 finds no
    transformers and its modeling modules bind PaliGemmaForConditionalGeneration / GemmaForCausalLM /
    CONFIG_MAPPING to None (the import succeeds, building a policy fails). Set the flag before those
    modules are imported."""
    import lerobot.utils.import_utils as iu

    iu._transformers_available = True


def _shim_configs() -> None:
    import lerobot.configs as configs

    if not hasattr(configs, "FeatureType"):
        from lerobot.configs.types import FeatureType, PolicyFeature

        configs.FeatureType, configs.PolicyFeature = FeatureType, PolicyFeature


_generator_patch_sizes = gen.patch_sizes


def _patch_sizes_044(modeling) -> None:
    """The generator's size patch, applied to the classes 0.4.4 instantiates."""
    modeling.PaliGemmaForConditionalGenerationWithPiGemma = modeling.PaliGemmaForConditionalGeneration
    modeling.PiGemmaForCausalLM = modeling.GemmaForCausalLM
    _generator_patch_sizes(modeling)
    modeling.PaliGemmaForConditionalGeneration = modeling.PaliGemmaForConditionalGenerationWithPiGemma
    modeling.GemmaForCausalLM = modeling.PiGemmaForCausalLM


def _tokenizer_dir_044() -> Path:
    """The committed tokenizer, readable by transformers 4.53: transformers 5 wrote
    ``"tokenizer_class": "TokenizersBackend"`` (a class 4.53 does not have) into tokenizer_config.json; the
    copy names ``PreTrainedTokenizerFast`` instead. tokenizer.json (vocabulary, <bos> template) is unchanged."""
    import atexit
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tokenizer044_"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    shutil.copy(GOLD / "tokenizer" / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((GOLD / "tokenizer" / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return d


def _checkpoint_stats(kind: str) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    (path,) = sorted((GOLD / kind / "checkpoint").glob("policy_preprocessor_step_*_normalizer_processor.safetensors"))
    flat = load_file(str(path))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        feature, stat = k.rsplit(".", 1)
        out.setdefault(feature, {})[stat] = v
    return out


# ------------------------------------------------------------------------------------------- weights
_RENAMES = [  # 0.4.4 name fragment -> 0.6.1 name fragment, tried only where a name is missing
    ("paligemma.language_model.", "paligemma.model.language_model."),
    ("paligemma.vision_tower.", "paligemma.model.vision_tower."),
    ("paligemma.multi_modal_projector.", "paligemma.model.multi_modal_projector."),
]


def _map_names(names_044, names_061) -> dict[str, str]:
    out = {}
    for k in names_044:
        if k in names_061:
            out[k] = k
            continue
        for a, b in _RENAMES:
            if a in k and k.replace(a, b) in names_061:
                out[k] = k.replace(a, b)
                break
    return out


def _load_golden_weights(policy, shapes_044, ties_044) -> dict:
    """Load the 0.6.1 golden tensors (rebuilt from the seed under 0.6.1's names) into 0.4.4's policy."""
    sd061 = json.loads((GOLD / policy.name / "state_dict.json").read_text())
    shapes_061, ties_061 = sd061["shapes"], sd061["ties"]
    golden = tiny_state_dict(shapes_061, ties_061, gen.SEED)
    mapping = _map_names(shapes_044, shapes_061)
    report = {
        "num_tensors_044": len(shapes_044), "num_tensors_061": len(shapes_061),
        "ties_044": ties_044, "ties_061": ties_061,
        "renamed_044_to_061": {k: v for k, v in mapping.items() if k != v},
        "only_in_044": sorted(set(shapes_044) - set(mapping)),
        "only_in_061": sorted(set(shapes_061) - set(mapping.values())),
        "shape_mismatch": {k: [shapes_044[k], shapes_061[v]] for k, v in mapping.items()
                           if list(shapes_044[k]) != list(shapes_061[v])},
        "fingerprint_061_rebuilt": fingerprint(golden),
        "fingerprint_061_meta": json.loads((GOLD / "meta.json").read_text())[policy.name]["weights_fingerprint"],
    }
    if report["only_in_044"] or report["shape_mismatch"]:
        raise SystemExit(f"cannot map 0.4.4's state dict onto 0.6.1's: {report}")
    load = {}
    for k in shapes_044:
        src = ties_044.get(k)  # a tied name gets the value of the tensor it shares storage with
        load[k] = torch.from_numpy(golden[mapping[src if src else k]].copy())
    missing, unexpected = policy.load_state_dict(load, strict=True)
    assert not missing and not unexpected
    sd = policy.state_dict()
    report["tensors_differing_from_061_by_name"] = sorted(
        k for k in shapes_044 if not np.array_equal(sd[k].numpy(), golden[mapping[k]]))
    return report


# ------------------------------------------------------------------------------------------- compute
def _compute(policy, pre, post, x: dict, golden: dict | None = None) -> dict[str, torch.Tensor]:
    """generate_pi0_golden.run's computation, with 0.4.4's policy; ``golden`` feeds golden pixels / tokens."""
    model = policy.model
    model.sample_noise = lambda shape, device: x["noise"].clone()
    model.sample_time = lambda bsize, device: x["time"].clone()
    seen: dict[str, torch.Tensor] = {}

    def keep_velocity(module, args, output):
        seen.setdefault("velocity", output.detach().clone())

    hook = model.action_out_proj.register_forward_hook(keep_velocity)
    inner = type(model).forward.__get__(model)

    def forward(*a, **kw):
        losses = inner(*a, **kw)
        seen["losses"] = losses.detach().clone()
        return losses

    model.forward = forward
    preprocess = type(policy)._preprocess_images.__get__(policy)

    def preprocess_images(batch):
        images, masks = preprocess(batch)
        if golden is not None:
            images = [golden["pixels"][:, 0].clone(), golden["pixels"][:, 1].clone(), *images[2:]]
            masks = [golden["image_masks"][:, i].clone() for i in range(len(masks))]
        seen["pixels"] = torch.stack(images[:2], dim=1).detach().clone()
        seen["image_masks"] = torch.stack(masks, dim=1).clone()
        return images, masks

    policy._preprocess_images = preprocess_images
    processed = pre(gen.lerobot_batch(x))
    if golden is not None:
        processed["observation.language.tokens"] = golden["prompt_ids"].clone()
        processed["observation.language.attention_mask"] = golden["prompt_mask"].clone()
    loss, _ = policy.forward(processed)
    out = {"velocity": seen["velocity"], "losses": seen["losses"], "loss": loss.detach().reshape(1),
           "pixels": seen["pixels"], "image_masks": seen["image_masks"],
           "prompt_ids": processed["observation.language.tokens"].long(),
           "prompt_mask": processed["observation.language.attention_mask"].bool(),
           "normalized_state": processed["observation.state"].float(),
           "normalized_actions": processed["action"].float()}
    model.sample_noise = lambda shape, device: x["sample_noise"].clone()
    seen.clear()
    chunk = policy.predict_action_chunk({k: v for k, v in processed.items() if k != "action"})
    out["chunk_normalized"] = chunk.detach().clone()
    out["chunk"] = post(chunk).detach().clone()
    hook.remove()
    del model.forward, policy._preprocess_images
    return out


def _diff(a: torch.Tensor, g: torch.Tensor) -> dict:
    if tuple(a.shape) != tuple(g.shape):
        return {"comparable": False, "shape_044": list(a.shape), "shape_061": list(g.shape)}
    a64, g64 = a.double(), g.double()
    d = (a64 - g64).abs()
    mad, ref = float(d.max()), float(g64.abs().max())
    out = {"max_abs": mad, "max_rel": mad / ref if ref else None, "golden_max_abs": ref,
           "elements_differing": int((d > 0).sum()), "elements": int(d.numel())}
    out["agree"] = bool(out["max_rel"] is not None and out["max_rel"] <= REL_TOL) or mad == 0.0
    return out


# ---------------------------------------------------------------------------------- diagnostics
def _where(obj, needle: str) -> str:
    """'lerobot/...py:LINE: text' for the first line of obj's source that contains needle."""
    lines, start = inspect.getsourcelines(obj)
    path = inspect.getsourcefile(obj)
    rel = path[path.index("lerobot/"):] if "lerobot/" in path else path
    for i, line in enumerate(lines):
        if needle in line:
            return f"{rel}:{start + i}: {line.strip()}"
    return f"{rel}: '{needle}' not found"


def _behaviour_differences(kind, modeling, proc_module, e2e, golden, tokenizer, weights) -> list[dict]:
    diffs = []
    # Image padding: 0.4.4's resize_with_pad_torch pads float images with -1.0 *before* the [0,1] -> [-1,1]
    # map (so pads become -3), 0.6.1's pads with 0.0 (pads become -1).
    pix = e2e["pixels"]
    differing_rows = ((pix - golden["pixels"]).abs().amax(dim=(0, 1, 2, 4)) > 0).nonzero().flatten().tolist()
    if differing_rows:
        pad_vals = sorted({float(v) for v in pix[:, :, :, differing_rows, :].unique()})
        gold_vals = sorted({float(v) for v in golden["pixels"][:, :, :, differing_rows, :].unique()})
        diffs.append({
            "what": "image padding value",
            "detail": f"resize-with-pad of the {gen.RAW_H}x{gen.RAW_W} frames to {gen.IMAGE_SIZE}x{gen.IMAGE_SIZE}: "
                      f"rows {differing_rows} (the padding) are {pad_vals} in 0.4.4 and {gold_vals} in 0.6.1. "
                      "0.4.4 pads float images with -1.0 and clamps to [-1, 1] while its images are still in "
                      "[0, 1]; the later img * 2 - 1 turns the padding into -3. 0.6.1 pads with 0.0 and clamps "
                      "to [0, 1] (common/vla_utils.py resize_with_pad_torch), so its padding is -1. The resized "
                      "(non-padding) pixels are identical.",
            "where_044": [_where(modeling.resize_with_pad_torch, "constant_value = "),
                          _where(modeling.resize_with_pad_torch, "clamp(-1.0, 1.0)"),
                          _where(_policy_cls(modeling)._preprocess_images, "img * 2.0 - 1.0")],
        })
    if weights["ties_044"] != weights["ties_061"]:
        diffs.append({
            "what": "PaliGemma lm_head tied to the token embeddings",
            "detail": f"0.4.4 (transformers 4.53) ties {weights['ties_044']}; 0.6.1 (transformers 5.5.4) has "
                      f"ties {weights['ties_061']}, so its state dict holds an lm_head of its own (the golden "
                      "weights give it its own seeded values). Here lm_head takes the embedding's values. No "
                      "effect on any output: pi0 / pi0.5 never call lm_head.",
            "where_044": ["transformers PaliGemmaForConditionalGeneration._tied_weights_keys / "
                          "tie_word_embeddings (transformers-openpi 4.53.3)"],
        })
    if kind == "pi05":
        ids = e2e["prompt_ids"]
        if not torch.equal(ids, golden["prompt_ids"]):
            p044 = [tokenizer.decode(r[m], skip_special_tokens=True) for r, m in zip(ids, e2e["prompt_mask"])]
            p061 = [tokenizer.decode(r[m], skip_special_tokens=True)
                    for r, m in zip(golden["prompt_ids"], golden["prompt_mask"])]
            diffs.append({
                "what": "pi0.5 prompt: state padded to 32 dims before discretizing",
                "detail": "0.4.4's Pi05PrepareStateTokenizerProcessorStep pads the normalized state to "
                          "max_state_dim=32 with zeros before np.digitize, so the prompt carries 32 bins (the 24 "
                          "padded dims give bin 128); 0.6.1 discretizes only the real state dims.",
                "prompt_044": p044, "prompt_061": p061,
                "prompt_len_044": e2e["prompt_mask"].sum(1).tolist(),
                "prompt_len_061": golden["prompt_mask"].sum(1).tolist(),
                "where_044": [_where(proc_module.Pi05PrepareStateTokenizerProcessorStep, "pad_vector(state")],
            })
    return diffs


def _policy_cls(modeling):
    return modeling.PI0Policy if hasattr(modeling, "PI0Policy") else modeling.PI05Policy


def _other_checks(kind, modeling, config_cls, tokenizer_dir) -> dict:
    """Whether 0.4.4 reads 0.6.1's saved config / processors (recorded, not required)."""
    out = {}
    ckpt = GOLD / kind / "checkpoint"
    try:
        config_cls.from_pretrained(str(ckpt))
        out["config_json_061_loads_in_044"] = True
    except Exception as e:  # noqa: BLE001
        out["config_json_061_loads_in_044"] = f"no: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    import transformers
    from lerobot.processor import PolicyProcessorPipeline

    real = transformers.AutoTokenizer.from_pretrained
    transformers.AutoTokenizer.from_pretrained = lambda name, *a, **kw: real(str(tokenizer_dir), *a, **kw)
    try:
        for name in ("policy_preprocessor.json", "policy_postprocessor.json"):
            try:
                PolicyProcessorPipeline.from_pretrained(str(ckpt), config_filename=name)
                out[f"{name}_061_loads_in_044"] = True
            except Exception as e:  # noqa: BLE001
                out[f"{name}_061_loads_in_044"] = f"no: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    finally:
        transformers.AutoTokenizer.from_pretrained = real
    out["embedding_scale"] = ("0.4.4 multiplies the token embeddings by sqrt(width) in embed_prefix ("
                              + _where(modeling.PI0Pytorch.embed_prefix if hasattr(modeling, "PI0Pytorch")
                                       else modeling.PI05Pytorch.embed_prefix, "math.sqrt")
                              + "); 0.6.1 gets the same factor from transformers 5's GemmaTextScaledWordEmbedding: "
                              "not a difference in the result")
    return out


# ---------------------------------------------------------------------------------------------- main
def run(kind: str) -> dict:
    from safetensors.torch import load_file

    if kind == "pi0":
        from lerobot.policies.pi0 import modeling_pi0 as modeling
        from lerobot.policies.pi0 import processor_pi0 as proc_module
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
    else:
        from lerobot.policies.pi05 import modeling_pi05 as modeling
        from lerobot.policies.pi05 import processor_pi05 as proc_module
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config

    tokenizer_dir = _tokenizer_dir_044()
    ckpt_stats = _checkpoint_stats(kind)
    recomputed = {"observation.state": gen._stats(gen.STATE_DIM, 1), "action": gen._stats(gen.ACTION_DIM, 2)}
    stats_gap = max(float((ckpt_stats[f][s] - recomputed[f][s]).abs().max()) for f in recomputed for s in recomputed[f])
    original_stats = gen._stats
    gen._stats = lambda dim, salt: ckpt_stats["observation.state" if salt == 1 else "action"]
    try:
        policy, pre, post, _tensors, shapes, ties, _ = gen.build(kind, tokenizer_dir)
    finally:
        gen._stats = original_stats
    weights = _load_golden_weights(policy, shapes, ties)

    golden = load_file(str(GOLD / kind / "golden.safetensors"))
    x = {k: golden[k] for k in ("frames", "state", "actions", "noise", "time", "sample_noise")}
    regenerated = gen.inputs()
    inputs_regenerate = all(torch.equal(regenerated[k], x[k]) for k in x)

    e2e = _compute(policy, pre, post, x)
    model_only = _compute(policy, pre, post, x, golden=golden)

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    result = {
        "end_to_end": {q: _diff(e2e[q], golden[q]) for q in QUANTITIES},
        "model_only_golden_pixels_and_prompt": {q: _diff(model_only[q], golden[q]) for q in QUANTITIES
                                                if q not in ("pixels", "prompt_ids")},
        "also_compared_end_to_end": {q: _diff(e2e[q], golden[q])
                                     for q in ("prompt_mask", "image_masks", "normalized_state", "normalized_actions")},
        "behaviour_differences": _behaviour_differences(kind, modeling, proc_module, e2e, golden, tokenizer, weights),
        "weights": weights,
        "checkpoint_stats_vs_recomputed_max_abs": stats_gap,
        "golden_inputs_regenerate_under_this_torch": inputs_regenerate,
        "other_checks": _other_checks(kind, modeling, Config, tokenizer_dir),
    }
    result["agree_end_to_end"] = all(v.get("agree", False) for v in result["end_to_end"].values())
    result["agree_model_only"] = all(v.get("agree", False)
                                     for v in result["model_only_golden_pixels_and_prompt"].values())
    return result


def main() -> None:
    _shim_transformers_available()
    _shim_configs()
    gen.patch_sizes = _patch_sizes_044
    torch.set_num_threads(1)
    import transformers

    out = {
        "about": "LeRobot 0.4.4 (with openpi's transformers-openpi) against the LeRobot 0.6.1 golden files, same "
                 "tiny sizes, seeded weights and inputs; made by tests/reference/compare_lerobot044.py (see its "
                 "docstring for what is patched). relative = max abs diff / max abs of the golden value; "
                 f"'agree' means relative <= {REL_TOL}. 'losses' is the per-element loss (B, H, 32), "
                 "'chunk_normalized' the sampled chunk before the postprocessor, 'chunk' after it.",
        "versions_044": {"lerobot": md.version("lerobot"), "transformers": transformers.__version__,
                         "transformers_dist": "transformers-openpi " + md.version("transformers-openpi"),
                         "torch": md.version("torch"), "numpy": md.version("numpy"),
                         "python": sys.version.split()[0]},
        "versions_061": {**json.loads((GOLD / "meta.json").read_text())["made_by"],
                         "python": json.loads((GOLD / "meta.json").read_text())["python"]},
        "patched_044": "size tables only, as for 0.6.1: get_gemma_config gains the tiny variants; PaliGemma's "
                       "vision config / vocabulary set to the tiny sizes before the (openpi-patched) transformers "
                       "PaliGemmaForConditionalGeneration / GemmaForCausalLM are built",
    }
    out["compatibility_notes_044"] = [
        "lerobot.utils.import_utils._transformers_available is False with transformers-openpi (0.4.4 asks "
        "importlib.metadata for a distribution named 'transformers'), so lerobot/policies/{pi0,pi05}/modeling_*.py "
        "bind PaliGemmaForConditionalGeneration / GemmaForCausalLM / CONFIG_MAPPING to None: the policies import "
        "but cannot be built. Forced to True here before the import.",
        "The committed tokenizer's tokenizer_config.json (written by transformers 5) names tokenizer_class "
        "'TokenizersBackend', which transformers 4.53 cannot load; read through a copy naming "
        "'PreTrainedTokenizerFast' (tokenizer.json unchanged).",
        "lerobot.configs has no FeatureType / PolicyFeature re-exports in 0.4.4 (lerobot.configs.types).",
        "0.6.1's saved config.json and processor JSONs do not load in 0.4.4 (see other_checks per policy).",
    ]
    for kind in ("pi0", "pi05"):
        out[kind] = run(kind)
        print(kind, {q: (v.get("max_abs"), v.get("max_rel")) for q, v in out[kind]["end_to_end"].items()})
        print(kind, "model only", {q: (v.get("max_abs"), v.get("max_rel"))
                                   for q, v in out[kind]["model_only_golden_pixels_and_prompt"].items()})
    OUT_JSON.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", OUT_JSON)


if __name__ == "__main__":
    main()
