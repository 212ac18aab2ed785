"""``policy.gradient_checkpointing=auto``: the least recomputation the planner predicts fits the GPU.

The settings in order of cost (slurmvla/policy/recompute.py says what each recomputes):

1. none: every activation kept;
2. ``checkpoint_saves=matmuls`` with ``checkpoint_every=k``, the largest ``k`` that fits (layers 0, k, 2k, ... of
   each stack checkpointed, each keeping its matrix products and attention: only their elementwise work runs
   again);
3. full recomputation: ``checkpoint_saves=inputs``, every layer.

Each setting's peak per GPU is the planner's (:func:`slurmvla.planner.fit.plan_engine`: the model states by the
engine's rule, the activations measured on fake tensors with that setting; with ``trainer.compile`` as the
compiled step keeps them, :mod:`slurmvla.planner.compiled`) against the plan's budget: the GPU's
memory less ``RESERVED_BYTES`` and the allocator margin. The planner's peak is taken as falling with ``k`` (fewer
layers keep everything), so the largest ``k`` is found by a search: a first probe where the line through the peaks
at ``k = 1`` and at the deepest stack's depth meets the budget, its neighbour, then bisection. Where nothing fits,
full recomputation, the least memory, and the choice says so. An engine that refuses activation checkpointing
(ZeRO-3) gets none, as does a run without a GPU (nothing to fit). :func:`choose` is pure: the GPU is an argument, so any GPU of
:data:`slurmvla.planner.gpus.GPUS` can be asked about; :func:`resolve` is what training calls at start-up.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from slurmvla.config import Config
from slurmvla.config.policy import PolicyConfig
from slurmvla.planner.gpus import DEFAULT_MARGIN, GPU, RESERVED_BYTES
from slurmvla.registry import ENGINES
from slurmvla.units import GiB

log = logging.getLogger("slurmvla")

AUTO = "auto"


@dataclass(frozen=True)
class Setting:
    """One recomputation setting: the three policy options it sets."""

    gradient_checkpointing: bool
    checkpoint_saves: str = "inputs"
    checkpoint_every: int = 1

    def __str__(self) -> str:
        if not self.gradient_checkpointing:
            return "none"
        if self.checkpoint_saves == "inputs" and self.checkpoint_every == 1:
            return "full (inputs, every layer)"
        return f"{self.checkpoint_saves}, every {self.checkpoint_every}"

    @classmethod
    def of(cls, policy_cfg: PolicyConfig) -> Setting | None:
        """The setting a resolved policy config trains with; None while it is still ``auto``."""
        on = policy_cfg.gradient_checkpointing
        if not isinstance(on, bool):
            return None
        return cls(on, policy_cfg.checkpoint_saves, policy_cfg.checkpoint_every)

    def overrides(self) -> str:
        if not self.gradient_checkpointing:
            return "policy.gradient_checkpointing=false"
        return (f"policy.gradient_checkpointing=true policy.checkpoint_saves={self.checkpoint_saves} "
                f"policy.checkpoint_every={self.checkpoint_every}")

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this setting (a shallow copy: the policy's config replaced, nothing else)."""
        out = copy.copy(cfg)
        out.policy = dataclasses.replace(cfg.policy, **dataclasses.asdict(self))
        return out


NONE = Setting(False)
FULL = Setting(True, "inputs", 1)


def matmuls(every: int) -> Setting:
    return Setting(True, "matmuls", every)


@dataclass
class Choice:
    """What ``auto`` chose, why, and every setting's predicted peak it weighed (bytes per GPU, the worst rank)."""

    setting: Setting
    reason: str
    gpu: str | None = None
    budget_bytes: int | None = None
    peaks: dict[Setting, int] = field(default_factory=dict)
    fits: bool = True

    def line(self) -> str:
        """The one line training logs."""
        out = f"policy.gradient_checkpointing=auto -> {self.setting} ({self.setting.overrides()}): {self.reason}"
        if self.peaks:
            weighed = ", ".join(f"{s} {p / GiB:.2f} GiB" for s, p in self.peaks.items())
            out += f"; predicted peak per GPU: {weighed}"
        return out


def deepest_stack(cfg: Config) -> int:
    """The most layers of any of the policy's stacks (pi0 / pi0.5: the vision tower's 27 at the published size):
    beyond it, a larger ``checkpoint_every`` checkpoints the same layers (layer 0 only)."""
    return max((1, *cfg.policy.layer_stacks()))


def checkpointed_layers(cfg: Config, every: int) -> int:
    """Layers checkpointed with ``checkpoint_every=every``: 0, every, 2 x every, ... of each stack."""
    return sum(-(-d // every) for d in cfg.policy.layer_stacks() if d)


def interpolated(cfg: Config, least: int, most: int, budget: int, lo: int, hi: int) -> int | None:
    """The largest ``k`` in ``(lo, hi]`` whose checkpointed layers are at least as many as the line through the
    peaks at k = 1 (``least``) and at the deepest stack's depth (``most``) says the budget needs; None where the
    two peaks do not differ."""
    n_least, n_most = checkpointed_layers(cfg, 1), checkpointed_layers(cfg, deepest_stack(cfg))
    if most <= least or n_least <= n_most:
        return None
    needed = n_most + (most - budget) / (most - least) * (n_least - n_most)
    return next((k for k in range(hi, lo, -1) if checkpointed_layers(cfg, k) >= needed), lo + 1)


def budget_rule(gpu: GPU, margin: float) -> str:
    return (f"the budget on {gpu.name}: {gpu.memory_bytes / GiB:.1f} GiB - {RESERVED_BYTES / GiB:.0f} GiB reserved - "
            f"{100 * margin:.0f}% allocator margin")


def choose(cfg: Config, gpu: GPU | None, nodes: int = 1, gpus_per_node: int = 1,
           margin: float = DEFAULT_MARGIN, peak: Callable[[Config], tuple[int, int]] | None = None) -> Choice:
    """The least recomputation whose predicted peak is within the budget of ``gpu`` (None: no GPU) for the
    configured engine, world (``nodes x gpus_per_node``) and micro-batch. ``peak(cfg)``: (predicted peak bytes,
    budget bytes) of a configuration; the planner's by default."""
    engine = ENGINES.get(cfg.engine.name)
    if not engine.activation_checkpointing:
        return Choice(NONE, f"engine={engine.name} refuses activation checkpointing, so nothing is recomputed")
    if gpu is None:
        return Choice(NONE, "no GPU (a CPU run): no device memory to fit, so nothing is recomputed")
    if peak is None:
        peak = planned_peak(gpu, nodes, gpus_per_node, margin)
    peaks: dict[Setting, int] = {}
    budget = 0

    def fits(s: Setting) -> bool:
        nonlocal budget
        if s not in peaks:
            peaks[s], budget = peak(s.apply(cfg))
        return peaks[s] <= budget

    rule = budget_rule(gpu, margin)
    if fits(NONE):
        return Choice(NONE, f"it fits within {rule}", gpu.name, budget, peaks)
    # The largest k whose matmuls setting fits: fits(k) taken as true up to some k and false beyond it. The two
    # ends first: the cheapest recomputation of them (the largest k) and the least memory (k = 1), which
    # settles "none of them fits" in one pass instead of a search down to 1. Between them, the first probe is
    # where the two ends' peaks, drawn as a line in the number of checkpointed layers, meet the budget, and the
    # second its neighbour on the side the answer lies: a search of two passes where the line holds (pi0.5 on one
    # 80 GB GPU), a bisection of what is left where it does not.
    deepest = deepest_stack(cfg)
    lo, hi = 0, deepest  # lo: fits (0: none known yet); every k above hi: does not fit
    if fits(matmuls(hi)):
        lo = hi
    elif hi > 1 and fits(matmuls(1)):
        lo, hi = 1, hi - 1
        probe = interpolated(cfg, peaks[matmuls(1)], peaks[matmuls(deepest)], budget, lo, hi)
        first = True
        while lo < hi:
            mid = min(max(probe if probe is not None else (lo + hi + 1) // 2, lo + 1), hi)
            probe = None
            if fits(matmuls(mid)):
                lo = mid
                probe = mid + 1 if first else None
            else:
                hi = mid - 1
                probe = mid - 1 if first else None
            first = False
    if lo:
        found = matmuls(lo)
        why = f"none does not fit within {rule}; {found} does, and recomputes the least of those that do"
        return Choice(found, why, gpu.name, budget, peaks)
    if fits(FULL):
        return Choice(FULL, f"neither none nor matmuls at any checkpoint_every fits within {rule}; full does", gpu.name,
                      budget, peaks)
    return Choice(FULL, f"NOTHING fits within {rule}, full recomputation least of all ({budget / GiB:.2f} GiB); it "
                  "keeps the least memory: shard over more GPUs, lower the micro-batch or freeze parts "
                  "(python -m slurmvla.plan)", gpu.name, budget, peaks, fits=False)


def planned_peak(gpu: GPU, nodes: int, gpus_per_node: int, margin: float) -> Callable[[Config], tuple[int, int]]:
    """The planner's (peak bytes, budget bytes) of a configuration on this world of GPUs: one measured pass, at
    the configured micro-batch."""
    from slurmvla.planner.fit import plan_engine, planner_for

    def peak(cfg: Config) -> tuple[int, int]:
        r = plan_engine(planner_for(cfg), cfg, gpu, nodes, gpus_per_node, margin, peak_only=True)
        return r["peak_bytes"], r["budget_bytes"]

    return peak


def device_gpu(device) -> GPU | None:  # noqa: ANN001 - a torch.device
    """The GPU training runs on, by the memory the driver reports (None on the CPU); only its memory counts
    here (no time is estimated)."""
    import torch

    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return GPU(props.name, props.total_memory // 2**20, 0.0, 0.0, "torch.cuda.get_device_properties")


def resolve(cfg: Config, device, env) -> Config:  # noqa: ANN001 - a torch.device, a DistEnv
    """Training's start-up, before the policy is built: ``cfg`` unchanged unless its policy asks for ``auto``;
    then rank 0 asks the planner (a policy it cannot plan gets full recomputation, the least memory), says the
    choice in one line, and every rank takes the same setting."""
    if not cfg.policy.recompute_auto:
        return cfg
    shared: list = [None]
    if env.is_main:
        try:
            choice = choose(cfg, device_gpu(device), env.num_nodes, env.local_world_size)
        except Exception as e:  # a policy the planner cannot build or run: the safe side
            choice = Choice(FULL, f"the planner could not predict the peaks ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''}), so the least memory", fits=False)
        (log.info if choice.fits else log.warning)("%s", choice.line())
        shared[0] = choice.setting
    if env.is_distributed:
        import torch.distributed

        torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0].apply(cfg)
