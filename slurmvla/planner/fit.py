"""One configuration on a world of GPUs: the model states by the engine's rule, the activations measured, the
peak per GPU against the budget, the largest micro-batch that fits, and the time estimate; every figure in
one dict (what ``--json`` writes and :mod:`slurmvla.planner.report` prints)."""

from __future__ import annotations

import time
from typing import Any

import torch

from slurmvla.config import Config
from slurmvla.planner import PlanError
from slurmvla.planner.activations import Activations, Pass, ShapeStep, analytic_activations, failure
from slurmvla.planner.gpus import DEFAULT_MARGIN, DEFAULT_UTILIZATION, GPU, RESERVED_BYTES
from slurmvla.planner.model_states import build_on_meta, count_tensors, model_states
from slurmvla.planner.step_time import time_estimate
from slurmvla.registry import ENGINES

# The forward + backward phase's row for gradients that are not resident (``States.gradients_resident``).
GRADIENTS_IN_PASS = "gradients not held yet (those the backward has made are in the activations)"


class Planner:
    """One configuration's policy, counted and measured once; plans for any engine of it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.policy = build_on_meta(cfg)
        self.tensors = count_tensors(cfg, self.policy)
        # The passes' policies: on the meta device (True) and on fake CPU tensors (False: the compiled layers,
        # and a policy the meta device cannot run); built at their first pass.
        self._steps: dict[bool, ShapeStep] = {}
        self._meta_error: str | None = None  # why the meta device could not run the policy (fake tensors then)
        self._fake_error: str | None = None
        self._compile_error: str | None = None  # why the layers could not be measured as compiled
        self._cache: dict[tuple, Pass] = {}
        self._flops: tuple[float, float] | None = None

    def _step(self, on_meta: bool = True) -> ShapeStep | None:
        """The step on the meta device (``on_meta``, unless it failed there: the fake one then), or on fake CPU
        tensors; None where the policy cannot be built on them."""
        on_meta = on_meta and self._meta_error is None
        if on_meta not in self._steps and self._fake_error is None:
            # The planner's own policy goes to the first step; a later one builds its own.
            policy = self.policy if not self._steps else build_on_meta(self.cfg)
            try:
                self._steps[on_meta] = ShapeStep(self.cfg, policy, fake=not on_meta)
            except Exception as e:  # a policy that cannot live on tensors without data
                if on_meta:
                    self._meta_error = failure(e)
                    return self._step(False)
                self._fake_error = failure(e)
        return self._steps.get(on_meta)

    def compiled(self, cfg: Config) -> bool:
        """Whether the activations are measured with the layers as the compiled step runs them: with
        ``trainer.compile``, unless tracing them failed (then eager autograd's, and the method says why)."""
        return bool(cfg.trainer.compile) and self._compile_error is None

    def measure(self, cfg: Config, micro: int, compute: tuple[torch.dtype, torch.dtype],
                cast_inputs: bool = False, resident_grads: bool = True) -> Pass | None:
        """The peak live bytes of one training forward + backward at ``micro`` (cached); ``resident_grads``
        False: with the gradients its backward makes (``States.gradients_resident``)."""
        compiled = self.compiled(cfg)
        key = (micro, compute, cfg.precision, cast_inputs, compiled, resident_grads)
        if key not in self._cache:
            on_meta = not compiled and self._meta_error is None
            step = self._step(on_meta)
            if step is None:
                return None
            try:
                self._cache[key] = step.run(micro, compute, cfg.precision == "bf16", cast_inputs=cast_inputs,
                                            compiled=compiled, resident_grads=resident_grads)
            except Exception as e:
                if compiled:  # the layers would not trace: eager autograd's figure, labelled so
                    self._compile_error = failure(e)
                elif on_meta:  # the meta device cannot run it: on fake tensors
                    self._meta_error = failure(e)
                else:
                    self._fake_error = failure(e)
                    return None
                return self.measure(cfg, micro, compute, cast_inputs, resident_grads)
        return self._cache[key]

    def flops(self, cfg: Config, compute: tuple[torch.dtype, torch.dtype]) -> tuple[float, float] | None:
        """(model FLOPs, issued FLOPs) of one sample's forward + backward: counted in a pass of their own
        without gradient checkpointing; with it, in one more pass as configured, whose backward counts what
        it recomputes (every checkpointed layer's forward, less what ``policy.checkpoint_saves`` keeps). The
        passes run on the meta device; a policy that runs on fake tensors but not there is counted on them."""
        if self._flops is None and self._step() is not None:
            low = cfg.precision == "bf16"
            try:
                self._flops = self._step().flops_on_meta(low)
                return self._flops
            except Exception:  # noqa: BLE001 - a policy the meta device cannot run: the fake-tensor passes
                pass
            fake = self._step(False)
            try:
                got = fake.run(1, compute, low, count_flops=True, checkpointing=False)
                issued = got.flops
                if fake.policy.gradient_checkpointing:
                    issued = fake.run(1, compute, low, count_flops=True).flops
            except Exception as e:
                self._fake_error = failure(e)
                return None
            self._flops = (got.flops, issued)
        return self._flops

    def _points(self, cfg: Config, sizes: tuple[int, int], compute: tuple[torch.dtype, torch.dtype],
                cast_inputs: bool, resident_grads: bool) -> dict[int, int] | None:
        """The peaks at ``sizes``, both measured the same way (eager again where the compiled layers would not
        trace at one of them); None where the fake tensors fail."""
        compiled = self.compiled(cfg)
        points = {}
        for b in sizes:
            got = self.measure(cfg, b, compute, cast_inputs, resident_grads)
            if got is None:
                return None
            points[b] = got.peak_bytes
        return points if compiled == self.compiled(cfg) else self._points(cfg, sizes, compute, cast_inputs,
                                                                          resident_grads)

    def activations(self, cfg: Config, micro: int, compute: tuple[torch.dtype, torch.dtype],
                    cast_inputs: bool = False, count_flops: bool = True, at_micro_only: bool = False,
                    resident_grads: bool = True) -> Activations:
        """Measured at two micro-batches: 1 and 2, or 2 and the configured one when it is larger (a fixed
        part, e.g. a large embedding's gradient, dominates the smallest sizes); a straight line through them.
        ``resident_grads`` False: the figures include the gradients made by the backward up to its peak.
        ``count_flops`` False: memory only (no FLOP-counting passes). ``at_micro_only``: one pass, at ``micro``
        (exact there; the line through zero elsewhere, so no other size is to be read from it)."""
        t0 = time.perf_counter()
        if self.tensors.frozen == 0:  # nothing frozen: one arrangement serves every engine
            compute = (compute[0], compute[0])
        sizes = (micro,) if at_micro_only else (2, micro) if micro > 2 else (1, 2)
        points = self._points(cfg, sizes, compute, cast_inputs, resident_grads)
        if points is not None:
            (b1, m1), (b2, m2) = sorted(points.items()) if len(points) == 2 else ((0, 0), *points.items())
            per_sample = (m2 - m1) / (b2 - b1)
            fixed = m1 - per_sample * b1
            model, issued = (self.flops(cfg, compute) if count_flops else None) or (None, None)
            if self.compiled(cfg):
                method = ("measured under the compiled step's partitioner (fake tensors; trainer.compile: the "
                          "layers traced by AOTAutograd and split by inductor's min-cut partitioner)")
            elif cfg.trainer.compile:
                method = (f"measured in eager autograd ({'meta' if self._meta_error is None else 'fake'} tensors; the "
                          f"compiled layers could not be traced: {self._compile_error}; compiled training saves less)")
            elif self._meta_error is None:
                method = "measured (meta tensors)"
            else:
                method = f"measured (fake tensors; the meta device could not run the policy: {self._meta_error})"
            return Activations(fixed, per_sample, points, method, model, issued, time.perf_counter() - t0, compute)
        per = analytic_activations(cfg, 1)
        if per is None:
            return Activations(0.0, 0.0, {}, f"NOT ESTIMATED (meta and fake tensors failed: {self._fake_error})")
        return Activations(0.0, float(per), {}, f"analytic ESTIMATE (meta and fake tensors failed: {self._fake_error})")


# The planners of the last few policies planned, newest last: the engines of ``--compare``, or the recomputation
# settings that policy.gradient_checkpointing=auto weighs (slurmvla.planner.recompute_choice) on each of them.
_LAST: dict[str, Planner] = {}
_KEEP = 8


def planner_for(cfg: Config) -> Planner:
    """The planner of this configuration's policy, reused when a recent call planned the same one (the
    engines of ``--compare``, the settings ``auto`` weighs, or several plans in one process)."""
    from omegaconf import OmegaConf

    key = f"{OmegaConf.to_yaml(OmegaConf.structured(cfg.policy))}|{cfg.data.mode}|{cfg.optim}"
    planner = _LAST.pop(key, None) or Planner(cfg)
    _LAST[key] = planner
    while len(_LAST) > _KEEP:
        _LAST.pop(next(iter(_LAST)))
    return planner


def plan_engine(planner: Planner, cfg: Config, gpu: GPU, nodes: int, gpus_per_node: int,
                margin: float = DEFAULT_MARGIN, utilization: float = DEFAULT_UTILIZATION,
                estimate_time: bool = True, peak_only: bool = False) -> dict[str, Any]:
    """Every figure of one configuration on ``nodes x gpus_per_node`` GPUs (a PlanError when the
    configuration cannot run there). ``estimate_time`` False: the memory figures only. ``peak_only``: only
    whether the configured micro-batch fits (its peak, one measured pass instead of two, no time estimate):
    ``largest_micro_batch`` and ``to_fit`` are then None."""
    world = nodes * gpus_per_node
    entry = ENGINES.get(cfg.engine.name)
    if not entry.multi_process and world > 1:
        raise PlanError(f"engine={entry.name} runs one process, but {nodes} x {gpus_per_node} GPUs is a world of "
                        f"{world}; choose one of {list(ENGINES.names(multi_process=True))}")
    micro = cfg.trainer.micro_batch_size(world)
    accum = cfg.trainer.grad_accum_steps
    t = planner.tensors
    states = model_states(cfg, t, world, gpus_per_node)
    # With accumulation the first micro-batch's gradients are held through the later ones' forward.
    resident = states.gradients_resident or accum > 1
    estimate_time = estimate_time and not peak_only
    budget = int((gpu.memory_bytes - RESERVED_BYTES) * (1 - margin))
    if states.held_bytes + max(0, sum(states.step.values()), sum(states.end_of_backward.values())) > budget:
        # Every step reaches its optimizer step: no micro-batch fits, whatever the activations (no pass measures them).
        acts = Activations(0.0, 0.0, {}, "NOT MEASURED (the model states and the optimizer step alone exceed the "
                                         "budget, so no micro-batch fits)")
        estimate_time = False
    else:
        acts = planner.activations(cfg, micro, states.compute, states.cast_inputs, count_flops=estimate_time,
                                   at_micro_only=peak_only, resident_grads=resident)
    forward_backward = dict(states.forward_backward)
    if not resident:
        # Made by the backward, the gradients are in the measured pass's peak (those made by then), not beside it:
        # the model states hold them from the end of backward through the step.
        forward_backward[GRADIENTS_IN_PASS] = -states.held["gradients"]
    beside_pass = sum(forward_backward.values())

    def peak_at(b: int) -> tuple[int, str]:
        phases = {"forward + backward": acts.at(b) + beside_pass,
                  "optimizer step": sum(states.step.values()),
                  "end of backward": sum(states.end_of_backward.values())}
        phase = max(phases, key=phases.get)
        return states.held_bytes + phases[phase], phase

    peak, phase = peak_at(micro)
    fits = peak <= budget
    # The largest micro-batch under the budget, from the linear activation model (an estimate beyond the
    # measured sizes).
    largest: int | None = None if peak_only else 0
    if acts.per_sample > 0 and not peak_only:
        room = budget - states.held_bytes - beside_pass - acts.fixed
        largest = max(0, int(room // acts.per_sample))
        if max(sum(states.step.values()), sum(states.end_of_backward.values())) + states.held_bytes > budget:
            largest = 0
        while largest > 0 and peak_at(largest)[0] > budget:
            largest -= 1
    global_batch = cfg.trainer.global_batch_size
    suggestion = None
    if largest:
        for a in range(1, global_batch // world + 1):
            if global_batch % (world * a) == 0 and global_batch // (world * a) <= largest:
                suggestion = {"grad_accum_steps": a, "micro_batch_size": global_batch // (world * a)}
                break
    result: dict[str, Any] = {
        "engine": cfg.engine.name, "precision": cfg.precision, "policy": cfg.policy.size,
        "world_size": world, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu.name,
        "global_batch_size": global_batch, "micro_batch_size": micro, "grad_accum_steps": accum,
        "gradient_checkpointing": bool(cfg.policy.gradient_checkpointing),
        "checkpoint_saves": cfg.policy.checkpoint_saves,
        "checkpoint_every": cfg.policy.checkpoint_every,
        "lora": cfg.policy.lora.enabled,
        "parameters": {"total": t.trainable + t.frozen, "trainable": t.trainable, "frozen": t.frozen,
                       "trainable_tensors": t.trainable_tensors, "adapters": t.adapters,
                       "wrap_units": len(t.units), "largest_unit": max(t.units)[0] if t.units else 0,
                       "root": t.root[0]},
        "held_bytes": dict(states.held),
        "forward_backward_bytes": forward_backward,
        "step_bytes": dict(states.step),
        "end_of_backward_bytes": dict(states.end_of_backward),
        "activations": {"method": acts.method, "bytes_at_micro_batch": acts.at(micro),
                        "fixed_bytes": acts.fixed, "per_sample_bytes": acts.per_sample,
                        "measured_bytes": {str(k): v for k, v in acts.measured.items()},
                        "compute_dtypes": [str(d).removeprefix("torch.") for d in (acts.compute or states.compute)]},
        "peak_bytes": peak, "peak_phase": phase,
        "gpu_memory_bytes": gpu.memory_bytes, "reserved_bytes": RESERVED_BYTES, "margin": margin,
        "budget_bytes": budget, "fits": fits, "largest_micro_batch": largest, "to_fit": suggestion,
        "notes": list(states.notes),
    }
    if estimate_time and acts.model_flops_per_sample:
        result["time_estimate"] = time_estimate(acts.model_flops_per_sample, acts.issued_flops_per_sample, gpu,
                                                cfg.precision, global_batch, world, utilization)
    return result


def compare_engines(world: int) -> list[str]:
    """The engines that can run on ``world`` ranks (a one-process engine only at world 1)."""
    return [name for name in ENGINES if world == 1 or ENGINES.get(name).multi_process]
