"""openpi's own checkpoint directory as a source of pi0 / pi0.5 weights (``policy.pretrained_path``).

openpi (Physical-Intelligence/openpi) saves a model as a directory with ``params/`` (an orbax PyTree
checkpoint of the parameter tree: PaliGemma's SigLIP under ``PaliGemma/img``, its Gemma and the action
expert under ``PaliGemma/llm`` -- the expert's weights with the suffix ``_1`` --, and the action heads at
the top) and ``assets/<asset_id>/norm_stats.json``. The tree is read with orbax (the ``openpi`` extra:
JAX and orbax-checkpoint; orbax writes OCDBT through tensorstore, which nothing lighter reads) and mapped
onto the names of LeRobot's PI0Policy / PI05Policy state dict, which :mod:`slurmvla.policy.pi0.weights`
loads strictly. The mapping follows openpi's examples/convert_jax_model_to_pytorch.py: the layers of both
Gemma stacks and of SigLIP are stacked on a leading axis (``nn.scan``); Gemma's attention and MLP
weights are einsum kernels (``q_einsum`` [N, D, H], ``kv_einsum`` [2, K, D, H], ``attn_vec_einsum``
[N, H, D], ``gating_einsum`` [2, D, F], ``linear`` [F, D]) and flax's Dense kernels are [in, out], the
transpose of torch's Linear. pi0.5's expert norms are adaptive (a ``Dense_0`` modulation, no scale).
Every tensor of the tree is accounted for: one this mapping has no place for, or one it needs and the
tree lacks, fails naming it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

EXTRA = "pip install -e '.[openpi]'"
# The heads of openpi's Pi0 (src/openpi/models/pi0.py): nnx.Linear, kernel [in, out] and bias.
HEADS = ("action_in_proj", "action_out_proj", "state_proj", "action_time_mlp_in", "action_time_mlp_out",
         "time_mlp_in", "time_mlp_out")
_PG = "paligemma_with_expert.paligemma.model."
_VT = f"{_PG}vision_tower.vision_model."
_EXPERT = "paligemma_with_expert.gemma_expert.model."


def is_openpi_checkpoint(root: Path) -> bool:
    """An openpi checkpoint directory: a ``params/`` folder that orbax wrote (its metadata files)."""
    params = root / "params"
    return params.is_dir() and any((params / f).exists() for f in ("_METADATA", "_CHECKPOINT_METADATA",
                                                                     "manifest.ocdbt", "checkpoint"))


def require_orbax(path: str | Path) -> None:
    """A ValueError naming the ``openpi`` extra when JAX or orbax-checkpoint is not installed."""
    try:
        _import_orbax()
    except ImportError as e:
        raise ValueError(f"policy.pretrained_path={str(path)!r} is an openpi checkpoint (orbax's params/); reading it "
                         f"needs JAX and orbax-checkpoint, the openpi extra: {EXTRA} ({e})") from None


def _import_orbax():
    if "jax" not in sys.modules:
        # The tree is restored as numpy arrays on the host: a JAX that could see a GPU would otherwise claim most
        # of its memory, beside torch's.
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import orbax.checkpoint as ocp

    return jax, ocp


def read_tree(root: Path) -> dict[str, np.ndarray]:
    """The parameter tree under ``root/params`` as float32 numpy arrays, flattened with "/" (openpi's
    restore_params: the ``params`` item, the ``value`` level that a training save's ``nnx.State`` adds dropped)."""
    require_orbax(root)
    jax, ocp = _import_orbax()
    params_dir = (root / "params").resolve()
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            metadata = ckptr.metadata(params_dir)
            tree = getattr(metadata, "tree", metadata)
            if "params" not in tree:
                raise ValueError(f"its top level holds {sorted(tree)}, not openpi's 'params' item")
            item = {"params": tree["params"]}
            args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray, dtype=np.float32), item)
            params = ckptr.restore(params_dir, ocp.args.PyTreeRestore(item=item, restore_args=args))["params"]
    except Exception as e:  # a damaged or foreign checkpoint: orbax's and tensorstore's errors are long
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"policy.pretrained_path: cannot read {params_dir} as openpi's orbax parameter tree "
                         f"({first})") from None
    flat = _flatten(params)
    if flat and all(k.endswith("/value") for k in flat):
        flat = {k[: -len("/value")]: v for k, v in flat.items()}
    return {k: np.asarray(v, dtype=np.float32) for k, v in flat.items()}


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _Tree:
    """The flat tree with accounting: every tensor taken is marked; what is never taken is reported."""

    def __init__(self, flat: dict[str, np.ndarray], where: str) -> None:
        self.flat, self.where, self.used = flat, where, set()

    def has(self, key: str) -> bool:
        return key in self.flat

    def take(self, key: str) -> np.ndarray:
        if key not in self.flat:
            raise ValueError(f"{self.where}: openpi's parameter tree lacks {key} (pi0 / pi0.5 need it)")
        self.used.add(key)
        return self.flat[key]

    def left(self) -> list[str]:
        return sorted(set(self.flat) - self.used)


def lerobot_tensors(flat: dict[str, np.ndarray], where: str = "params") -> dict[str, np.ndarray]:
    """openpi's flat tree -> the same weights under LeRobot's PI0Policy / PI05Policy names (without the
    ``model.`` prefix, as openpi's conversion writes them). Strict: a tensor of the tree left unmapped is a
    ValueError naming it."""
    t = _Tree(flat, where)
    out: dict[str, np.ndarray] = {}
    _siglip(t, out)
    out[f"{_PG}language_model.embed_tokens.weight"] = t.take("PaliGemma/llm/embedder/input_embedding")
    out[f"{_PG}language_model.norm.weight"] = t.take("PaliGemma/llm/final_norm/scale")
    _gemma(t, out, "", f"{_PG}language_model.")
    _gemma(t, out, "_1", _EXPERT)
    for name in HEADS:
        if t.has(f"{name}/kernel"):
            out[f"{name}.weight"] = t.take(f"{name}/kernel").T
            out[f"{name}.bias"] = t.take(f"{name}/bias")
    if "action_in_proj.weight" not in out:
        t.take("action_in_proj/kernel")  # the error naming it
    left = t.left()
    if left:
        raise ValueError(f"{where}: {len(left)} tensor(s) of openpi's parameter tree have no place in slurmvla's "
                         f"mapping (slurmvla/policy/pi0/openpi.py), first: {left[:5]}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _siglip(t: _Tree, out: dict) -> None:
    """SigLIP (siglip._Module, scan=True): Conv kernel [P, P, C, W] -> [W, C, P, P]; the encoder blocks
    stacked on axis 0; attention kernels [W, heads, head_dim] (query / key / value) and [heads, head_dim, W]
    (out); the head (the multimodal projector) a Dense."""
    img = "PaliGemma/img/"
    out[f"{_VT}embeddings.patch_embedding.weight"] = t.take(f"{img}embedding/kernel").transpose(3, 2, 0, 1)
    out[f"{_VT}embeddings.patch_embedding.bias"] = t.take(f"{img}embedding/bias")
    pos = t.take(f"{img}pos_embedding")
    out[f"{_VT}embeddings.position_embedding.weight"] = pos.reshape(-1, pos.shape[-1])
    block = f"{img}Transformer/encoderblock/"
    attn = f"{block}MultiHeadDotProductAttention_0/"
    for i in range(t.take(f"{block}LayerNorm_0/scale").shape[0]):
        layer = f"{_VT}encoder.layers.{i}."
        for norm, name in (("LayerNorm_0", "layer_norm1"), ("LayerNorm_1", "layer_norm2")):
            out[f"{layer}{name}.weight"] = t.take(f"{block}{norm}/scale")[i]
            out[f"{layer}{name}.bias"] = t.take(f"{block}{norm}/bias")[i]
        for dense, name in (("Dense_0", "fc1"), ("Dense_1", "fc2")):
            out[f"{layer}mlp.{name}.weight"] = t.take(f"{block}MlpBlock_0/{dense}/kernel")[i].T
            out[f"{layer}mlp.{name}.bias"] = t.take(f"{block}MlpBlock_0/{dense}/bias")[i]
        for proj, name in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            kernel = t.take(f"{attn}{proj}/kernel")[i]  # [W, heads, head_dim]
            out[f"{layer}self_attn.{name}.weight"] = kernel.reshape(kernel.shape[0], -1).T
            out[f"{layer}self_attn.{name}.bias"] = t.take(f"{attn}{proj}/bias")[i].reshape(-1)
        kernel = t.take(f"{attn}out/kernel")[i]  # [heads, head_dim, W]
        out[f"{layer}self_attn.out_proj.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
        out[f"{layer}self_attn.out_proj.bias"] = t.take(f"{attn}out/bias")[i]
    out[f"{_VT}post_layernorm.weight"] = t.take(f"{img}Transformer/encoder_norm/scale")
    out[f"{_VT}post_layernorm.bias"] = t.take(f"{img}Transformer/encoder_norm/bias")
    out[f"{_PG}multi_modal_projector.linear.weight"] = t.take(f"{img}head/kernel").T
    out[f"{_PG}multi_modal_projector.linear.bias"] = t.take(f"{img}head/bias")


def _gemma(t: _Tree, out: dict, s: str, prefix: str) -> None:
    """One Gemma stack of gemma.Module (``s``: "" for PaliGemma's, "_1" for the action expert's), its
    layers stacked on axis 0. RMSNorm scales are Gemma's (1 + scale), as transformers' are; an adaptive
    RMSNorm's Dense_0 ([W, 3W]) is the torch model's ``.dense``."""
    layers = "PaliGemma/llm/layers/"
    for i in range(t.take(f"{layers}attn/q_einsum{s}/w").shape[0]):
        layer = f"{prefix}layers.{i}."
        q = t.take(f"{layers}attn/q_einsum{s}/w")[i]  # [N, D, H]
        out[f"{layer}self_attn.q_proj.weight"] = q.transpose(0, 2, 1).reshape(-1, q.shape[1])
        kv = t.take(f"{layers}attn/kv_einsum{s}/w")[i]  # [2, K, D, H]
        for j, name in enumerate(("k_proj", "v_proj")):
            out[f"{layer}self_attn.{name}.weight"] = kv[j].transpose(0, 2, 1).reshape(-1, kv.shape[2])
        o = t.take(f"{layers}attn/attn_vec_einsum{s}/w")[i]  # [N, H, D]
        out[f"{layer}self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        gating = t.take(f"{layers}mlp{s}/gating_einsum")[i]  # [2, D, F]
        out[f"{layer}mlp.gate_proj.weight"] = gating[0].T
        out[f"{layer}mlp.up_proj.weight"] = gating[1].T
        out[f"{layer}mlp.down_proj.weight"] = t.take(f"{layers}mlp{s}/linear")[i].T  # [F, D]
        for norm, name in (("pre_attention_norm", "input_layernorm"), ("pre_ffw_norm", "post_attention_layernorm")):
            _norm(t, out, f"{layers}{norm}{s}/", f"{layer}{name}.", i)
    if s:  # the backbone's final norm is taken with the embedder
        _norm(t, out, f"PaliGemma/llm/final_norm{s}/", f"{prefix}norm.", None)


def _norm(t: _Tree, out: dict, src: str, dst: str, i: int | None) -> None:
    pick = (lambda a: a) if i is None else (lambda a: a[i])
    if t.has(f"{src}Dense_0/kernel"):  # pi0.5's adaptive RMSNorm
        out[f"{dst}dense.weight"] = pick(t.take(f"{src}Dense_0/kernel")).T
        out[f"{dst}dense.bias"] = pick(t.take(f"{src}Dense_0/bias"))
    else:
        out[f"{dst}weight"] = pick(t.take(f"{src}scale"))
