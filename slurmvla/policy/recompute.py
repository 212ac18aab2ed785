"""Activation checkpointing of a policy's repeated layers: which layers, and what each one keeps.

With ``policy.gradient_checkpointing=true`` a checkpointed layer stores only its inputs in the forward
pass and runs again in the backward pass. Two switches trade that recomputation against memory:

- ``policy.checkpoint_every=k``: layers ``0, k, 2k, ...`` of each stack are checkpointed, the others keep
  every activation (``1``: every layer, the least memory; ``2``: half the recomputation);
- ``policy.checkpoint_saves``: what a checkpointed layer keeps besides its inputs. ``inputs`` keeps
  nothing more (the whole layer runs again). ``matmuls`` also keeps the outputs of its matrix products
  and attention (torch's selective checkpointing): the backward pass recomputes only the cheap
  elementwise work (norms, activations, rotary embeddings, residual adds), which is a small share of
  the FLOPs but much of the memory.

Gradients are the same in every setting (recomputation repeats the forward exactly); only time and
memory move. ``python -m slurmvla.plan`` prints each setting's memory before a run, and
``python -m slurmvla.profile --compare`` its time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _kept_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


_KEPT = _kept_ops()


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


class Recompute:
    """Calls layer ``index`` of a stack, checkpointed or not as the policy's config says. ``context``: a
    callable giving a fresh context manager that the layer's forward runs under (e.g. the policy's choice
    of attention kernels), which its recomputation in the backward pass then runs under too."""

    def __init__(self, every: int = 1, saves: str = "inputs", context: Callable[[], Any] | None = None):
        # every >= 1, saves one of slurmvla.config.policy.CHECKPOINT_SAVES: PolicyConfig checks them at composition
        self.every, self.saves, self.context = every, saves, context

    @classmethod
    def from_config(cls, cfg, context: Callable[[], Any] | None = None) -> Recompute:
        return cls(cfg.checkpoint_every, cfg.checkpoint_saves, context)

    def _contexts(self) -> tuple:
        """(the forward's context, the recomputation's), as torch.utils.checkpoint's ``context_fn`` gives them."""
        if self.saves == "matmuls":
            forward, again = create_selective_checkpoint_contexts(_keep_matmuls)
        else:
            forward, again = contextlib.nullcontext(), contextlib.nullcontext()
        if self.context is None:
            return forward, again
        return _both(forward, self.context()), _both(again, self.context())

    def __call__(self, layer: Callable, index: int, *args):
        if index % self.every:
            return layer(*args)
        return checkpoint(layer, *args, use_reentrant=False, context_fn=self._contexts)
