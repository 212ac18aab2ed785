"""CUDA's autocast, reproduced at the Python API on CPU fake tensors: a CPU-only torch cannot run autograd on
fake CUDA tensors, so the planner's fake step runs on the CPU and casts as a GPU would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# aten/src/ATen/autocast_mode.cpp, the CUDA lists (torch 2.13): ops run in the lower precision ...
AUTOCAST_LOWER = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm",
    "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"})
# ... in fp32 ...
AUTOCAST_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "rms_norm", "norm",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "interpolate",
    "binary_cross_entropy"})
# ... in fp32 unless a dtype is given ...
AUTOCAST_FP32_OPT_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                                     "linalg_matrix_norm", "sum"})
# ... and in the widest floating dtype of their inputs.
AUTOCAST_PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                              "index_put", "scatter_add", "tensordot"})
# Python entry points whose aten op has another name.
_ALIASES = {"interpolate": "interpolate", "upsample": "interpolate", "vector_norm": "linalg_vector_norm",
            "matrix_norm": "linalg_matrix_norm", "multi_dot": "linalg_multi_dot", "vecdot": "linalg_vecdot"}


def _op_name(func: Callable) -> str | None:
    """The aten-level name a Python torch function dispatches to first; None for in-place variants
    (autocast leaves them alone)."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and name[1:] in ("matmul", "pow", "add", "mul", "sub", "truediv"):
            return None  # in place
        if name.startswith("r") and name[1:] in ("matmul", "pow"):
            name = name[1:]
    if name.endswith("_") and not name.startswith("_"):
        return None
    return _ALIASES.get(name, name)


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x, tree)


def _widest(tree: Any) -> torch.dtype | None:
    from torch.utils._pytree import tree_leaves

    dtypes = [x.dtype for x in tree_leaves(tree) if _eligible(x)]
    return max(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else None


class CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA's autocast policy at the Python API, for tensors on another device (fake CPU tensors here).

    Like ``torch.autocast("cuda")`` it acts before autograd records an op, so the casts' outputs are what
    backward saves; unlike it, no cache of cast fp32 leaf weights is kept (no engine here trains fp32
    leaves under bf16: single / DDP lower the trainable parameters, FSDP and DeepSpeed compute in bf16).
    ``gqa_expand``: attention with a mask over grouped key / value heads expands the heads first, as
    ``slurmvla.policy.attention.attention`` does on a GPU (no fused CUDA kernel takes both)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, gqa_expand: bool = True):
        super().__init__()
        self.dtype, self.gqa_expand = dtype, gqa_expand

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = dict(kwargs or {})
        name = _op_name(func)
        if name is None:
            return func(*args, **kwargs)
        if name == "scaled_dot_product_attention":
            args, kwargs = self._expand_heads(args, kwargs)
        if name in AUTOCAST_LOWER:
            args, kwargs = _cast((args, kwargs), self.dtype)
        elif name in AUTOCAST_FP32:
            args, kwargs = _cast((args, kwargs), torch.float32)
        elif name in AUTOCAST_FP32_OPT_DTYPE:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if _eligible(first) and kwargs.get("dtype") is None and first.dtype != torch.float32:
                kwargs["dtype"] = torch.float32
        elif name in AUTOCAST_PROMOTE:
            widest = _widest((args, kwargs))
            if widest is not None:
                args, kwargs = _cast((args, kwargs), widest)
        return func(*args, **kwargs)

    def _expand_heads(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not (self.gqa_expand and kwargs.get("enable_gqa")):
            return args, kwargs
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if mask is None or k.shape[-3] == q.shape[-3]:
            return args, kwargs
        groups = q.shape[-3] // k.shape[-3]
        k, v = (x.repeat_interleave(groups, dim=-3) for x in (k, v))
        rest = {n: a for n, a in kwargs.items() if n not in ("query", "key", "value", "enable_gqa")}
        return (q, k, v, *args[3:]), rest

