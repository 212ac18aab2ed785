"""The activations of one micro-batch, MEASURED: the real policy runs one training forward + backward on
tensors that have shapes and dtypes but no data, at the configured micro-batch, while a dispatch mode adds up the
bytes of every storage created and frees them as they die; the peak is the figure. The tensors are on the meta
device (attention routed to the kernel the CPU would run: :class:`CpuAttention`), or fake CPU tensors
(``FakeTensorMode``) where the meta device cannot run the policy, and always with ``trainer.compile``: then the
repeated layers run as the compiled step runs them (:mod:`slurmvla.planner.compiled`: what the partitioner
saves for the backward, not what eager autograd saves), which needs fake tensors to trace. The same ops, so the
same bytes (a test holds them equal); on the meta device at about half the cost (FakeTensor's dispatch is what a
pass spends its time in). Where a policy cannot run on either, an analytic ESTIMATE instead."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from slurmvla.config import Config
from slurmvla.config.policy import TransformerPolicyConfig
from slurmvla.planner.autocast import CudaAutocast
from slurmvla.planner.step_time import sdpa_flop_mapping

# CUDA's caching allocator rounds every block up to a multiple of 512 bytes.
CUDA_BLOCK = 512


# -- tracking live bytes ------------------------------------------------------------------------------


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Adds up the bytes of every storage an op creates and takes them off when the storage dies; keeps
    the peak. Storages that existed before (``known``) never count."""

    def __init__(self, known: Iterator[torch.Tensor] = (), round_to: int = 1):
        super().__init__()
        self.round_to = max(1, round_to)
        self.counting = True
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self._known = []
        for t in known:
            st = t.untyped_storage()
            self._known.append(st)  # held: an id never comes back for a newer storage while it lives
            self.live[id(st)] = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key in self.live:
                    continue
                n = -(-st.nbytes() // self.round_to) * self.round_to
                self.live[key] = n
                self.current += n
                self.peak = max(self.peak, self.current)
                weakref.finalize(st, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing created inside counts (e.g. the tracing of a compiled layer)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before


# -- the fake training step ------------------------------------------------------------------------


INSTRUCTION = "pick up the object on the left and put it in the bowl on the right, then push the drawer closed; "


# DROID 1.0.1's cameras (180 x 320): the frames of a policy that takes them as recorded and resizes them itself
# (pi0 / pi0.5: SampleSpec.image_size None).
DROID_FRAME = (180, 320)


def fake_batch(cfg: Config, policy: nn.Module, micro: int, frame: tuple[int, int] = DROID_FRAME) -> dict[str, Any]:
    """A micro-batch of the policy's sample spec, real CPU tensors with random values (small: uint8 images at
    policy.image_size, or at ``frame`` for a policy that resizes frames itself); the instruction fills
    policy.max_text_len tokens. A policy that prepares its input on the host (pi0.5 writes its prompt from the
    state) does so here, as training does."""
    from slurmvla.data.prepare import text_fields
    from slurmvla.policy import policy_class

    p = cfg.policy
    spec = policy_class(p).sample_spec(p)
    g = torch.Generator().manual_seed(0)
    height, width = (spec.image_size, spec.image_size) if spec.image_size else frame
    images = p.num_cameras * p.num_obs_history
    state_shape = (micro, p.num_obs_history, p.state_dim) if p.num_obs_history > 1 else (micro, p.state_dim)
    instruction = (INSTRUCTION * (1 + 4 * p.max_text_len // len(INSTRUCTION)))[: 4 * p.max_text_len]
    batch: dict[str, Any] = {
        "images": torch.randint(0, 256, (micro, images, height, width, 3), dtype=torch.uint8, generator=g),
        "image_mask": torch.ones(micro, images, dtype=torch.bool),
        "state": torch.randn(state_shape, generator=g) * 0.5,
        "actions": torch.randn(micro, spec.action_horizon, p.action_dim, generator=g),
        "action_mask": torch.ones(micro, spec.action_horizon, dtype=torch.bool),
        "instruction": [instruction] * micro,
    }
    draws = [spec.draw(g) for _ in range(micro)]
    for k in draws[0] if draws else {}:
        batch[k] = torch.stack([d[k] for d in draws])
    text = text_fields(spec, instruction)
    for k, v in text.items():
        batch[k] = v[None].expand(micro, *v.shape).clone()
    if cfg.data.mode != "policy":
        from slurmvla.config.data import SAMPLE_MODES

        mode = SAMPLE_MODES.index(cfg.data.mode) if cfg.data.mode in SAMPLE_MODES else 0
        batch["mode"] = torch.full((micro,), mode, dtype=torch.long)
        batch["future_states"] = torch.randn(micro, spec.action_horizon, p.state_dim, generator=g)
        batch["future_mask"] = torch.ones(micro, spec.action_horizon, dtype=torch.bool)
    prepare = policy.prepare_inference  # a capability of the contract (slurmvla/policy/base.py): None if not offered
    if prepare is not None:
        hushed = logging.getLogger("slurmvla.policy.pi0.model")
        level, hushed.level = hushed.level, logging.ERROR  # "a prompt filled max_text_len": meant to here
        try:
            with torch.no_grad():
                batch = prepare(batch, bucket=1)
        finally:
            hushed.level = level
    return batch



def failure(e: Exception) -> str:
    """Why the fake-tensor pass could not run, in one line (the plan falls back to an analytic estimate)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


@dataclass
class Pass:
    micro: int
    peak_bytes: int
    flops: float
    forward_flops: float
    seconds: float


class CpuAttention(TorchFunctionMode):
    """On meta tensors, ``scaled_dot_product_attention`` as the CPU runs it. Its dispatch picks the fused kernel by
    device, and the meta device has no choice of its own: there torch takes the unfused math path, whose
    intermediates (the scores, the probabilities, their dtype casts) a fake CPU tensor's pass, and a real CPU
    step, never hold. Here the choice is the CPU's (asked of one-token tensors of the same heads, dims and dtypes:
    the sequence lengths do not enter it), and the fused kernel is called as the CPU's composite calls it: a
    boolean mask first turned into an additive one in the queries' dtype (0 where True, -inf elsewhere)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or not args[0].is_meta:
            return func(*args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        kwargs.update(zip(names, args[3:]))
        q, k, v = args[:3]
        mask, dropout, causal = kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False)

        def one_token(t: torch.Tensor, seq_dims: tuple[int, ...]) -> torch.Tensor:
            shape = [1 if i == 0 or i in seq_dims else n for i, n in enumerate(t.shape)]
            return torch.zeros(shape, dtype=t.dtype, device="cpu")

        with _disable_current_modes():  # real CPU tensors, counted by no tracker
            choice = torch._fused_sdp_choice(
                one_token(q, (q.dim() - 2,)), one_token(k, (k.dim() - 2,)), one_token(v, (v.dim() - 2,)),
                None if mask is None else one_token(mask, (mask.dim() - 2, mask.dim() - 1)), dropout, causal,
                scale=kwargs.get("scale"), enable_gqa=kwargs.get("enable_gqa", False))
        if choice != SDPBackend.FLASH_ATTENTION.value:
            return func(q, k, v, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            neg_inf = torch.scalar_tensor(-float("inf"), dtype=q.dtype, device=mask.device)
            mask = torch.where(mask, torch.scalar_tensor(0.0, dtype=q.dtype, device=mask.device), neg_inf)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout, causal, attn_mask=mask, scale=kwargs.get("scale"))[0]


class ShapeStep:
    """The policy on tensors without data (meta, or with ``fake`` fake CPU tensors), ready for training forward +
    backward passes at any micro-batch and in any of the engines' parameter dtypes. Built once per plan (and
    once more with ``fake`` for the compiled layers). Takes ``meta_policy`` over (its parameters on the meta
    device, its buffers real: the sample is prepared from them first)."""

    def __init__(self, cfg: Config, meta_policy: nn.Module, round_to: int = CUDA_BLOCK,
                 frame: tuple[int, int] = DROID_FRAME, fake: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.cfg, self.round_to, self.fake = cfg, round_to, fake
        self.policy = meta_policy
        # One sample, prepared while the buffers (normalization statistics) are still real: pi0.5 writes its
        # prompt from the state's values, which a tensor without data does not have.
        self.sample = fake_batch(cfg, meta_policy, 1, frame)
        self._dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self._resident: bool | None = None
        self._compiled = None  # the layers' compiled traces, made at the first compiled pass
        self.mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        with self._tensors():
            self.policy.to_empty(device="cpu" if fake else "meta")
        self.policy.train()

    @contextmanager
    def _tensors(self) -> Iterator[None]:
        """Where the pass's tensors live: fake CPU tensors, or the meta device (a factory without a device makes
        a meta tensor there, as it makes a fake one under FakeTensorMode) with the CPU's attention."""
        if self.fake:
            with self.mode:
                yield
        else:
            with torch.device("meta"), CpuAttention():
                yield

    def use_dtypes(self, compute: tuple[torch.dtype, torch.dtype], resident_grads: bool = True) -> None:
        """Trainable / frozen parameters in these dtypes; ``resident_grads``: every trainable one with a gradient
        already (they are not counted), else none (each pass counts them as its backward makes them)."""
        if compute == self._dtypes and resident_grads == self._resident:
            return
        with self._tensors(), torch.no_grad():
            for p in self.policy.parameters():
                want = compute[0] if p.requires_grad else compute[1]
                if p.is_floating_point() and p.dtype != want:
                    p.data = p.data.to(want)
                if p.requires_grad:
                    p.grad = torch.zeros_like(p) if resident_grads else None
        self._dtypes, self._resident = compute, resident_grads

    @contextmanager
    def _checkpointing(self, on: bool | None) -> Iterator[None]:
        """``on`` False: gradient checkpointing off for this pass (the model FLOPs count); None: as configured."""
        before = self.policy.gradient_checkpointing
        has = before is not None  # None: the policy has no switch
        if has and on is not None:
            self.policy.gradient_checkpointing = on
        try:
            yield
        finally:
            if has:
                self.policy.gradient_checkpointing = before

    def _cast_inputs(self) -> list:
        """Forward pre-hooks casting the floating inputs of every wrap unit and of the policy to bf16, as
        FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does (the engine's default)."""
        from torch.utils._pytree import tree_map

        def cast(x: Any) -> Any:
            return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() \
                and x.dtype != torch.bfloat16 else x

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return tree_map(cast, args), tree_map(cast, kwargs)

        modules = [*self.policy.wrap_units(), self.policy]
        return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]

    @contextmanager
    def _compiling(self, on: bool, tracker: LiveBytes) -> Iterator[None]:
        """``on``: the wrap units run as ``trainer.compile`` runs them (slurmvla.planner.compiled)."""
        if not on:
            yield
            return
        if self._compiled is None:
            from slurmvla.planner.compiled import CompiledUnits

            self._compiled = CompiledUnits(self.policy)
        with self._compiled.active(tracker):
            yield

    def flops_on_meta(self, low: bool) -> tuple[float, float]:
        """(model FLOPs, issued FLOPs) of the prepared sample: :func:`count_flops`."""
        return count_flops(self.cfg, self.sample, low)

    def run(self, micro: int, compute: tuple[torch.dtype, torch.dtype], low: bool, count_flops: bool = False,
            checkpointing: bool | None = None, cast_inputs: bool = False, compiled: bool = False,
            resident_grads: bool = True) -> Pass:
        """One training forward + backward at ``micro``; ``compiled``: the repeated layers as the compiled
        step runs them; ``resident_grads`` False: the gradients the backward makes count (and go with the pass)."""
        from torch.utils.flop_counter import FlopCounterMode

        t0 = time.perf_counter()
        self.use_dtypes(compute, resident_grads)
        if compiled and not self.fake:
            raise ValueError("the compiled layers are traced on fake tensors: a ShapeStep(..., fake=True) measures them")
        batch = {k: (v.expand(micro, *v.shape[1:]).clone() if isinstance(v, torch.Tensor) else list(v) * micro)
                 for k, v in self.sample.items()}
        if self.fake:
            with self.mode:
                batch = {k: (self.mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        else:
            batch = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        known = [*self.policy.parameters(), *self.policy.buffers(),
                 *(p.grad for p in self.policy.parameters() if p.grad is not None),
                 *(v for v in batch.values() if isinstance(v, torch.Tensor))]
        tracker = LiveBytes(known, self.round_to)
        counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) if count_flops else None
        autocast = CudaAutocast(torch.bfloat16) if low else None
        hooks = self._cast_inputs() if cast_inputs else []
        try:
            with self._checkpointing(checkpointing), self._tensors(), tracker, self._compiling(compiled, tracker):
                with counter if counter is not None else _nothing(), autocast if autocast is not None else _nothing():
                    out = self.policy(batch)
                    loss = out["loss"] if isinstance(out, dict) else out
                    forward_flops = float(counter.get_total_flops()) if counter is not None else 0.0
                    backward(loss)
                del out, loss
        finally:
            for h in hooks:
                h.remove()
            if not resident_grads:  # as the step's zero_grad(set_to_none=True): the next pass starts without them
                for p in self.policy.parameters():
                    p.grad = None
        flops = float(counter.get_total_flops()) if counter is not None else 0.0
        return Pass(micro, tracker.peak, flops, forward_flops, time.perf_counter() - t0)


def count_flops(cfg: Config, sample: dict[str, Any], low: bool = False, issued: bool = True) -> tuple[float, float]:
    """(model FLOPs, issued FLOPs) of one prepared sample's forward + backward, counted on a copy of the policy
    built on the meta device (shapes only: no weights, no memory, whatever the policy's size; the same counts as
    fake-tensor passes at under half their cost, FakeTensor's dispatch being what a pass spends its time in).
    Model: with gradient checkpointing off (as MFU counts them: the recomputation is extra work the hardware
    does, not work the model needs); issued: as configured, the backward's recomputation included (``issued``
    False: not counted, the model FLOPs twice). ``low``: under bf16 autocast. The one FLOP counter: the plan's,
    and the profiler's (``slurmvla.profile.count_flops_per_sample``)."""
    return count_flops_of(cfg, [sample], low, issued)[0]


def count_flops_of(cfg: Config, samples: list[dict[str, Any]], low: bool = False,
                   issued: bool = True) -> list[tuple[float, float]]:
    """:func:`count_flops` of each of several samples on one meta copy of the policy (built once: at pi0.5's
    size the build costs about as much as a count)."""
    from torch.utils.flop_counter import FlopCounterMode

    from slurmvla.planner.model_states import shape_only
    from slurmvla.policy import build_policy

    with torch.device("meta"):
        policy = build_policy(shape_only(cfg.policy), stats=None)
    policy.train()
    configured = bool(policy.gradient_checkpointing)  # None: the policy has no switch
    result = []
    for sample in samples:
        one = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}
        counts = []
        for on in (False, True) if configured and issued else (False,):
            if policy.gradient_checkpointing is not None:
                policy.gradient_checkpointing = on
            counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping())
            with counter, CudaAutocast(torch.bfloat16) if low else _nothing():
                out = policy(dict(one))
                backward(out["loss"] if isinstance(out, dict) else out)
            counts.append(float(counter.get_total_flops()))
        if configured:
            policy.gradient_checkpointing = True
        result.append((counts[0], counts[-1]))
    return result


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` without passing through the torch-function modes: ``Tensor.backward`` is itself a
    torch function, and a mode that handles it is off while it runs, so the recomputation of checkpointed
    layers inside backward would run without :class:`CudaAutocast`. The autograd engine's own entry is no
    torch function."""
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:  # another torch: the recomputation runs without the autocast emulation
        loss.backward()
        return
    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


# -- analytic fallback ---------------------------------------------------------------------------------


def analytic_activations(cfg: Config, micro: int) -> int | None:
    """Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer models"), with a
    fused attention kernel (no attention matrix): 34 x tokens x width bytes per layer in 16 bit (x 2 in fp32);
    with checkpointing each layer keeps its input (2 x tokens x width) and one layer is recomputed whole.
    None for a policy whose config has no transformer shape (not a ``TransformerPolicyConfig``)."""
    p = cfg.policy
    if not isinstance(p, TransformerPolicyConfig):
        return None
    scale = 1 if cfg.precision == "bf16" else 2
    patches = p.num_cameras * p.num_obs_history * (p.image_size // p.patch_size) ** 2
    stacks = [(patches, p.vision_width, p.vision_depth), (patches + p.max_text_len + 1, p.width, p.depth),
              (p.action_horizon, p.expert_width, p.depth)]
    if p.gradient_checkpointing:
        per_sample = sum(2 * s * h * d for s, h, d in stacks) + max(34 * s * h for s, h, _ in stacks)
    else:
        per_sample = sum(34 * s * h * d for s, h, d in stacks)
    return scale * per_sample * micro



@dataclass
class Activations:
    """Bytes of one micro-batch's activations: ``fixed + per_sample x B``, and measured points."""

    fixed: float
    per_sample: float
    measured: dict[int, int]
    method: str  # "measured (meta tensors)", "measured under the compiled step's partitioner (...)" or "analytic ESTIMATE"
    model_flops_per_sample: float | None = None
    issued_flops_per_sample: float | None = None
    seconds: float = 0.0
    # The parameter dtypes of the fake runs: (trainable, frozen).
    compute: tuple[torch.dtype, torch.dtype] | None = None

    def at(self, micro: int) -> int:
        if micro in self.measured:
            return self.measured[micro]
        return int(self.fixed + self.per_sample * micro)

