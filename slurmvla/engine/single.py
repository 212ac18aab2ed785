"""The engine for one process: one GPU or the CPU. The other strategies share its interface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slurmvla.config import EngineConfig, OptimConfig
from slurmvla.engine.precision import MasterWeightOptimizer
from slurmvla.launch import DistEnv
from slurmvla.optim import build_adamw

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class SingleEngine:
    """Live parameters in the compute dtype, fp32 masters in the optimizer when that dtype is bf16.

    The trainer speaks only this interface: ``wrap``, ``build_optimizer``, ``autocast``,
    ``backward``, ``no_sync``, ``clip_grad_norm``, ``step``, ``state_dict`` / ``load_state_dict``,
    ``save`` / ``load``.
    """

    name = "single"
    # Whether a checkpoint written at one world size can be resumed at another.
    resumes_at_any_world_size = True

    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device):
        self.cfg, self.env, self.precision, self.device = cfg, env, precision, device
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.module: nn.Module | None = None  # the policy itself (for state dicts)
        self.optimizer: torch.optim.Optimizer | None = None
        self._fp32_init: dict[int, torch.Tensor] = {}

    @property
    def model(self) -> nn.Module:
        """What the trainer calls for forward (a DDP or DeepSpeed wrapper where there is one)."""
        return self.module

    # -- model and optimizer ----------------------------------------------------------------------

    def wrap(self, policy: nn.Module) -> nn.Module:
        policy.to(self.device)
        if self.compute_dtype != torch.float32:
            # Only trainable parameters go low precision: their fp32 masters live in the optimizer.
            # Frozen parameters and buffers (normalization statistics) stay fp32.
            # The fp32 values are kept until build_optimizer seeds the masters with them.
            for p in policy.parameters():
                if p.requires_grad:
                    self._fp32_init[id(p)] = p.data
                    p.data = p.data.to(self.compute_dtype)
        self.module = policy
        return policy

    def build_optimizer(self, param_groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
        assert self.module is not None, "wrap() the policy before building its optimizer"
        self.param_names = [n for g in param_groups for n in g["param_names"]]
        if self.compute_dtype == torch.float32:
            self.optimizer = build_adamw(param_groups, cfg, self.device)
        else:
            self.optimizer = MasterWeightOptimizer(param_groups, lambda groups: build_adamw(groups, cfg, self.device),
                                                   initial=self._fp32_init)
            self._fp32_init = {}
        return self.optimizer

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # -- one optimizer step -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps before the last one of an accumulation skip gradient sync (none here)."""
        yield

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.optimizer, MasterWeightOptimizer):
            return self.optimizer.clip_grad_norm(max_norm)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- state ------------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 policy state (masters where they exist), as CPU tensors."""
        state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                 for k, v in self.module.state_dict().items()}
        if isinstance(self.optimizer, MasterWeightOptimizer):
            for name, master in zip(self.param_names, self.optimizer.masters):
                state[name] = master.detach().to("cpu", copy=True)
        return state

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.module.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the policy: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(state[name])
        if isinstance(self.optimizer, MasterWeightOptimizer):
            self.optimizer.load_masters([state[n].to(self.device) for n in self.param_names])

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model_state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_model_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save(self, directory: Path) -> None:
        """Write the engine's files into ``directory`` (the checkpoint layer makes it atomic)."""
        if not self.env.is_main:
            return
        save_file(self.model_state_dict(), str(directory / MODEL_FILE))
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        self.load_model_state_dict(load_file(str(directory / MODEL_FILE)))
        # weights_only: a checkpoint is data; loading one never runs pickled code.
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device, weights_only=True))
