"""An exponential moving average of the fp32 master weights, on every engine (``trainer.ema_decay``).

The average is kept of exactly the tensors the optimizer steps (``engine.master_tensors()``): the
fp32 parameters under fp32, the fp32 masters under bf16, each rank's FSDP shard or ZeRO partition.
So it is held as the optimizer state is held (sharded where the engine shards it: one more fp32 copy
of this rank's part) and costs one fused ``lerp`` per step, no communication. After each step
``ema = ema + (1 - decay) * (weights - ema)``, i.e. openpi's ``decay * ema + (1 - decay) * weights``;
it starts from the weights training starts from.

Its full state (what :meth:`state_dict` returns, and what a checkpoint's ``ema.safetensors`` holds)
is the policy's state dict with the averaged values: the engine gathers it as it gathers the
weights, with the average swapped into the masters for the duration (frozen parameters and buffers
are the live ones: they never change). Loading goes the other way through the engine's
``load_model_state_dict``; a checkpoint's own weights are loaded after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from slurmvla.parameters import checkpoint_keys

if TYPE_CHECKING:
    from slurmvla.engine.base import StateIO

EMA_FILE = "ema.safetensors"


class MovingAverage:
    def __init__(self, engine: StateIO, decay: float):
        self.engine, self.decay = engine, decay
        self.shadow = self._copy_masters()

    def _copy_masters(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in self.engine.master_tensors()]

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step (every rank; no communication)."""
        torch._foreach_lerp_(self.shadow, list(self.engine.master_tensors()), 1.0 - self.decay)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average in the masters' place until the block ends (the masters are put back exactly)."""
        masters = list(self.engine.master_tensors())
        kept = [m.detach().clone() for m in masters]
        with torch.no_grad():
            torch._foreach_copy_(masters, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(masters, kept)

    @contextlib.contextmanager
    def applied_to(self, module: torch.nn.Module) -> Iterator[None]:
        """The average in ``module``'s own weights until the block ends, put back exactly after: what the
        trainer's periodic closed loop evaluates (a whole-model engine's policy; its compute dtype, as the
        trained weights are). One more copy of the module's weights for the duration."""
        state = self.state_dict()
        live = module.state_dict()
        if missing := sorted(set(state) - set(live)):
            raise RuntimeError(f"the moving average holds tensors the policy does not: {missing[:5]}")
        kept = {k: live[k].detach().clone() for k in state}
        module.load_state_dict(state, strict=False)
        try:
            yield
        finally:
            module.load_state_dict(kept, strict=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged policy as fp32 CPU tensors (a collective where the engine shards; on rank 0
        where the engine gathers there only)."""
        with self.swapped_in():
            state = self.engine.model_state_dict()
        # With low-rank adapters only trained tensors are averaged: the frozen base is left out, as the
        # checkpoint leaves it out of the weights (slurmvla.parameters.checkpoint_keys).
        keys = checkpoint_keys(self.engine.module)
        return state if keys is None or not state else {k: v for k, v in state.items() if k in keys}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the average from a full state. The engine's weights are overwritten on the way: load the
        checkpoint's own weights after this."""
        self.engine.load_model_state_dict(state)
        self.shadow = self._copy_masters()

    def reset(self) -> None:
        """Start the average from the current weights (a checkpoint written without one)."""
        self.shadow = self._copy_masters()
