"""fp32 master weights for engines whose live parameters are low precision (single, DDP).

``MasterWeights`` is the piece those engines compose: it lowers the trainable parameters to the
compute dtype (remembering their exact fp32 values), builds the optimizer that steps, clips, and
reads and writes the full fp32 state.

A model cast to bf16 before ``torch.optim.AdamW`` is built gets bf16 ``exp_avg`` / ``exp_avg_sq``
and silently stops learning once updates fall below bf16's resolution. ``MasterWeightOptimizer``
keeps fp32 copies of the live parameters, builds the real optimizer on those copies (so its state
is fp32), clips on fp32 gradients and writes the result back into the live parameters.

It is a true ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are the inner optimizer's
own objects, so an LR scheduler built on this wrapper changes the lr the inner optimizer uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slurmvla.parameters import checkpoint_keys, has_adapters


class MasterWeightOptimizer(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict[str, Any]], make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 initial: dict[int, torch.Tensor] | None = None):
        """``initial`` maps ``id(live param)`` to its fp32 value from before the cast, so training
        starts from the exact fp32 initialisation rather than from its bf16 rounding."""
        self.live: list[torch.nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        master_groups = []
        initial = initial or {}
        for group in param_groups:
            masters = []
            for p in group["params"]:
                source = initial.get(id(p), p.detach())
                m = source.to(p.device, torch.float32, copy=True).requires_grad_(True)
                self.live.append(p)
                self.masters.append(m)
                masters.append(m)
            master_groups.append({**group, "params": masters})
        self.inner = make_optimizer(master_groups)
        super().__init__(self.masters, dict(self.inner.defaults))
        self._share_inner()
        self._grads_ready = False

    def _share_inner(self) -> None:
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def _master_grads(self) -> None:
        if self._grads_ready:
            return
        for live, master in zip(self.live, self.masters):
            if live.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = live.grad.to(torch.float32)
            else:
                master.grad.copy_(live.grad)
        self._grads_ready = True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip on the fp32 master gradients; ``max_norm <= 0`` only measures the norm."""
        self._master_grads()
        return torch.nn.utils.clip_grad_norm_(self.masters, max_norm if max_norm > 0 else float("inf"))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        self._master_grads()
        loss = self.inner.step(closure)
        for live, master in zip(self.live, self.masters):
            live.copy_(master)
        self._grads_ready = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.live:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
        self.inner.zero_grad(set_to_none=set_to_none)
        self._grads_ready = False

    @torch.no_grad()
    def load_masters(self, values: list[torch.Tensor]) -> None:
        """Set masters (and live weights) from fp32 values: resume without bf16 rounding."""
        for live, master, value in zip(self.live, self.masters, values, strict=True):
            master.copy_(value)
            live.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        # torch replaces param_groups / state with new objects on load: share them again so a
        # scheduler holding this wrapper keeps steering the lr the inner optimizer uses.
        self._share_inner()


class MasterWeights:
    """Live parameters in ``compute_dtype``; under bf16 the optimizer steps fp32 masters of them.

    Only trainable parameters go low precision (their masters live in the optimizer); frozen
    parameters and buffers (normalization statistics) stay fp32."""

    def __init__(self, compute_dtype: torch.dtype):
        self.compute_dtype = compute_dtype
        self.optimizer: torch.optim.Optimizer | None = None
        self.param_names: list[str] = []
        self._fp32_init: dict[int, torch.Tensor] = {}

    def lower(self, policy: nn.Module) -> None:
        if self.compute_dtype == torch.float32:
            return
        lower_frozen_base(policy, self.compute_dtype)
        for p in policy.parameters():
            if p.requires_grad:
                # Kept until the optimizer is built, to seed the masters with the exact fp32 values.
                self._fp32_init[id(p)] = p.data
                p.data = p.data.to(self.compute_dtype)

    def build_optimizer(self, param_groups: list[dict[str, Any]],
                        make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        self.param_names = [n for g in param_groups for n in g["param_names"]]
        if self.compute_dtype == torch.float32:
            self.optimizer = make(param_groups)
        else:
            self.optimizer = MasterWeightOptimizer(param_groups, make, initial=self._fp32_init)
            self._fp32_init = {}
        return self.optimizer

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.optimizer, MasterWeightOptimizer):
            return self.optimizer.clip_grad_norm(max_norm)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))

    def checkpoint_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: the full state, or with low-rank adapters the trained parameters and
        buffers (:func:`slurmvla.parameters.checkpoint_keys`)."""
        state, keys = self.full_state(module), checkpoint_keys(module)
        return state if keys is None else {k: v for k, v in state.items() if k in keys}

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full fp32 state (masters where they exist), as CPU tensors."""
        state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                 for k, v in module.state_dict().items()}
        if isinstance(self.optimizer, MasterWeightOptimizer):
            for name, master in zip(self.param_names, self.optimizer.masters):
                state[name] = master.detach().to("cpu", copy=True)
        return state

    def load_full_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Set live weights (and masters, without bf16 rounding) from a full fp32 state."""
        own = module.state_dict()
        # With adapters a checkpoint holds the trained parameters and buffers only (the base is rebuilt).
        keys = checkpoint_keys(module)
        if keys is not None and set(state) == keys:
            own = {k: v for k, v in own.items() if k in keys}
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the policy: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state[name])
        if isinstance(self.optimizer, MasterWeightOptimizer):
            # copy_ into each master moves the value to the master's device.
            self.optimizer.load_masters([state[n] for n in self.param_names])


def check_fp32_master_state(optimizer: torch.optim.Optimizer) -> None:
    """Raise if the optimizer that steps holds anything but fp32 parameters and fp32 state.

    The trainer calls this once, after the first step (when Adam's state exists): a model cast to
    bf16 before its optimizer was built is caught at step 1 instead of after days of flat loss.
    """
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name", f"group {i}")
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise RuntimeError(
                    f"the optimizer steps a {p.dtype} parameter in param group {name!r}: master weights must be fp32 "
                    "(precision=bf16 keeps fp32 masters; do not cast the model before building the optimizer)"
                )
    # All state, not only that of the params listed now: ZeRO-3 swaps its partitions in and out.
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step" and value.dtype != torch.float32:
                raise RuntimeError(
                    f"optimizer state {key!r} is {value.dtype}, not fp32: Adam moments in bf16 silently stop learning"
                )


def lower_frozen_base(policy: nn.Module, dtype: torch.dtype) -> None:
    """With low-rank adapters, the frozen base is held in the compute dtype (it is only ever read in it:
    half the memory, no per-step cast); without adapters frozen parameters stay fp32."""
    if dtype == torch.float32 or not has_adapters(policy):
        return
    for p in policy.parameters():
        if not p.requires_grad:
            p.data = p.data.to(dtype)
