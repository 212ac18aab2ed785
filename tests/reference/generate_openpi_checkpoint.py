"""Write tiny openpi checkpoints (pi0 and pi0.5) with orbax itself, and the tensors openpi's own conversion
gives for them under LeRobot's names: the oracle for slurmvla's reading of openpi's checkpoint directory.

Run in the reference environment (tests/reference/make_env_openpi.sh: JAX, orbax-checkpoint, numpy; no
torch, no slurmvla):

    ../openpi_ckpt/bin/python tests/reference/generate_openpi_checkpoint.py

For each of pi0 and pi0.5 it writes tests/golden/openpi_tiny_<pi0|pi05>/:

- ``params/``: the parameter tree in openpi's layout (Physical-Intelligence/openpi at 15a9616:
  src/openpi/models/pi0.py, gemma.py, siglip.py), names and shapes as those modules define them at
  slurmvla's pi0_tiny / pi05_tiny sizes (conf/policy/pi0_tiny.yaml, pi05_tiny.yaml), random values, saved
  as openpi's CheckpointManager saves its ``params`` item (src/openpi/training/checkpoints.py: an orbax
  PyTreeCheckpointHandler given ``{"params": params}``). pi0's tree is saved as openpi's training saves it
  (an ``nnx.State``: every leaf under a ``value`` key, in float32); pi0.5's as the published checkpoints
  are (plain leaves), in bfloat16. One departure from openpi's sizes: the token embedding has 320 rows
  (the tiny byte vocabulary), not PaliGemma's 257,152;
- ``assets/droid/norm_stats.json``: openpi's statistics file (src/openpi/shared/normalize.py's layout);
- ``expected_lerobot.npz``: the tree read back with openpi's restore_params logic
  (src/openpi/models/model.py: restored as numpy float32, the ``value`` suffix dropped) and mapped by a
  port of openpi's examples/convert_jax_model_to_pytorch.py (slice_paligemma_state_dict,
  slice_gemma_state_dict and the projections of convert_pi0_checkpoint, numpy in place of torch, their
  transposes and reshapes as written there);
- ``meta.json``: versions, sizes, seed.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
SEED = {"pi0": 20260, "pi05": 20261}
# conf/policy/pi0_tiny.yaml / pi05_tiny.yaml, as openpi's gemma.Config and siglip's module options.
BACKBONE = dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8)
EXPERT = dict(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=8)
VISION = dict(width=32, depth=2, num_heads=2, mlp_dim=64, patch_size=16, image_size=64)
VOCAB = 320
ACTION_DIM = 32  # openpi's Pi0Config.action_dim: the published heads' width
DATA_DIM = 8  # the statistics' width (DROID: 7 joints + gripper)
ASSET_ID = "droid"


def tree_shapes(pi05: bool) -> dict:
    """openpi's parameter tree at the tiny sizes: {path: shape}, paths as flax / nnx name them."""
    b, e, v = BACKBONE, EXPERT, VISION
    L, Lv = b["depth"], v["depth"]
    hv = v["width"] // v["num_heads"]
    patches = (v["image_size"] // v["patch_size"]) ** 2
    shapes = {
        # siglip._Module(num_classes=paligemma width, variant=..., pool_type="none", scan=True)
        "PaliGemma/img/embedding/kernel": (v["patch_size"], v["patch_size"], 3, v["width"]),
        "PaliGemma/img/embedding/bias": (v["width"],),
        "PaliGemma/img/pos_embedding": (1, patches, v["width"]),
        "PaliGemma/img/Transformer/encoder_norm/scale": (v["width"],),
        "PaliGemma/img/Transformer/encoder_norm/bias": (v["width"],),
        "PaliGemma/img/head/kernel": (v["width"], b["width"]),
        "PaliGemma/img/head/bias": (b["width"],),
        # gemma.Module(configs=[paligemma, action expert]): one embedder (the first expert's width)
        "PaliGemma/llm/embedder/input_embedding": (VOCAB, b["width"]),
        "PaliGemma/llm/final_norm/scale": (b["width"],),
    }
    block = "PaliGemma/img/Transformer/encoderblock"  # nn.scan: every leaf gains a leading layer axis
    for ln in ("LayerNorm_0", "LayerNorm_1"):
        shapes[f"{block}/{ln}/scale"] = (Lv, v["width"])
        shapes[f"{block}/{ln}/bias"] = (Lv, v["width"])
    for proj in ("query", "key", "value"):
        shapes[f"{block}/MultiHeadDotProductAttention_0/{proj}/kernel"] = (Lv, v["width"], v["num_heads"], hv)
        shapes[f"{block}/MultiHeadDotProductAttention_0/{proj}/bias"] = (Lv, v["num_heads"], hv)
    shapes[f"{block}/MultiHeadDotProductAttention_0/out/kernel"] = (Lv, v["num_heads"], hv, v["width"])
    shapes[f"{block}/MultiHeadDotProductAttention_0/out/bias"] = (Lv, v["width"])
    shapes[f"{block}/MlpBlock_0/Dense_0/kernel"] = (Lv, v["width"], v["mlp_dim"])
    shapes[f"{block}/MlpBlock_0/Dense_0/bias"] = (Lv, v["mlp_dim"])
    shapes[f"{block}/MlpBlock_0/Dense_1/kernel"] = (Lv, v["mlp_dim"], v["width"])
    shapes[f"{block}/MlpBlock_0/Dense_1/bias"] = (Lv, v["width"])
    layers = "PaliGemma/llm/layers"
    for i, c in enumerate((b, e)):
        s = "" if i == 0 else f"_{i}"  # gemma._name
        shapes[f"{layers}/attn/q_einsum{s}/w"] = (L, c["num_heads"], c["width"], c["head_dim"])
        shapes[f"{layers}/attn/kv_einsum{s}/w"] = (L, 2, c["num_kv_heads"], c["width"], c["head_dim"])
        shapes[f"{layers}/attn/attn_vec_einsum{s}/w"] = (L, c["num_heads"], c["head_dim"], c["width"])
        shapes[f"{layers}/mlp{s}/gating_einsum"] = (L, 2, c["width"], c["mlp_dim"])
        shapes[f"{layers}/mlp{s}/linear"] = (L, c["mlp_dim"], c["width"])
        adaptive = pi05 and i == 1  # Pi0: use_adarms=[False, True] for pi0.5
        for norm in ("pre_attention_norm", "pre_ffw_norm"):
            if adaptive:  # RMSNorm with cond: nn.Dense(width * 3), no scale
                shapes[f"{layers}/{norm}{s}/Dense_0/kernel"] = (L, c["width"], 3 * c["width"])
                shapes[f"{layers}/{norm}{s}/Dense_0/bias"] = (L, 3 * c["width"])
            else:
                shapes[f"{layers}/{norm}{s}/scale"] = (L, c["width"])
        if i == 1:
            if adaptive:
                shapes[f"PaliGemma/llm/final_norm{s}/Dense_0/kernel"] = (c["width"], 3 * c["width"])
                shapes[f"PaliGemma/llm/final_norm{s}/Dense_0/bias"] = (3 * c["width"],)
            else:
                shapes[f"PaliGemma/llm/final_norm{s}/scale"] = (c["width"],)
    # pi0.Pi0: nnx.Linear heads
    heads = {"action_in_proj": (ACTION_DIM, e["width"]), "action_out_proj": (e["width"], ACTION_DIM)}
    if pi05:
        heads |= {"time_mlp_in": (e["width"], e["width"]), "time_mlp_out": (e["width"], e["width"])}
    else:
        heads |= {"state_proj": (ACTION_DIM, e["width"]), "action_time_mlp_in": (2 * e["width"], e["width"]),
                  "action_time_mlp_out": (e["width"], e["width"])}
    for name, (fan_in, fan_out) in heads.items():
        shapes[f"{name}/kernel"] = (fan_in, fan_out)
        shapes[f"{name}/bias"] = (fan_out,)
    return shapes


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def restore_params(params_path: Path) -> dict:
    """openpi's model.restore_params(params_path, restore_type=np.ndarray, dtype="float32"), flattened with
    "/" (flax's traverse_util.flatten_dict / nnx's flatten_mapping)."""
    with ocp.PyTreeCheckpointer() as ckptr:
        metadata = ckptr.metadata(params_path)
        item = {"params": metadata["params"]}
        params = ckptr.restore(params_path, ocp.args.PyTreeRestore(
            item=item,
            restore_args=jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray, dtype="float32"), item),
        ))["params"]
    flat = flatten(params)
    if all(k.endswith("/value") for k in flat):
        flat = {k[: -len("/value")]: v for k, v in flat.items()}
    return flat


# -- openpi's examples/convert_jax_model_to_pytorch.py, ported (numpy for torch) --------------------------


def slice_paligemma_state_dict(state_dict, config):
    suffix = "/value" if "img/embedding/kernel/value" in state_dict else ""
    P = "paligemma_with_expert.paligemma.model."
    vt = f"{P}vision_tower.vision_model."
    state_dict[f"{vt}embeddings.patch_embedding.weight"] = state_dict.pop(f"img/embedding/kernel{suffix}").transpose(3, 2, 0, 1)
    state_dict[f"{vt}embeddings.patch_embedding.bias"] = state_dict.pop(f"img/embedding/bias{suffix}")
    state_dict[f"{vt}embeddings.position_embedding.weight"] = state_dict.pop(f"img/pos_embedding{suffix}").reshape(
        -1, config.vision_config.hidden_size)
    eb = "img/Transformer/encoderblock/"
    ln0s = state_dict.pop(f"{eb}LayerNorm_0/scale{suffix}")
    ln0b = state_dict.pop(f"{eb}LayerNorm_0/bias{suffix}")
    ln1s = state_dict.pop(f"{eb}LayerNorm_1/scale{suffix}")
    ln1b = state_dict.pop(f"{eb}LayerNorm_1/bias{suffix}")
    d0k = state_dict.pop(f"{eb}MlpBlock_0/Dense_0/kernel{suffix}")
    d0b = state_dict.pop(f"{eb}MlpBlock_0/Dense_0/bias{suffix}")
    d1k = state_dict.pop(f"{eb}MlpBlock_0/Dense_1/kernel{suffix}")
    d1b = state_dict.pop(f"{eb}MlpBlock_0/Dense_1/bias{suffix}")
    att = {f"{p}_{kb}": state_dict.pop(f"{eb}MultiHeadDotProductAttention_0/{p}/{kb}{suffix}")
           for p in ("key", "value", "query", "out") for kb in ("kernel", "bias")}
    hs = config.vision_config.hidden_size
    for i in range(config.vision_config.num_hidden_layers):
        lp = f"{vt}encoder.layers.{i}."
        state_dict[f"{lp}layer_norm1.weight"] = ln0s[i].transpose()
        state_dict[f"{lp}layer_norm1.bias"] = ln0b[i]
        state_dict[f"{lp}layer_norm2.weight"] = ln1s[i].transpose()
        state_dict[f"{lp}layer_norm2.bias"] = ln1b[i]
        state_dict[f"{lp}mlp.fc1.weight"] = d0k[i].transpose()
        state_dict[f"{lp}mlp.fc1.bias"] = d0b[i]
        state_dict[f"{lp}mlp.fc2.weight"] = d1k[i].transpose()
        state_dict[f"{lp}mlp.fc2.bias"] = d1b[i]
        for jax_name, torch_name in (("key", "k_proj"), ("value", "v_proj"), ("query", "q_proj"), ("out", "out_proj")):
            state_dict[f"{lp}self_attn.{torch_name}.weight"] = att[f"{jax_name}_kernel"][i].reshape(-1, hs).transpose()
            state_dict[f"{lp}self_attn.{torch_name}.bias"] = att[f"{jax_name}_bias"][i].reshape(-1, hs).reshape(-1)
    state_dict[f"{vt}post_layernorm.weight"] = state_dict.pop(f"img/Transformer/encoder_norm/scale{suffix}").transpose()
    state_dict[f"{vt}post_layernorm.bias"] = state_dict.pop(f"img/Transformer/encoder_norm/bias{suffix}")
    state_dict[f"{P}multi_modal_projector.linear.weight"] = state_dict.pop(f"img/head/kernel{suffix}").transpose()
    state_dict[f"{P}multi_modal_projector.linear.bias"] = state_dict.pop(f"img/head/bias{suffix}")
    state_dict[f"{P}language_model.embed_tokens.weight"] = state_dict.pop(f"llm/embedder/input_embedding{suffix}")

    attn_vec = state_dict.pop(f"llm/layers/attn/attn_vec_einsum/w{suffix}")
    kv = state_dict.pop(f"llm/layers/attn/kv_einsum/w{suffix}")
    q = state_dict.pop(f"llm/layers/attn/q_einsum/w{suffix}")
    gating = state_dict.pop(f"llm/layers/mlp/gating_einsum{suffix}")
    linear = state_dict.pop(f"llm/layers/mlp/linear{suffix}")
    in_ln = state_dict.pop(f"llm/layers/pre_attention_norm/scale{suffix}")
    post_ln = state_dict.pop(f"llm/layers/pre_ffw_norm/scale{suffix}")
    tc = config.text_config
    for i in range(tc.num_hidden_layers):
        lp = f"{P}language_model.layers.{i}."
        state_dict[f"{lp}self_attn.q_proj.weight"] = q[i].transpose(0, 2, 1).reshape(
            tc.num_attention_heads * tc.head_dim, tc.hidden_size)
        state_dict[f"{lp}self_attn.k_proj.weight"] = kv[i, 0, 0].transpose()
        state_dict[f"{lp}self_attn.v_proj.weight"] = kv[i, 1, 0].transpose()
        state_dict[f"{lp}self_attn.o_proj.weight"] = attn_vec[i].transpose(2, 0, 1).reshape(
            tc.num_attention_heads * tc.head_dim, tc.hidden_size)
        state_dict[f"{lp}mlp.gate_proj.weight"] = gating[i, 0].transpose()
        state_dict[f"{lp}mlp.up_proj.weight"] = gating[i, 1].transpose()
        state_dict[f"{lp}mlp.down_proj.weight"] = linear[i].transpose()
        state_dict[f"{lp}input_layernorm.weight"] = in_ln[i]
        state_dict[f"{lp}post_attention_layernorm.weight"] = post_ln[i]
    state_dict[f"{P}language_model.norm.weight"] = state_dict.pop(f"llm/final_norm/scale{suffix}")

    expert_keys = [f"llm/final_norm_1/scale{suffix}", f"llm/final_norm_1/Dense_0/bias{suffix}",
                   f"llm/final_norm_1/Dense_0/kernel{suffix}", f"llm/layers/attn/attn_vec_einsum_1/w{suffix}",
                   f"llm/layers/attn/kv_einsum_1/w{suffix}", f"llm/layers/attn/q_einsum_1/w{suffix}",
                   f"llm/layers/mlp_1/gating_einsum{suffix}", f"llm/layers/mlp_1/linear{suffix}",
                   f"llm/layers/pre_attention_norm_1/scale{suffix}",
                   f"llm/layers/pre_attention_norm_1/Dense_0/bias{suffix}",
                   f"llm/layers/pre_attention_norm_1/Dense_0/kernel{suffix}",
                   f"llm/layers/pre_ffw_norm_1/scale{suffix}", f"llm/layers/pre_ffw_norm_1/Dense_0/bias{suffix}",
                   f"llm/layers/pre_ffw_norm_1/Dense_0/kernel{suffix}"]
    final, expert = {}, {}
    for key, value in state_dict.items():
        (expert if key in expert_keys else final)[key] = value
    return final, expert


def slice_gemma_state_dict(state_dict, config, *, num_expert, checkpoint_dir):
    suffix = "/value" if f"llm/layers/attn/attn_vec_einsum_{num_expert}/w/value" in state_dict else ""
    attn_vec = state_dict.pop(f"llm/layers/attn/attn_vec_einsum_{num_expert}/w{suffix}")
    kv = state_dict.pop(f"llm/layers/attn/kv_einsum_{num_expert}/w{suffix}")
    q = state_dict.pop(f"llm/layers/attn/q_einsum_{num_expert}/w{suffix}")
    gating = state_dict.pop(f"llm/layers/mlp_{num_expert}/gating_einsum{suffix}")
    linear = state_dict.pop(f"llm/layers/mlp_{num_expert}/linear{suffix}")
    pi05 = "pi05" in checkpoint_dir  # as openpi decides it
    if pi05:
        in_b = state_dict.pop(f"llm/layers/pre_attention_norm_{num_expert}/Dense_0/bias{suffix}")
        post_b = state_dict.pop(f"llm/layers/pre_ffw_norm_{num_expert}/Dense_0/bias{suffix}")
        in_k = state_dict.pop(f"llm/layers/pre_attention_norm_{num_expert}/Dense_0/kernel{suffix}")
        post_k = state_dict.pop(f"llm/layers/pre_ffw_norm_{num_expert}/Dense_0/kernel{suffix}")
    else:
        in_ln = state_dict.pop(f"llm/layers/pre_attention_norm_{num_expert}/scale{suffix}")
        post_ln = state_dict.pop(f"llm/layers/pre_ffw_norm_{num_expert}/scale{suffix}")
    E = "paligemma_with_expert.gemma_expert.model."
    for i in range(config.num_hidden_layers):
        lp = f"{E}layers.{i}."
        state_dict[f"{lp}self_attn.q_proj.weight"] = q[i].transpose(0, 2, 1).reshape(
            config.num_attention_heads * config.head_dim, config.hidden_size)
        state_dict[f"{lp}self_attn.k_proj.weight"] = kv[i, 0, 0].transpose()
        state_dict[f"{lp}self_attn.v_proj.weight"] = kv[i, 1, 0].transpose()
        state_dict[f"{lp}self_attn.o_proj.weight"] = attn_vec[i].reshape(
            config.num_attention_heads * config.head_dim, config.hidden_size).transpose(1, 0)
        state_dict[f"{lp}mlp.gate_proj.weight"] = gating[i, 0].transpose()
        state_dict[f"{lp}mlp.up_proj.weight"] = gating[i, 1].transpose()
        state_dict[f"{lp}mlp.down_proj.weight"] = linear[i].transpose()
        if pi05:
            state_dict[f"{lp}input_layernorm.dense.bias"] = in_b[i]
            state_dict[f"{lp}post_attention_layernorm.dense.bias"] = post_b[i]
            state_dict[f"{lp}input_layernorm.dense.weight"] = in_k[i].transpose()
            state_dict[f"{lp}post_attention_layernorm.dense.weight"] = post_k[i].transpose()
        else:
            state_dict[f"{lp}input_layernorm.weight"] = in_ln[i]
            state_dict[f"{lp}post_attention_layernorm.weight"] = post_ln[i]
    if pi05:
        state_dict[f"{E}norm.dense.bias"] = state_dict.pop(f"llm/final_norm_{num_expert}/Dense_0/bias{suffix}")
        state_dict[f"{E}norm.dense.weight"] = state_dict.pop(
            f"llm/final_norm_{num_expert}/Dense_0/kernel{suffix}").transpose()
    else:
        state_dict[f"{E}norm.weight"] = state_dict.pop(f"llm/final_norm_{num_expert}/scale{suffix}")
    return state_dict


def convert(flat: dict, checkpoint_dir: str, pi05: bool) -> dict:
    """convert_pi0_checkpoint's mapping, up to the state dict it loads into PI0Pytorch."""
    keys = (["action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"] if pi05 else
            ["state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out"])
    projection = {}
    for key in keys:
        projection[f"{key}.weight"] = np.array(flat[f"{key}/kernel"]).T
        projection[f"{key}.bias"] = np.array(flat[f"{key}/bias"])
    v, b, e = VISION, BACKBONE, EXPERT
    paligemma_config = SimpleNamespace(
        vision_config=SimpleNamespace(hidden_size=v["width"], num_hidden_layers=v["depth"]),
        text_config=SimpleNamespace(hidden_size=b["width"], num_hidden_layers=b["depth"],
                                    num_attention_heads=b["num_heads"], head_dim=b["head_dim"]))
    expert_config = SimpleNamespace(hidden_size=e["width"], num_hidden_layers=e["depth"],
                                    num_attention_heads=e["num_heads"], head_dim=e["head_dim"])
    paligemma = {k[len("PaliGemma/"):]: v for k, v in flat.items() if k.startswith("PaliGemma/")}
    paligemma_params, expert_params = slice_paligemma_state_dict(paligemma, paligemma_config)
    gemma_params = slice_gemma_state_dict(expert_params, expert_config, num_expert=1, checkpoint_dir=checkpoint_dir)
    out = {**paligemma_params, **gemma_params, **projection}
    leftover = sorted(k for k in out if "/" in k)
    assert not leftover, f"the conversion left openpi keys unmapped: {leftover}"
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def norm_stats(rng: np.random.Generator) -> dict:
    def one() -> dict:
        mean = rng.normal(0, 0.5, DATA_DIM)
        std = rng.uniform(0.1, 1.0, DATA_DIM)
        return {"mean": mean.tolist(), "std": std.tolist(), "q01": (mean - 2 * std).tolist(),
                "q99": (mean + 2 * std).tolist()}
    return {"norm_stats": {"state": one(), "actions": one()}}


def write(kind: str) -> None:
    pi05 = kind == "pi05"
    out = GOLDEN / f"openpi_tiny_{kind}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = np.random.default_rng(SEED[kind])
    dtype = ml_dtypes.bfloat16 if pi05 else np.float32
    flat = {path: (rng.standard_normal(shape) * 0.1).astype(np.float32).astype(dtype)
            for path, shape in tree_shapes(pi05).items()}
    tree = unflatten({f"{k}/value": v for k, v in flat.items()} if not pi05 else flat)  # nnx.State form for pi0
    with ocp.PyTreeCheckpointer() as ckptr:  # CheckpointManager's "params" item: PyTreeCheckpointHandler
        ckptr.save((out / "params").resolve(), {"params": tree})
    restored = restore_params((out / "params").resolve())
    assert sorted(restored) == sorted(flat), "orbax restored another tree"
    assert all(np.array_equal(restored[k], flat[k].astype(np.float32)) for k in flat), "orbax changed values"
    expected = convert(dict(restored), str(out), pi05)
    np.savez(out / "expected_lerobot.npz", **expected)
    (out / "assets" / ASSET_ID).mkdir(parents=True)
    (out / "assets" / ASSET_ID / "norm_stats.json").write_text(json.dumps(norm_stats(rng), indent=2))
    meta = {"made_by": {k: md.version(k) for k in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")},
            "python": sys.version.split()[0], "openpi": "Physical-Intelligence/openpi@15a9616", "seed": SEED[kind],
            "stored_dtype": "bfloat16" if pi05 else "float32", "nnx_value_leaves": not pi05, "vocab_size": VOCAB,
            "backbone": BACKBONE, "expert": EXPERT, "vision": VISION, "action_dim": ACTION_DIM,
            "asset_id": ASSET_ID, "openpi_tensors": len(flat), "lerobot_tensors": len(expected)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(kind, out, len(flat), "openpi tensors ->", len(expected), "LeRobot tensors")


if __name__ == "__main__":
    for kind in ("pi0", "pi05"):
        write(kind)
