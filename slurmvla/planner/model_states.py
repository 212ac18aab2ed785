"""The model states: the policy's parameters counted on the meta device (exactly, nothing allocated), and
the bytes per GPU the configured engine holds them in, by the engine's own memory rule (its registry entry's
``memory_rule``, written beside the engine: slurmvla/engine/<engine>.py)."""

from __future__ import annotations

from torch import nn

from slurmvla.config import Config
from slurmvla.config.policy import PolicyConfig
from slurmvla.engine.memory import States, Tensors
from slurmvla.registry import ENGINES


def shape_only(policy_cfg: PolicyConfig) -> PolicyConfig:
    """The policy's config without the local files its build would read (pretrained weights, a tokenizer):
    the plan needs shapes only, and the byte tokenizer fills the prompt as a worst case."""
    return policy_cfg.without_local_files()


def build_on_meta(cfg: Config) -> nn.Module:
    """Every parameter on the meta device, whether or not the policy initialises per parameter (a plug-in's
    too: ``build_policy(on_meta=True)`` builds those whole)."""
    from slurmvla.parameters import parameters_on_meta
    from slurmvla.policy import build_policy

    with parameters_on_meta():
        return build_policy(shape_only(cfg.policy), stats=None)


def count_tensors(cfg: Config, policy: nn.Module) -> Tensors:
    from slurmvla.parameters import is_adapter

    params = [(tuple(p.shape), p.requires_grad) for p in policy.parameters()]
    in_unit: dict[int, int] = {}
    units: list[tuple[int, int]] = []
    for i, unit in enumerate(policy.wrap_units()):
        own = [p for p in unit.parameters() if id(p) not in in_unit]
        for p in own:
            in_unit[id(p)] = i
        units.append((sum(p.numel() for p in own), sum(p.numel() for p in own if p.requires_grad)))
    rest = [p for p in policy.parameters() if id(p) not in in_unit]
    root = (sum(p.numel() for p in rest), sum(p.numel() for p in rest if p.requires_grad))
    o = cfg.optim  # every built policy has the contract's param_groups (a plug-in gets the default)
    groups = [sum(p.numel() for p in g["params"]) for g in policy.param_groups(o.weight_decay, o.lr,
                                                                               o.backbone_lr_scale)]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in policy.modules()), default=0)
    buffers = list(policy.buffers())
    adapters = sum(p.numel() for n, p in policy.named_parameters() if is_adapter(n))
    return Tensors(params, sum(b.nbytes for b in buffers), sum(b.numel() for b in buffers if b.is_floating_point()),
                   units, root, groups, largest, adapters)


def model_states(cfg: Config, t: Tensors, world: int, gpus_per_node: int) -> States:
    """Bytes per GPU (the worst rank) of the configured engine on ``world`` ranks, ``gpus_per_node`` a node."""
    return ENGINES.get(cfg.engine.name).model_states(cfg.engine, cfg.precision, t, world, gpus_per_node)
