"""The Policy contract every engine, trainer, validator and checker relies on (docs/policies.md).

A policy is a ``torch.nn.Module`` built as ``Class(policy_cfg, stats, **policy.kwargs)``:

- ``policy(batch)`` (through ``__call__``, so FSDP's hooks run) returns a dict with the scalar
  ``loss`` and, under ``components``, a per-sample ``(sum, count)`` pair per loss component, so
  validation can split a mixed batch by provenance (Σsum / Σcount per group). The training loss
  must be a mean whose denominator depends only on the batch shape, so that a global batch's loss
  is exactly the mean of its shards' losses, on any world size and accumulation split.
- ``sample_actions(batch)`` returns the action chunk ``[B, action_horizon, action_dim]`` in the
  dataset's units (inference: the server and the evaluator call only this, through
  :func:`seeded_sample_actions`). A policy whose ``sample_actions`` also takes ``noise=`` (shaped as its
  spec's ``noise`` draw) gets it drawn on the CPU from the seed: the same chunk on every device.
- Real-time chunking (optional): a flow policy that sets ``supports_rtc = True`` takes
  ``sample_actions(batch, noise=None, rtc=None)``, ``rtc`` a :class:`slurmvla.policy.rtc.Guidance` (the
  previous chunk in the dataset's units, the delay, the overlap); it then calls ``Guide.velocity`` in place
  of its velocity on each flow step and ``Guide.freeze`` on the chunk (or runs
  :func:`slurmvla.policy.rtc.integrate` over a ``velocity(x_t, t)`` of its own). Without ``rtc`` its output
  must be unchanged. The server offers the ``rtc`` execution mode only for such a policy (:func:`supports_rtc`).
- Training-time real-time chunking (optional, ``policy.rtc_training``): a flow policy that sets
  ``supports_rtc_training = True`` adds :func:`slurmvla.policy.rtc.delay_draws` to its sample spec's draws,
  trains through :func:`slurmvla.policy.rtc.delayed_chunk` (its velocity then takes a time per action,
  ``t`` ``[B, H]``) and answers ``rtc`` through :func:`slurmvla.policy.rtc.conditioning` (a clean prefix, no
  guidance). A class without it refuses ``policy.rtc_training`` when built.
- ``stats`` holds ``state_offset`` / ``state_scale`` / ``action_offset`` / ``action_scale``
  (``normalized = (x - offset) / scale``, from the data's statistics); keep them as buffers so they
  travel with the weights.
- ``wrap_units()`` names the modules a sharding engine wraps one by one (one per layer).
- ``lora_parts()`` names the modules of the backbone, the action expert and the vision tower, where
  ``policy.lora`` puts its adapters (slurmvla/policy/lora.py).
- ``param_groups(weight_decay, lr, backbone_lr_scale)`` splits trainable parameters into backbone /
  action expert (``expert_modules()``), each into decay / no-decay.
- ``sample_spec(cfg)`` (a classmethod: the data is built before the policy, whose normalization
  comes from the data's statistics) says what its samples must look like: image size, action
  horizon, observation history, tokenizer, and the training randomness the data pre-draws.
- ``check_data(cfg, features)`` (a classmethod, run before the policy is built) raises a
  ``ValueError`` naming the key and the data's value when the data does not fit the policy.

``Policy`` holds slurmvla's defaults for everything but ``forward`` and ``sample_actions``. A class
that does not derive from it gets the defaults for what it lacks (:func:`as_policy_class`), so the
built-in policies and a user's are the same kind of thing.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
from torch import nn

from slurmvla.config import PolicyConfig
from slurmvla.data.spec import DataFeatures, SampleSpec
from slurmvla.policy.tokenizer import ByteTokenizer

LossComponents = dict[str, tuple[torch.Tensor, torch.Tensor]]
# The instruction's tokens: in a sample exactly when the policy's sample spec has a tokenizer.
TEXT_FIELDS = ("text", "text_mask")


class Policy(nn.Module):
    """The contract's defaults; subclasses provide ``forward`` and ``sample_actions``."""

    # Whether sample_actions takes rtc= (real-time chunking's guidance; see the module docstring).
    supports_rtc = False
    # Whether it trains with policy.rtc_training (a clean, delayed prefix; see the module docstring).
    supports_rtc_training = False

    @classmethod
    def sample_spec(cls, cfg: PolicyConfig) -> SampleSpec:
        """Default: images at ``policy.image_size``, ``policy.action_horizon`` actions, the byte
        tokenizer at ``policy.max_text_len``, no pre-drawn randomness."""
        return SampleSpec(image_size=cfg.image_size, action_horizon=cfg.action_horizon,
                          num_obs_history=cfg.num_obs_history, tokenizer=ByteTokenizer(cfg.max_text_len))

    @classmethod
    def check_data(cls, cfg: PolicyConfig, features: DataFeatures) -> None:
        """Shapes the policy is built for must be the data's, or training silently learns garbage."""
        checks = [
            ("policy.num_cameras", cfg.num_cameras, "len(data.cameras)", len(features.cameras)),
            ("policy.state_dim", cfg.state_dim, f"the dim of {list(features.state_keys)}", features.state_dim),
            ("policy.action_dim", cfg.action_dim, f"the dim of {list(features.action_keys)}", features.action_dim),
        ]
        for key, value, what, expected in checks:
            if value != expected:
                raise ValueError(f"{key}={value} does not match {what}={expected} in {features.root}")

    # -- helpers for built-in policies (not part of the contract) ---------------------------------

    def register_normalization(self, cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None) -> None:
        """``state_offset`` / ``state_scale`` / ``action_offset`` / ``action_scale`` as fp32 buffers
        (identity without stats): they travel with the weights into checkpoints and exports, stay
        fp32 whatever the compute dtype, and stay plain tensors under FSDP (never sharded)."""
        for prefix, dim in (("state", cfg.state_dim), ("action", cfg.action_dim)):
            offset = torch.zeros(dim) if stats is None else stats[f"{prefix}_offset"].float().reshape(dim)
            scale = torch.ones(dim) if stats is None else stats[f"{prefix}_scale"].float().reshape(dim)
            self.register_buffer(f"{prefix}_offset", offset.clone())
            self.register_buffer(f"{prefix}_scale", scale.clamp_min(1e-4).clone())

    def text_inputs(self, batch: dict, reads: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(text, text_mask)`` from ``batch`` when the policy was built to read them (``reads``: decided
        at build time, with the sample spec's tokenizer, so the data layer yields them on every rank),
        else None. A batch that lacks a field the policy reads, or carries one it was built not to
        read, is a ``ValueError`` naming the field, here on this rank: the model never asks other ranks.
        That every rank's batch has the same fields is checked once, before the first forward, by the
        caller (the trainer, with :func:`slurmvla.collectives.check_same_fields`)."""
        name = getattr(getattr(self, "cfg", None), "name", type(self).__qualname__)
        for field in TEXT_FIELDS:
            if reads and field not in batch:
                raise ValueError(f"policy={name} was built to read {field!r} (its sample spec has a tokenizer, so its "
                                 f"samples carry the instruction's tokens), but this batch has no {field!r}; its "
                                 f"fields: {sorted(batch)}")
            if not reads and field in batch:
                raise ValueError(f"policy={name} was built not to read {field!r} (its sample spec has no tokenizer), "
                                 f"but this batch has {field!r}: the batch was not made to this policy's sample spec")
        return (batch["text"], batch["text_mask"]) if reads else None

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        return (actions.float() - self.action_offset) / self.action_scale

    def normalize_states(self, states: torch.Tensor) -> torch.Tensor:
        return (states.float() - self.state_offset) / self.state_scale

    def freeze(self, vision: nn.Module, cfg: PolicyConfig) -> None:
        """``policy.freeze_vision_encoder``: no gradient for ``vision``; ``policy.train_expert_only``:
        none for anything outside ``expert_modules()``."""
        if cfg.freeze_vision_encoder or cfg.train_expert_only:
            vision.requires_grad_(False)
        if cfg.train_expert_only:
            expert = {id(p) for m in self.expert_modules() for p in m.parameters()}
            for p in self.parameters():
                if id(p) not in expert:
                    p.requires_grad_(False)

    def sample_actions(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__qualname__} has no sample_actions(batch): inference needs it")

    def wrap_units(self) -> list[nn.Module]:
        """Default: none (single and DDP need none; sharding engines refuse a policy without units)."""
        return []

    def expert_modules(self) -> list[nn.Module]:
        """Modules that form the action expert; every other parameter belongs to the backbone.
        Default: none (one backbone group, decay / no decay)."""
        return []

    def lora_parts(self) -> dict[str, list[nn.Module]]:
        """The modules of each part ``policy.lora.parts`` can name (``backbone``, ``expert``, ``vision``);
        a module in a more specific part (vision, then expert) wins over a backbone module that contains it,
        and parameters in no part are trained or frozen by ``policy.lora.train_other``. Default: the
        action expert (``expert_modules()``) and everything else as backbone."""
        return {"expert": list(self.expert_modules()), "backbone": [self]}

    def no_weight_decay(self, name: str, p: torch.Tensor) -> bool:
        """Whether parameter ``name`` is exempt from weight decay. Default: 1-D tensors (norm weights,
        biases) and learned position / camera embeddings (named ``*_embedding``)."""
        return p.ndim <= 1 or name.endswith(("bias", "_embedding"))

    def param_groups(self, weight_decay: float, lr: float, backbone_lr_scale: float = 1.0) -> list[dict[str, Any]]:
        expert_ids = {id(p) for m in self.expert_modules() for p in m.parameters()}
        groups: dict[str, dict[str, Any]] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            part = "expert" if id(p) in expert_ids else "backbone"
            no_decay = self.no_weight_decay(name, p)
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


def as_policy_class(cls: Any, where: str = "policy.target") -> type[Policy]:
    """A policy class with the contract's defaults for whatever it does not define itself.

    A ``Policy`` subclass is returned as it is; any other ``nn.Module`` class gets a subclass of
    ``(cls, Policy)``: its own methods win, the defaults fill the gaps, and its parameter names (so
    its checkpoints) are unchanged."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{where}: {cls!r} is not a torch.nn.Module class")
    if issubclass(cls, Policy):
        return cls
    return type(cls.__name__, (cls, Policy), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                              "__doc__": cls.__doc__})


def import_class(path: str, where: str = "policy.target") -> Any:
    """``package.module.Class`` (or ``package.module:Class``) -> the class, or a ValueError that says
    what is missing."""
    module_name, sep, attribute = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{where}={path!r} is not an import path; write it as package.module.Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}={path!r}: cannot import {module_name!r} ({e}); is the package that defines it "
                         "installed in this environment (pip install -e <your package>)?") from None
    if not hasattr(module, attribute):
        classes = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)
                         and v.__module__ == module.__name__)
        raise ValueError(f"{where}={path!r}: module {module_name!r} has no {attribute!r}; its nn.Module classes: "
                         f"{classes}")
    return getattr(module, attribute)


def construct(cls: type[Policy], cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None) -> Policy:
    """``cls(cfg, stats, **cfg.kwargs)``, with a clear error when the arguments do not fit."""
    rtc_training = getattr(cfg, "rtc_training", None)
    if rtc_training is not None and rtc_training.enabled and not getattr(cls, "supports_rtc_training", False):
        raise ValueError(f"policy.rtc_training.max_delay={rtc_training.max_delay}: {cls.__module__}.{cls.__qualname__} "
                         "does not support training-time real-time chunking (supports_rtc_training = True, "
                         "docs/extending.md); set policy.rtc_training.max_delay=0")
    kwargs = dict(cfg.kwargs)
    try:
        inspect.signature(cls).bind(cfg, stats, **kwargs)
    except TypeError as e:
        raise ValueError(f"policy.kwargs={kwargs} do not fit {cls.__module__}.{cls.__qualname__}"
                         f"{inspect.signature(cls)} ({e}); a policy is built as Class(policy_cfg, stats, "
                         "**policy.kwargs)") from None
    return cls(cfg, stats, **kwargs)


def supports_rtc(policy: Any) -> bool:
    """Whether ``policy`` declares real-time chunking (``supports_rtc = True``) and its ``sample_actions``
    takes ``rtc=``."""
    sample = getattr(policy, "sample_actions", None)
    return getattr(policy, "supports_rtc", False) is True and callable(sample) \
        and "rtc" in inspect.signature(sample).parameters


def seeded_sample_actions(policy: nn.Module, spec: SampleSpec, batch: dict, seed: int, rtc: Any = None) -> torch.Tensor:
    """``policy.sample_actions(batch)`` with its randomness fixed by ``seed``, the same on every device.

    The starting noise is drawn on the CPU from a generator of its own and moved to the batch's device
    (a GPU's generator draws other numbers from the same seed: the chunk would depend on the device)
    when the policy takes ``noise=``; otherwise the devices' generators are seeded for the call. ``rtc``
    (a :class:`slurmvla.policy.rtc.Guidance`) is passed on only when given: the same noise, guided."""
    extra = {} if rtc is None else {"rtc": rtc}
    draw = next((d for d in spec.draws if d.name == "noise"), None)
    state = batch["state"]
    if draw is not None and "noise" in inspect.signature(policy.sample_actions).parameters:
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn((state.shape[0], *draw.shape), generator=generator).to(state.device)
        return policy.sample_actions(batch, noise=noise, **extra)
    devices = [state.device] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return policy.sample_actions(batch, **extra)
