"""DeepSpeed ZeRO stages 1, 2 and 3 (the optional ``[deepspeed]`` extra, imported only here).

The policy is built at full shape (initialisers see real fan-in/out) and ZeRO partitions it in
``deepspeed.initialize``. Under bf16 DeepSpeed keeps fp32 master partitions and fp32 Adam state;
under fp32 it trains in fp32. The optimizer handed back to the trainer is the torch AdamW that
actually steps (DeepSpeed's wrapper is not a ``torch.optim.Optimizer``): the LR schedule mutates
its ``param_groups``. DeepSpeed clips inside ``step()``; ``clip_grad_norm`` returns a tensor that
the following ``step()`` fills with the global norm it measured. The stage comes from the
registry entry's options.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurmvla.config import EngineConfig, OptimConfig
from slurmvla.engine.base import EngineCore, StepSettings, read_param_groups
from slurmvla.launch import DistEnv
from slurmvla.optim import build_adamw

DS_DIR = "deepspeed"
DS_TAG = "state"


class DeepSpeedEngine(EngineCore):
    def __init__(self, cfg: EngineConfig, env: DistEnv, precision: str, device: torch.device, settings: StepSettings,
                 stage: int, zero_options: dict[str, Any] | None = None):
        super().__init__(cfg, env, precision, device, settings)
        self.stage = stage
        # Extra "zero_optimization" settings (the policy checker partitions every parameter).
        self.zero_options = dict(zero_options or {})
        self._accumulating = False
        self._grad_norm = torch.zeros((), device=device)

    def ds_config(self) -> dict[str, Any]:
        bf16 = self.compute_dtype == torch.bfloat16
        s = self.settings
        return {
            "train_micro_batch_size_per_gpu": s.micro_batch_size,
            "gradient_accumulation_steps": s.grad_accum_steps,
            "train_batch_size": s.micro_batch_size * s.grad_accum_steps * self.env.world_size,
            # DeepSpeed clips inside its step; <= 0 means no clipping there too.
            "gradient_clipping": max(s.max_grad_norm, 0.0),
            "zero_optimization": {"stage": self.stage, **self.zero_options},
            "bf16": {"enabled": bf16},
            # Gradients are reduced in fp32 unless asked otherwise (bf16 sums lose bits).
            "communication_data_type": "fp32" if self.cfg.reduce_dtype == "fp32" or not bf16 else "bf16",
            # torch's own AdamW: no FusedAdam compile on CPU, same update rule as every other engine.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }

    def prepare(self, policy: nn.Module, optim: OptimConfig) -> tuple[nn.Module, torch.optim.Optimizer]:
        import deepspeed

        # Full-shape and fp32 until deepspeed.initialize partitions (and, under bf16, casts) it.
        policy.to(self.device)
        self.module = policy
        base = build_adamw(read_param_groups(policy, optim), optim, self.device)
        self._ds, ds_optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=base, config=self.ds_config())
        # The torch optimizer that steps on the fp32 partitions: the LR schedule acts on it.
        self.optimizer = ds_optimizer.optimizer
        return self._ds, self.optimizer

    # -- one optimizer step -----------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        # The trainer already divided the loss by the accumulation steps.
        self._ds.backward(loss, scale_wrt_gas=False)
        if self._accumulating:
            self._ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def clip_grad_norm(self) -> torch.Tensor:
        # DeepSpeed clips to settings.max_grad_norm inside step(), which fills this tensor.
        return self._grad_norm

    def step(self) -> None:
        assert self._ds.is_gradient_accumulation_boundary(), "step() outside an accumulation boundary"
        self._ds.step()
        norm = self._ds.get_global_grad_norm()
        self._grad_norm.fill_(float(norm) if norm is not None else float("nan"))
        self._ds.zero_grad()

    # -- state ------------------------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 state (a collective under ZeRO-3: every rank must call it)."""
        from deepspeed.utils import safe_get_full_fp32_param

        state = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
                 for k, v in self.module.named_buffers()}
        for name, p in self.module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], enabled=self.stage == 3):
                    full = p.detach().float()
            state[name] = full.detach().to("cpu", torch.float32, copy=True)
        return state

    def master_tensors(self) -> list[torch.Tensor]:
        """This rank's flat fp32 partitions, which DeepSpeed's optimizer steps (its ``param_groups`` hold
        them only during a step under ZeRO-3)."""
        ds = self._ds.optimizer
        return list(ds.fp32_partitioned_groups_flat if self.stage == 3 else ds.single_partition_of_fp32_groups)

    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set the fp32 partitions of the trained parameters from a full fp32 state (every rank passes it)."""
        from deepspeed.utils import safe_set_full_fp32_param

        for name, p in self.module.named_parameters():
            if p.requires_grad:
                safe_set_full_fp32_param(p, state[name].to(self.device))

    def save(self, directory: Path) -> None:
        self._ds.save_checkpoint(str(directory / DS_DIR), tag=DS_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self._ds.load_checkpoint(str(directory / DS_DIR), tag=DS_TAG, load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"{directory / DS_DIR} holds no DeepSpeed checkpoint with tag {DS_TAG!r}")


def load_zero_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state of a ZeRO checkpoint, consolidated in one process."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(directory / DS_DIR), tag=DS_TAG)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
