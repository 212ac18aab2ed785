"""The engine for one process: one GPU or the CPU (and, through DDP, the base of replicated training).

Live parameters are in the compute dtype; under bf16 the optimizer steps fp32 masters
(``precision.MasterWeights``). A checkpoint is the full fp32 state in ``model.safetensors`` plus
the optimizer's state: replicated, so it resumes at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slurmvla.config import OptimConfig
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.base import EngineCore, SnapshotThenWrite, StepSettings, read_param_groups
from slurmvla.engine.materialize import place
from slurmvla.engine.memory import States, Tensors
from slurmvla.engine.precision import MasterWeights
from slurmvla.launch import DistEnv
from slurmvla.optim import build_adamw

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"


class SingleEngine(EngineCore):
    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device, settings: StepSettings):
        super().__init__(cfg, env, precision, device, settings)
        self.weights = MasterWeights(self.compute_dtype)

    # -- model and optimizer ----------------------------------------------------------------------

    def prepare(self, policy: nn.Module, optim: OptimConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        place(policy, self.device)  # built on the meta device: initialised where it will live
        self.weights.lower(policy)
        self.module = policy
        model = self.wrap(policy)
        self.optimizer = self.weights.build_optimizer(read_param_groups(policy, optim),
                                                      lambda groups: build_adamw(groups, optim, self.device))
        return model, self.optimizer

    def wrap(self, policy: nn.Module) -> nn.Module:
        """The module the trainer calls (here the policy itself)."""
        return policy

    # -- one optimizer step -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield  # one process: nothing to synchronise

    def clip_grad_norm(self) -> torch.Tensor:
        return self.weights.clip_grad_norm(self.settings.max_grad_norm)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- state ------------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights.full_state(self.module)

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 tensors the optimizer steps (the masters under bf16)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the weights (and masters) from a full fp32 state."""
        self.weights.load_full_state(self.module, state)

    @property
    def checkpointing(self) -> SnapshotThenWrite:
        """Replicated: a host snapshot now, written later by rank 0's checkpoint thread."""
        return SnapshotThenWrite(self.snapshot)

    def snapshot(self) -> Callable[[Path], None]:
        """The state as it is now, copied to the host, and a writer for it that may run in a
        background thread while training goes on (replicated: rank 0 writes it once)."""
        if not self.env.is_main:
            return lambda directory: None
        model, optimizer = self.weights.checkpoint_state(self.module), host_copy(self.optimizer.state_dict())

        def write(directory: Path) -> None:
            save_file(model, str(directory / MODEL_FILE))
            torch.save(optimizer, directory / OPTIMIZER_FILE)

        return write

    def save(self, directory: Path) -> None:
        self.snapshot()(directory)

    def load(self, directory: Path) -> None:
        self.weights.load_full_state(self.module, load_file(str(directory / MODEL_FILE)))
        # weights_only: a checkpoint is data; loading one never runs pickled code.
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=self.device, weights_only=True))


def host_copy(value: Any) -> Any:
    """A deep copy with every tensor on the host, detached from anything training will change."""
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


def load_safetensors_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a single / DDP checkpoint folder."""
    return load_file(str(Path(directory) / MODEL_FILE))


def model_states(cfg: EngineConfig, precision: str, t: Tensors, world: int, gpus_per_node: int) -> States:
    """The whole model on every rank (the memory rule of ``single``, and of ``ddp`` before its buckets).
    Under bf16 the trainable parameters live in bf16 with fp32 masters in the optimizer, and at the step
    the master-weight optimizer copies the gradients to fp32; frozen parameters stay fp32, or bf16 with
    low-rank adapters (``precision.lower_frozen_base``). The gradients are made by each backward and freed by
    each step (``zero_grad(set_to_none=True)``): not resident through the forward."""
    low = precision == "bf16"
    lora = t.adapters > 0
    c = 2 if low else 4
    nt, nf = t.trainable, t.frozen
    frozen_bytes = 2 if (low and lora) else 4
    held = {"parameters": c * nt + frozen_bytes * nf, "gradients": c * nt, "fp32 master weights": 4 * nt if low else 0,
            "AdamW state": 8 * nt + 4 * t.trainable_tensors, "buffers": t.buffer_bytes}
    step = {"fp32 copy of the gradients (master-weight optimizer)": 4 * nt} if low else {}
    bf16, fp32 = torch.bfloat16, torch.float32
    return States(held, {}, step, {}, (bf16 if low else fp32, bf16 if (low and lora) else fp32),
                  gradients_resident=False)
