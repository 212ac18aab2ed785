"""The Policy contract every engine, trainer, validator and checker relies on (docs/policies.md).

A policy is a ``torch.nn.Module`` built as ``Class(policy_cfg, stats, **policy.kwargs)``. :class:`Policy`
declares the whole contract, each hook with its contract in its own docstring; a class that does not derive
from it gets the declarations it lacks (:func:`as_policy_class`: its own methods win), so the built-in policies
and a user's are the same kind of thing and every built policy has every name below. Callers read a hook as
declared (``policy.prepare_inference is not None``), never discover it with ``getattr``;
tests/policy/test_policy_protocol.py checks that the library reads nothing on a policy that is not declared here,
and that every capability declared here is read somewhere.

The index:

- Required, no default: :meth:`Policy.forward` (called as ``policy(batch)``) and :meth:`Policy.sample_actions`.
- The contract with defaults (``CONTRACT``, with the two above): :meth:`Policy.sample_spec` and
  :meth:`Policy.check_data` (classmethods, run before the policy is built), :meth:`Policy.wrap_units`,
  :meth:`Policy.expert_modules`, :meth:`Policy.lora_parts`, :meth:`Policy.param_groups`,
  :meth:`Policy.no_weight_decay`, and the flags :attr:`Policy.supports_rtc` and
  :attr:`Policy.supports_rtc_training` (default ``False``).
- The statistics (``STATS_BUFFERS``): ``stats`` holds ``state_offset`` / ``state_scale`` / ``action_offset``
  / ``action_scale``, kept as buffers (:meth:`Policy.register_normalization`).
- Optional capabilities (``CAPABILITIES``), each ``None`` on :class:`Policy`, meaning "not offered":
  :attr:`Policy.cfg`, :attr:`Policy.gradient_checkpointing`, :attr:`Policy.init_seed`,
  :attr:`Policy.init_parameter`, :attr:`Policy.load_initial_weights`, :attr:`Policy.prepare_training`,
  :attr:`Policy.prepare_inference`, :attr:`Policy.prefix_modules`, :attr:`Policy.projection_groups`.
  A policy offers one by defining it: a method, or a plain attribute set in ``__init__``; never a submodule,
  parameter or buffer of that name (``nn.Module`` keeps those outside the instance's ``__dict__``, where the
  class's ``None`` would hide them).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from slurmvla.config.policy import PolicyConfig
from slurmvla.data.spec import DataFeatures, SampleSpec
from slurmvla.policy.tokenizer import ByteTokenizer

LossComponents = dict[str, tuple[torch.Tensor, torch.Tensor]]
# The instruction's tokens: in a sample exactly when the policy's sample spec has a tokenizer.
TEXT_FIELDS = ("text", "text_mask")


class Policy(nn.Module):
    """The contract, declared: every hook a caller may read, with its default (see the module docstring's
    index). Subclasses provide ``forward`` and ``sample_actions``; a capability left ``None`` is not offered."""

    # -- flags of the contract --------------------------------------------------------------------

    supports_rtc: bool = False
    """Real-time chunking at inference (a flow policy): ``True`` when ``sample_actions`` takes
    ``sample_actions(batch, noise=None, rtc=None)``, ``rtc`` a :class:`slurmvla.policy.rtc.Guidance` (the previous
    chunk in the dataset's units, the delay, the overlap). The policy then calls ``Guide.velocity`` in place of its
    velocity on each flow step and ``Guide.freeze`` on the chunk (or runs :func:`slurmvla.policy.rtc.integrate`
    over a ``velocity(x_t, t)`` of its own). Without ``rtc`` its output must be unchanged. The server offers the
    ``rtc`` execution mode only for such a policy (:func:`supports_rtc`)."""

    supports_rtc_training: bool = False
    """Training-time real-time chunking (``policy.rtc_training``, a flow policy): ``True`` when it adds
    :func:`slurmvla.policy.rtc.delay_draws` to its sample spec's draws, trains through
    :func:`slurmvla.policy.rtc.delayed_chunk` (its velocity then takes a time per action, ``t`` ``[B, H]``) and
    answers ``rtc`` through :func:`slurmvla.policy.rtc.conditioning` (a clean prefix, no guidance). A class
    without it refuses ``policy.rtc_training`` when built (:func:`construct`)."""

    # -- optional capabilities: None means "not offered" ------------------------------------------

    cfg: PolicyConfig | None = None
    """The ``policy`` config node it was built with, kept as ``self.cfg`` in ``__init__`` (the built-in
    policies keep it). Read for ``cfg.pretrained_path`` by LoRA's record of a frozen base
    (:func:`slurmvla.policy.lora.base_record`) and the resume check (``slurmvla.checkpoint``), and for the
    policy's name in :meth:`text_inputs`'s errors."""

    gradient_checkpointing: bool | None = None
    """A switch, set from ``cfg.gradient_checkpointing`` in ``__init__`` and read at each training forward:
    ``True`` runs the layers under non-reentrant activation checkpointing (as ``policy.checkpoint_every`` /
    ``checkpoint_saves`` say: :class:`slurmvla.policy.recompute.Recompute`). Others flip it for a pass and put
    it back: the checker (gradients with it on vs off, :mod:`slurmvla.check.subject`) and the planner
    (``slurmvla.planner.activations`` / ``fit``: model FLOPs with it off, memory and issued FLOPs as
    configured; ``slurmvla.profile`` counts with the same). ``None``: the policy has no such switch."""

    init_seed: int | None = None
    """The seed of every parameter's own generator (:func:`slurmvla.parameters.parameter_generator` with the
    parameter's name): drawn once from torch's global generator in ``__init__``, before any module is built, so
    the weights are the same built whole or parameter by parameter on each rank's shard. Read by
    materialisation (:mod:`slurmvla.engine.materialize`) and by LoRA (each adapter factor's generator; a LoRA
    checkpoint records it, and ``slurmvla.inference.load`` sets it back from that record before the frozen base
    is rebuilt). ``None``: LoRA draws one seed from the global generator after the policy's own weights."""

    init_parameter: Callable[[str, torch.Tensor, torch.Generator | None], None] | None = None
    """``init_parameter(name, tensor, generator)``: initialise parameter ``name``'s value ``tensor`` (whole,
    fp32, on the host) in place from ``generator`` (torch's global one when ``None``), independently of every
    other parameter; may be a staticmethod. With it (and :attr:`init_seed`) the class can be built on the meta
    device (:func:`slurmvla.parameters.supports_deferred_init`, ``build_policy(on_meta=True)``) and the engine
    materialises each parameter where it will live, from ``parameter_generator(init_seed, name)``
    (:func:`slurmvla.engine.materialize.materialize`); LoRA wraps it so the adapters' factors are initialised
    the same way (:mod:`slurmvla.policy.lora`)."""

    load_initial_weights: Callable[[], None] | None = None
    """``load_initial_weights()``: copy pretrained weights (e.g. from ``policy.pretrained_path``) into the
    initialised parameters. A policy built whole calls it itself at the end of ``__init__``; a meta-built one is
    loaded by the engine after materialising (:func:`slurmvla.engine.materialize.materialize`), each rank
    writing its part."""

    prepare_training: Callable[[dict], dict] | None = None
    """``prepare_training(batch) -> batch``: the host's part of a training forward, on the host batch before it
    moves to the device (pi0 / pi0.5: the prompt's ids cut to a multiple of ``policy.prompt_bucket`` columns;
    pi0.5 writes its prompt from the state), so the forward never waits on the device for values it needs on
    the host; ``forward`` on the result gives the loss of the batch given. The trainer calls it on every
    micro-batch (``Trainer._host_part``)."""

    prepare_inference: Callable[..., dict] | None = None
    """``prepare_inference(batch, bucket=...) -> batch``: the host's part of ``sample_actions`` (and of the
    forward), on the host batch before it moves: on the batch returned (tensors only) ``sample_actions`` never
    waits on the device, so it can be captured in a CUDA graph, and its shapes take few values (the prompt cut
    to a multiple of ``bucket`` columns; ``bucket=1``: exactly as the forward cuts it); its actions are those of
    the batch given. Called by the CUDA-graph sampler (:mod:`slurmvla.inference.graphs`: ``serve.cuda_graph`` and
    ``evaluate --cuda-graph`` need it), and with ``bucket=1`` by the planner's fake batch
    (``slurmvla.planner.activations``) and the profiler's FLOP count (``slurmvla.profile``)."""

    prefix_modules: Callable[[], list[nn.Module]] | None = None
    """``prefix_modules() -> [nn.Module]``: what a request runs once, before its denoising steps (pi0 / pi0.5:
    the vision tower, its projector and the backbone's half of every layer). ``serve.fp8_prefix`` needs it and
    runs their ``nn.Linear`` products in float8 (:mod:`slurmvla.inference.fp8`)."""

    projection_groups: Callable[[], Iterable[tuple[nn.Module, str, list[nn.Linear]]]] | None = None
    """``projection_groups() -> iterable of (owner, name, linears)``: groups of ``nn.Linear`` that read one
    input (pi0 / pi0.5: each Gemma layer's q / k / v, its MLP's gate / up), which inference may store as one
    weight, the plain attribute ``owner.<name>``, that the model reads when it is there
    (:func:`slurmvla.inference.optimize.fuse_projections`: the server's and the evaluator's default)."""

    # -- the contract's methods -------------------------------------------------------------------

    def forward(self, batch: dict) -> dict:
        """``policy(batch)`` (through ``__call__``, so FSDP's hooks run) returns a dict with the scalar ``loss``
        and, under ``components``, a per-sample ``(sum, count)`` pair per loss component, so validation can
        split a mixed batch by provenance (Σsum / Σcount per group). The training loss must be a mean whose
        denominator depends only on the batch shape, so that a global batch's loss is exactly the mean of its
        shards' losses, on any world size and accumulation split. No default."""
        raise NotImplementedError(f"{type(self).__qualname__} has no forward(batch): training needs it")

    @classmethod
    def sample_spec(cls, cfg: PolicyConfig) -> SampleSpec:
        """What its samples must look like (a classmethod: the data is built before the policy, whose
        normalization comes from the data's statistics): image size, action horizon, observation history,
        tokenizer, and the training randomness the data pre-draws. Default: images at ``policy.image_size``,
        ``policy.action_horizon`` actions, the byte tokenizer at ``policy.max_text_len``, no pre-drawn
        randomness."""
        return SampleSpec(image_size=cfg.image_size, action_horizon=cfg.action_horizon,
                          num_obs_history=cfg.num_obs_history, tokenizer=ByteTokenizer(cfg.max_text_len))

    @classmethod
    def check_data(cls, cfg: PolicyConfig, features: DataFeatures) -> None:
        """Raise a ``ValueError`` naming the key and the data's value when the data does not fit the policy (a
        classmethod, run before the policy is built). Default: the shapes the policy is built for must be the
        data's (cameras, state and action dims), or training silently learns garbage."""
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
        """:func:`register_normalization` on this policy."""
        register_normalization(self, cfg, stats)

    def text_inputs(self, batch: dict, reads: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(text, text_mask)`` from ``batch`` when the policy was built to read them (``reads``: decided
        at build time, with the sample spec's tokenizer, so the data layer yields them on every rank),
        else None. A batch that lacks a field the policy reads, or carries one it was built not to
        read, is a ``ValueError`` naming the field, here on this rank: the model never asks other ranks.
        That every rank's batch has the same fields is checked once, before the first forward, by the
        caller (the trainer, with :func:`slurmvla.collectives.check_same_fields`)."""
        name = getattr(self.cfg, "name", type(self).__qualname__)  # self.cfg: a config, or None
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
        """The action chunk ``[B, action_horizon, action_dim]`` in the dataset's units (inference: the server and
        the evaluator call only this, through :func:`seeded_sample_actions`). A policy whose ``sample_actions``
        also takes ``noise=`` (shaped as its spec's ``noise`` draw) gets it drawn on the CPU from the seed: the
        same chunk on every device. With :attr:`supports_rtc` it also takes ``rtc=``. No default."""
        raise NotImplementedError(f"{type(self).__qualname__} has no sample_actions(batch): inference needs it")

    def wrap_units(self) -> list[nn.Module]:
        """The modules a sharding engine wraps one by one (one per layer, disjoint). Default: none (single and
        DDP need none; sharding engines refuse a policy without units)."""
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
        """The optimizer's groups of trainable parameters (``name``, ``params``, ``param_names``,
        ``weight_decay``, ``lr``), called by the engine and the planner. Default: backbone / action expert
        (:meth:`expert_modules`, the backbone's learning rate scaled by ``backbone_lr_scale``), each into decay /
        no decay (:meth:`no_weight_decay`)."""
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


# The contract's methods and flags: every built policy has them (Policy's defaults where its class has none).
CONTRACT = ("forward", "sample_actions", "sample_spec", "check_data", "wrap_units", "expert_modules", "lora_parts",
            "param_groups", "no_weight_decay", "supports_rtc", "supports_rtc_training")
# The contract's statistics: buffers the policy registers (Policy.register_normalization), no class default.
STATS_BUFFERS = ("state_offset", "state_scale", "action_offset", "action_scale")


def register_normalization(module: nn.Module, cfg: PolicyConfig, stats: dict[str, torch.Tensor] | None) -> None:
    """``state_offset`` / ``state_scale`` / ``action_offset`` / ``action_scale`` (``STATS_BUFFERS``: the contract's
    ``stats``, ``normalized = (x - offset) / scale`` from the data's statistics) as fp32 buffers of ``module``
    (identity without stats; a scale floored at 1e-4): they travel with the weights into checkpoints and exports,
    stay fp32 whatever the compute dtype, and stay plain tensors under FSDP (never sharded). For any policy, a
    plain ``nn.Module`` too."""
    for prefix, dim in (("state", cfg.state_dim), ("action", cfg.action_dim)):
        offset = torch.zeros(dim) if stats is None else stats[f"{prefix}_offset"].float().reshape(dim)
        scale = torch.ones(dim) if stats is None else stats[f"{prefix}_scale"].float().reshape(dim)
        module.register_buffer(f"{prefix}_offset", offset.clone())
        module.register_buffer(f"{prefix}_scale", scale.clamp_min(1e-4).clone())
# The optional capabilities: None on Policy ("not offered"); a policy offers one by defining it.
CAPABILITIES = ("cfg", "gradient_checkpointing", "init_seed", "init_parameter", "load_initial_weights",
                "prepare_training", "prepare_inference", "prefix_modules", "projection_groups")


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
        from slurmvla.formats import moved_target

        if (home := moved_target(path)) is not None:  # a command line of a run started before the policy move
            raise ValueError(f"{where}={path!r}: this class moved; it is {home!r} in this release (a saved run or "
                             "exported file naming the old home is read with the new one)") from None
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
    if rtc_training is not None and rtc_training.enabled and not cls.supports_rtc_training:
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
    takes ``rtc=``. ``policy``: a built policy, or what inference calls ``sample_actions`` on in its place
    (:class:`slurmvla.inference.graphs.GraphedSampler`, which declares ``supports_rtc`` too)."""
    return policy.supports_rtc is True and "rtc" in inspect.signature(policy.sample_actions).parameters


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
