"""Normalization statistics: offset / scale buffers from a dataset's raw statistics, pooled across a mixture.

``normalized = (x - offset) / scale``; the policy keeps the buffers, so an exported policy normalizes by itself.
"""

from __future__ import annotations

import numpy as np
import torch


def offset_scale(stats: dict[str, np.ndarray], mode: str, dim: int, prefix: str, where: str,
                 knob: str | None = None) -> dict[str, torch.Tensor]:
    """``{prefix}_offset`` / ``{prefix}_scale`` for ``normalized = (x - offset) / scale`` from raw stats
    (mean / std / min / max / q01 / q99): mean_std, min_max and quantile (to [-1, 1] between q01 and
    q99, as LeRobot's and openpi's quantile normalization) or identity. ``knob``: the setting that
    chose ``mode``, named in the error (default ``data.{prefix}_normalization``)."""
    if mode == "identity":
        offset, scale = np.zeros(dim), np.ones(dim)
    else:
        need = {"mean_std": ("mean", "std"), "min_max": ("min", "max"), "quantile": ("q01", "q99")}[mode]
        if not all(n in stats for n in need):
            raise ValueError(f"{knob or f'data.{prefix}_normalization'}={mode!r} needs {list(need)} stats for {where}; "
                             f"stats there: {sorted(stats)}; choose mean_std, min_max or identity")
        a, b = (np.asarray(stats[n], dtype=np.float64).reshape(-1) for n in need)
        if len(a) < dim:
            raise ValueError(f"{prefix} statistics of {where} have {len(a)} dims, the data has {dim}")
        a, b = a[:dim], b[:dim]
        offset, scale = (a, b) if mode == "mean_std" else ((a + b) / 2, (b - a) / 2)
    return {f"{prefix}_offset": torch.as_tensor(offset, dtype=torch.float32),
            f"{prefix}_scale": torch.as_tensor(np.maximum(scale, 1e-4), dtype=torch.float32)}


def pool_stats(stats: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Pool stats of several datasets: count-weighted mean / variance, elementwise min / max, and
    the outermost q01 / q99 (a conservative range)."""
    if len(stats) == 1:
        return stats[0]
    out = {}
    counts = np.asarray([float(s["count"][0]) for s in stats])
    w = counts / counts.sum()
    if all("mean" in s and "std" in s for s in stats):
        mean = sum(wi * s["mean"] for wi, s in zip(w, stats))
        var = sum(wi * (s["std"] ** 2 + s["mean"] ** 2) for wi, s in zip(w, stats)) - mean**2
        out.update(mean=mean, std=np.sqrt(np.maximum(var, 0.0)))
    for name, fn in (("min", np.minimum), ("max", np.maximum), ("q01", np.minimum), ("q99", np.maximum)):
        if all(name in s for s in stats):
            out[name] = fn.reduce([s[name] for s in stats])
    return out
