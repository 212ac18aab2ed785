"""Weights both sides rebuild from a seed: LeRobot's generator (tests/reference/generate_pi0_golden.py, in
its own virtualenv) and slurmvla's suite. Only numpy: its PCG64 stream and ziggurat normals are the
same in both environments, so the same (name, shape) gives the same float32 tensor on either side.

Each tensor is drawn from its own generator, seeded by ``seed`` and the CRC-32 of its name, so the
values do not depend on which other tensors exist or in which order they are made. Scales keep a
tiny model's activations O(1) (a 0.02 init would make every output nearly constant):
matrices ~ N(0, 1 / fan_in), vectors ~ N(0, 0.1^2), LayerNorm weights 1 + N(0, 0.1^2).
"""

from __future__ import annotations

import zlib

import numpy as np


def tensor_for(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    x = rng.standard_normal(shape)
    if len(shape) >= 2:
        x = x / np.sqrt(float(np.prod(shape[1:])))
    else:
        x = 0.1 * x
        # SigLIP's LayerNorms multiply by their weight (Gemma's RMSNorms by 1 + weight).
        if name.endswith("weight") and "vision_tower" in name and ("layer_norm" in name or "layernorm" in name):
            x = x + 1.0
    return x.astype(np.float32)


def tiny_state_dict(shapes: dict[str, list[int]], ties: dict[str, str], seed: int) -> dict[str, np.ndarray]:
    """``shapes``: LeRobot's state-dict names -> shapes; ``ties``: name -> the name it shares storage
    with (e.g. PaliGemma's LM head and its token embeddings)."""
    out = {k: tensor_for(k, tuple(s), seed) for k, s in shapes.items() if k not in ties}
    for k, source in ties.items():
        out[k] = out[source]
    return out


def fingerprint(tensors: dict[str, np.ndarray]) -> float:
    """A float64 checksum over every tensor (in name order): both sides must agree on it."""
    return float(sum(np.abs(tensors[k].astype(np.float64)).sum() * (i + 1) for i, k in enumerate(sorted(tensors))))
