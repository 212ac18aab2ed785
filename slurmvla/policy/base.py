"""The Policy contract every engine, trainer and evaluator relies on.

- ``policy(batch)`` (through ``__call__``, so FSDP's hooks run) returns a dict with the scalar
  ``loss`` and, under ``components``, a per-sample ``(sum, count)`` pair per loss component, so
  validation can split a mixed batch by provenance (Σsum / Σcount per group). The training loss
  must be a mean whose denominator depends only on the batch shape, so that a global batch's loss
  is exactly the mean of its shards' losses, on any world size and accumulation split.
- ``wrap_units()`` names the modules a sharding engine wraps one by one (one per decoder layer).
- ``param_groups(weight_decay)`` splits trainable parameters into backbone / action expert, each
  into decay / no-decay (biases, norms and every 1-D parameter get no weight decay).
- ``sample_spec(cfg)`` (a classmethod: the data is built before the policy, whose normalization
  comes from the data's statistics) says what its samples must look like: image size, action
  horizon, observation history, tokenizer, and the training randomness the data pre-draws.
- ``check_data(cfg, features)`` (a classmethod, run before the policy is built) raises a
  ``ValueError`` naming the key and the data's value when the data does not fit the policy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slurmvla.config import PolicyConfig
from slurmvla.data.spec import DataFeatures, SampleSpec

LossComponents = dict[str, tuple[torch.Tensor, torch.Tensor]]


class Policy(nn.Module):
    """Base class: subclasses provide ``sample_spec``, ``check_data``, ``forward``, ``wrap_units`` and
    ``expert_modules``."""

    @classmethod
    def sample_spec(cls, cfg: PolicyConfig) -> SampleSpec:
        raise NotImplementedError

    @classmethod
    def check_data(cls, cfg: PolicyConfig, features: DataFeatures) -> None:
        raise NotImplementedError

    def wrap_units(self) -> list[nn.Module]:
        raise NotImplementedError

    def expert_modules(self) -> list[nn.Module]:
        """Modules that form the action expert; every other parameter belongs to the backbone."""
        raise NotImplementedError

    def param_groups(self, weight_decay: float, lr: float, backbone_lr_scale: float = 1.0) -> list[dict[str, Any]]:
        expert_ids = {id(p) for m in self.expert_modules() for p in m.parameters()}
        groups: dict[str, dict[str, Any]] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            part = "expert" if id(p) in expert_ids else "backbone"
            # Norm weights and biases are 1-D; learned position / camera embeddings are named *_embedding.
            no_decay = p.ndim <= 1 or name.endswith(("bias", "_embedding"))
            key = f"{part}_{'no_decay' if no_decay else 'decay'}"
            group = groups.setdefault(key, {
                "name": key,
                "params": [],
                "param_names": [],
                "weight_decay": 0.0 if no_decay else weight_decay,
                "lr": lr * (backbone_lr_scale if part == "backbone" else 1.0),
            })
            group["params"].append(p)
            group["param_names"].append(name)
        order = ["backbone_decay", "backbone_no_decay", "expert_decay", "expert_no_decay"]
        return [groups[k] for k in order if k in groups]
