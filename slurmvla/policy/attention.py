"""Attention as the built-in policies compute it: grouped-query attention through torch's fused kernels or
written out (``policy.attention_implementation``), and the folded form of pi0's cached denoising steps
(``policy.denoise_attention=matmul``).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from slurmvla.config.policy import ATTENTION_FALLBACKS

_warned: set[str] = set()


def resolve_attention(impl: str) -> str:
    if impl in ATTENTION_FALLBACKS:
        if impl not in _warned:
            _warned.add(impl)
            warnings.warn(
                f"policy.attention_implementation={impl!r} has no separate kernel path here; falling back to "
                "'sdpa', which dispatches to FlashAttention kernels on GPUs that support them",
                stacklevel=2,
            )
        return "sdpa"
    return impl


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv_heads, L, D]`` -> ``[B, kv_heads * groups, L, D]``, each head repeated ``groups`` times in place
    (head ``h`` of the result is head ``h // groups`` of ``x``, as grouped-query attention pairs them)."""
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str,
              expand_heads: bool = False) -> torch.Tensor:
    """``q``: ``[B, heads, L, head_dim]``; ``k, v``: ``[B, kv_heads, L', head_dim]`` (grouped-query
    attention where ``kv_heads`` divides ``heads``: each key / value head serves ``heads / kv_heads``
    query heads, and is not copied for them, except with a mask on a GPU, or ``expand_heads``: see below);
    ``mask``: bool, True where a query may attend."""
    groups = q.shape[1] // k.shape[1]
    if impl == "sdpa":
        if groups > 1 and mask is not None and (q.is_cuda or expand_heads):
            # On a GPU no fused kernel takes both a mask and grouped key / value heads (FlashAttention takes
            # no mask, the memory-efficient kernel no grouped heads): torch would fall back to its unfused
            # math path. With the heads expanded to the queries' (one copy of k and v) the memory-efficient
            # kernel runs.
            return F.scaled_dot_product_attention(q, repeat_heads(k, groups), repeat_heads(v, groups), attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    if groups > 1:
        k, v = repeat_heads(k, groups), repeat_heads(v, groups)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def grouped_matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`attention` as two matrix products around a float32 softmax (scores in the inputs' dtype, as
    transformers' eager attention and openpi's PyTorch model compute them), with the query heads that share a
    key / value head folded into its rows: ``[B, kv_heads, groups * L, head_dim]`` against the keys once, no
    head copied. For few queries over many keys (pi0's denoising steps at batch 1: 50 queries, ~900 keys,
    8 heads on one key / value head) a fused kernel has a handful of query tiles to spread over the GPU;
    here the 400 folded rows are one product that the GEMM library tiles over the keys as well. ``mask``:
    bool ``[B, 1, L, L']``, True where a query may attend (every query must see at least one key)."""
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    scores = (q.reshape(b, kv_heads, groups * n, d) @ k.transpose(-1, -2)) * (d ** -0.5)
    scores = scores.view(b, kv_heads, groups, n, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b, kv_heads, groups * n, -1)
    return (probs @ v).view(b, heads, n, d)
