"""Low-rank adapters (LoRA, through peft) on any policy: ``policy.lora.enabled=true``.

:func:`apply_lora` is the one place adapters are added; :func:`slurmvla.policy.build_policy` calls it
after the policy is built (and its pretrained weights are in), so the trainer, every engine, the
checker, export, serve and evaluate all see the same adapted policy. What it does:

- Which weights get adapters: the policy's ``lora_parts()`` (backbone, expert, vision: lists of
  modules; the contract's default, ``Policy.lora_parts``, is the action expert's modules and the rest as backbone) and the
  ``nn.Linear`` modules in the parts ``policy.lora.parts`` names (all of them, or those whose last name
  is in ``policy.lora.targets``). peft's ``inject_adapter_in_model`` wraps each (its weight becomes
  ``<module>.base_layer.weight``, the factors ``<module>.lora_A.default.weight`` / ``lora_B``); the
  expert's get ``expert_rank`` / ``expert_alpha`` (peft's ``rank_pattern``).
- What trains: the adapters; every other weight of the adapted parts is frozen; parameters outside
  them keep what the policy's config said (``train_other``; false freezes them too).
- Initialisation: each factor from a generator of its own (the policy's ``init_seed`` and the factor's
  name), like every other parameter (:mod:`slurmvla.parameters`), so the adapters are the same on every
  rank, engine and world size, built whole or on the meta device and materialised shard by shard. The
  base weights keep the values of the same policy without adapters (their plain names seed them and
  pretrained files load into them: :func:`slurmvla.parameters.base_parameters`).

:func:`merge_adapters` folds the adapters into the base weights and removes them: the policy without
adapters that computes the same function (what ``python -m slurmvla.export`` writes by default).
A checkpoint of an adapted policy holds the trained parameters and the buffers only
(:func:`slurmvla.parameters.checkpoint_keys`); the base is rebuilt from the run's config.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurmvla.config.policy import LORA_PARTS, PolicyConfig
from slurmvla.parameters import has_adapters, is_adapter, parameter_generator, plain_name

ADAPTER = "default"  # peft's adapter name: one set of adapters per policy
GAUSSIAN_STD = 0.01  # openpi's LoRAConfig.init_fn: nn.initializers.normal(stddev=0.01)


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError("policy.lora.enabled=true needs peft: pip install -e '.[lora]' (or set "
                         "policy.lora.enabled=false)") from None
    return peft


def part_of_modules(policy: nn.Module) -> dict[str, str]:
    """Module name -> the part it belongs to. A module listed in a more specific part wins over one
    that contains it (vision, then expert, then backbone); modules in no part are ``other``."""
    parts = policy.lora_parts()  # the contract's (slurmvla.policy.base.Policy: every built policy has one)
    unknown = sorted(set(parts) - set(LORA_PARTS))
    if unknown:
        raise ValueError(f"{type(policy).__qualname__}.lora_parts() names parts {unknown}; the parts are backbone, "
                         "expert and vision")
    owner: dict[int, str] = {}
    for part in LORA_PARTS:  # later (more specific) parts overwrite earlier ones
        for root in parts.get(part, []):
            for m in root.modules():
                owner[id(m)] = part
    return {name: owner.get(id(m), "other") for name, m in policy.named_modules()}


def adapted_modules(policy: nn.Module, cfg: PolicyConfig, parts: dict[str, str]) -> dict[str, str]:
    """The ``nn.Linear`` modules that get adapters: full name -> part (``parts``: :func:`part_of_modules`)."""
    lora = cfg.lora
    chosen = {name: parts[name] for name, m in policy.named_modules()
              if isinstance(m, nn.Linear) and parts[name] in lora.parts
              and (lora.targets is None or name.rsplit(".", 1)[-1] in lora.targets)}
    if not chosen:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in policy.named_modules()
                          if isinstance(m, nn.Linear) and parts[n] in lora.parts})
        raise ValueError(f"policy.lora.targets={lora.targets} matches no nn.Linear in the parts "
                         f"policy.lora.parts={list(lora.parts)} of policy={cfg.name}; the nn.Linear names there: "
                         f"{linears}")
    return chosen


def apply_lora(policy: nn.Module, cfg: PolicyConfig) -> nn.Module:
    """Add the configured adapters to ``policy`` in place (see the module docstring); returns it."""
    peft = _peft()
    lora = cfg.lora
    parts = part_of_modules(policy)
    chosen = adapted_modules(policy, cfg, parts)
    was_trainable = {n: p.requires_grad for n, p in policy.named_parameters()}
    expert = [name for name, part in chosen.items() if part == "expert"]
    config = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=sorted(chosen),
        rank_pattern={re.escape(n): lora.expert_rank for n in expert},
        alpha_pattern={re.escape(n): lora.expert_alpha for n in expert},
        bias="none", init_lora_weights=True)
    peft.inject_adapter_in_model(config, policy, adapter_name=ADAPTER)
    for name, p in policy.named_parameters():
        if is_adapter(name):
            p.requires_grad_(True)
            continue
        plain = plain_name(name)
        owner = plain.rpartition(".")[0]  # "" for a parameter of the policy itself
        if parts[owner] in lora.parts:
            p.requires_grad_(False)
        else:
            p.requires_grad_(was_trainable[plain] and lora.train_other)
    # The policy's own seed for per-parameter generators; a policy without one (a plug-in initialising
    # itself from torch's global generator) gets one draw from it, after its own weights: the same on
    # every rank, which the trainer seeds alike.
    seed = policy.init_seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), device="cpu").item())
    # On the meta device the engine materialises the parameters through the policy's init_parameter,
    # which learns the adapters' names here.
    _route_initialisation(policy, lora.init, seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if is_adapter(name) and not p.is_meta:
                init_adapter(name, p, lora.init, parameter_generator(seed, name))
    return policy


def init_adapter(name: str, p: torch.Tensor, init: str, generator: torch.Generator) -> None:
    """One adapter factor: openpi's N(0, 0.01) for both, or peft's default (Kaiming-uniform A with
    a = sqrt(5), as nn.Linear, and zero B)."""
    with torch.no_grad():
        if init == "gaussian":
            p.normal_(0.0, GAUSSIAN_STD, generator=generator)
        elif ".lora_B." in name or ".lora_embedding_B." in name:
            p.zero_()
        else:
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [out, in]
            p.uniform_(-bound, bound, generator=generator)


def _route_initialisation(policy: nn.Module, init: str, seed: int) -> None:
    """Per-parameter initialisation (``init_parameter``, what materialising a meta-built policy calls)
    that knows the adapted names: a base weight is initialised as the same policy without adapters
    initialises it (its plain name, its generator), an adapter factor by :func:`init_adapter`."""
    original = policy.init_parameter
    if original is None or getattr(original, "_lora_aware", False):
        return

    def init_parameter(name: str, p: torch.Tensor, generator: torch.Generator | None = None) -> None:
        if is_adapter(name):
            init_adapter(name, p, init, generator if generator is not None else parameter_generator(seed, name))
        else:
            plain = plain_name(name)
            original(plain, p, parameter_generator(seed, plain) if generator is not None else None)

    init_parameter._lora_aware = True
    policy.init_parameter = init_parameter


def trainable_summary(policy: nn.Module) -> dict[str, int]:
    """Parameter counts: adapters, other trainable, frozen."""
    out = {"adapters": 0, "other_trainable": 0, "frozen": 0}
    for name, p in policy.named_parameters():
        key = "adapters" if is_adapter(name) else ("other_trainable" if p.requires_grad else "frozen")
        out[key] += p.numel()
    return out


@torch.no_grad()
def merge_adapters(policy: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W + scale * B A, in the base weight's dtype) and put
    the base module back in its place: the policy without adapters, computing the same function."""
    if not has_adapters(policy):
        return policy
    from peft.tuners.lora import LoraLayer

    for name, module in list(policy.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            parent_name, _, child = name.rpartition(".")
            parent = policy.get_submodule(parent_name) if parent_name else policy
            setattr(parent, child, module.get_base_layer())
    return policy


def base_record(policy: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint without the frozen base records to rebuild it and to know it is the same base: the
    seed its random part was drawn from, and the pretrained files (names and sizes) it was loaded from.
    None for a policy without adapters."""
    if not has_adapters(policy):
        return None
    record: dict[str, Any] = {}
    if policy.init_seed is not None:
        record["init_seed"] = int(policy.init_seed)
    path = pretrained_path(policy)
    if path:
        record["pretrained"] = _pretrained_files(path)
    return record


def pretrained_path(policy: nn.Module) -> str | None:
    """The pretrained files the policy's weights were loaded from: its config's ``pretrained_path`` (the
    contract's ``cfg``; None for a policy that keeps no config, or whose config has no such option)."""
    return getattr(policy.cfg, "pretrained_path", None)


def _pretrained_files(path: str | Path) -> dict[str, int]:
    p = Path(path).expanduser()
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    return {f.name: f.stat().st_size for f in files}


def check_base(record: dict[str, Any] | None, pretrained_path: str | None, where: str) -> None:
    """Raise when ``policy.pretrained_path`` no longer holds the files the adapters in ``where`` were trained on
    (the adapters fit that base only: on another one they compute something else, silently)."""
    if not record or "pretrained" not in record:
        return
    path = pretrained_path
    now = _pretrained_files(path) if path and Path(path).expanduser().exists() else {}
    if now != record["pretrained"]:
        raise ValueError(f"{where}: its LoRA adapters were trained on the base loaded from files {record['pretrained']}, "
                         f"but policy.pretrained_path={path!r} now holds {now or 'nothing'}; the adapters fit that base "
                         "only: point policy.pretrained_path at it, or export the merged weights where it still is")
