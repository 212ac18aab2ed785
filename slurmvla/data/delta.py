"""Delta actions: chosen action dims as offsets from the current state (openpi's ``DeltaActions`` /
``AbsoluteActions``, src/openpi/transforms.py).

``data.delta_actions`` holds one flag per action dim from the first; where a flag is true the policy trains
on, and predicts, ``action - state`` (the state's dim at the same index), the other dims staying absolute.
Every action of a chunk is taken relative to the one state the chunk starts from: the sample's current
observation (the last of its history), the request's observation at inference. Two places apply it: the
policy's processor (:class:`slurmvla.data.processor.Processor`: a recorded chunk to deltas in training,
validation and evaluation, a request's ``prev_actions`` to deltas and the policy's chunk back to absolute
commands in the server and evaluation) and :func:`chunk_action_stats` (the action statistics, so the policy
normalizes the deltas it sees).

The functions take numpy arrays or torch tensors and return new ones; dims that are not flagged are copied
untouched (not shifted by zero).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

QUANTILES = (0.01, 0.99)


def delta_dims(flags: Sequence[bool] | None) -> list[int]:
    """The action dims that are deltas (the indices of the true flags)."""
    return [i for i, f in enumerate(flags or ()) if f]


def _shift(actions, state, flags, sign: int):
    dims = delta_dims(flags)
    out = actions.clone() if torch.is_tensor(actions) else np.array(actions, copy=True)
    if dims:
        index = torch.as_tensor(dims, device=actions.device) if torch.is_tensor(actions) else np.asarray(dims)
        # [..., S] -> [..., 1, len(dims)]: one state per chunk, broadcast over its actions.
        current = state[..., index].unsqueeze(-2) if torch.is_tensor(state) else np.expand_dims(state[..., index], -2)
        if sign < 0:
            out[..., index] -= current
        else:
            out[..., index] += current
    return out


def to_delta(actions, state, flags: Sequence[bool] | None):
    """``actions`` ``[..., H, A]`` with ``state`` ``[..., S]`` subtracted on the flagged dims."""
    return _shift(actions, state, flags, -1)


def to_absolute(actions, state, flags: Sequence[bool] | None):
    """The inverse of :func:`to_delta`: ``state`` added back on the flagged dims."""
    return _shift(actions, state, flags, +1)


def current_state(state):
    """The state a chunk is relative to: the last of an observation history ``[..., T, S]`` when a batch
    of histories (3 dims) is given, else ``state`` itself (``[S]`` or ``[B, S]``)."""
    return state[..., -1, :] if state.ndim == 3 else state


def chunk_actions(action: np.ndarray, state: np.ndarray, starts: np.ndarray, horizon: int,
                  flags: Sequence[bool] | None) -> np.ndarray:
    """``[n, A]``: every action of the chunks starting at ``starts`` (one episode's ``action`` / ``state``
    columns) that lies inside the episode (the steps the loss sees), deltas where flagged."""
    steps = starts[:, None] + np.arange(horizon)[None]
    inside = steps < len(action)
    chunks = to_delta(action[np.minimum(steps, len(action) - 1)], state[starts], flags)
    return chunks[inside]


def chunk_action_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """mean / std / min / max / q01 / q99 per dim of ``values`` ``[n, A]`` (float64; the population std, as
    LeRobot's and openpi's statistics) and ``count``, in the layout of a dataset's raw stats."""
    v = np.asarray(values, np.float64)
    if not len(v):
        raise ValueError("no actions to compute the delta actions' statistics from")
    q01, q99 = np.quantile(v, QUANTILES, axis=0)
    return {"mean": v.mean(0), "std": v.std(0), "min": v.min(0), "max": v.max(0), "q01": q01, "q99": q99,
            "count": np.asarray([float(len(v))])}
