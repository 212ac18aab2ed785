"""Where a served call's latency tail comes from: per-call stage times of :class:`PolicyRunner`, Python's
garbage collector, the CUDA caching allocator and the GPU's SM clock, and the slowest calls attributed to
what grew in them. ``benchmarks/sample_latency.py --jitter`` drives it; the report's logic (:func:`summary`,
:func:`slowest`, :func:`verdict`) is plain arithmetic on the records, tested on its own.

Stages (exclusive: time is charged to the innermost stage running; nothing of the runner is changed, its
methods are wrapped on the instance for the loop and restored after):

- ``preprocess``: ``runner.processor.read`` / ``runner.read_rtc`` / ``runner.processor.batch`` (image resize / pad, state checks, stacking,
  numpy -> tensor);
- ``prompt``: tokenization (the sample spec's tokenizer; pi0.5's prompt written from the state, ``_text``);
- ``h2d``: ``runner.act`` up to the sampler (the batch and the noise copied to the device, the noise drawn);
- ``launch``: the sampler's ``sample_actions`` (a graph's input copies and replay; eager: the whole forward);
- ``sync``: from the sampler's return to ``act``'s (the wait for the device, the actions copied back);
- ``post``: ``runner.processor.to_commands``; ``other``: the rest (the session's own code).

The instrumentation allocates no Python object the collector tracks per call (records go to preallocated
arrays), so it does not itself change how often the collector runs.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import gc
import math
import time

import numpy as np
import torch

STAGES = ("preprocess", "prompt", "h2d", "launch", "sync", "post", "other")
PRE, PROMPT, H2D, LAUNCH, SYNC, POST, OTHER = range(len(STAGES))
TARGET = 1.15  # p99 / p50 aimed at
_MISSING = object()


class StageClock:
    """Exclusive time per stage within one call: each transition charges the time since the last one to
    the stage on top of the stack."""

    def __init__(self):
        self.acc = [0.0] * len(STAGES)
        self.stack = [OTHER]
        self.last = 0.0
        self.active = False

    def begin(self) -> None:
        for i in range(len(self.acc)):
            self.acc[i] = 0.0
        del self.stack[1:]
        self.stack[0] = OTHER
        self.active = True
        self.last = time.perf_counter()

    def _charge(self) -> None:
        now = time.perf_counter()
        self.acc[self.stack[-1]] += now - self.last
        self.last = now

    def push(self, stage: int) -> None:
        self._charge()
        self.stack.append(stage)

    def pop(self) -> None:
        self._charge()
        if len(self.stack) > 1:
            self.stack.pop()

    def switch(self, stage: int) -> None:
        self._charge()
        self.stack[-1] = stage

    def end(self) -> None:
        self._charge()
        self.active = False


class GcWatch:
    """Python's collector passes (``gc.callbacks``) during the calls: per call, the passes' time and the
    oldest generation collected; passes between calls are counted apart."""

    def __init__(self, clock: StageClock):
        self.clock = clock
        self.t0 = 0.0
        self.gen = 0
        self.ms = 0.0
        self.top = -1
        self.count = 0
        self.outside = 0

    def reset(self) -> None:
        self.ms, self.top, self.count = 0.0, -1, 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            self.gen = info["generation"]
        elif not self.clock.active:
            self.outside += 1
        else:
            self.ms += (time.perf_counter() - self.t0) * 1000
            self.top = max(self.top, self.gen)
            self.count += 1

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class SmClock:
    """The GPU's SM clock (MHz) and its clock-event reasons (NVML's bitmask) now, through NVML (the driver's
    ``libnvidia-ml.so.1``, no Python package needed), else ``torch.cuda.clock_rate()`` (needs ``pynvml``),
    else nothing: :attr:`source` says which."""

    def __init__(self, device: torch.device):
        self.source, self.handle, self.why = None, None, ""
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                raise OSError("nvmlInit_v2 failed")
            props = torch.cuda.get_device_properties(device)
            bus = f"{props.pci_domain_id:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0".encode()
            handle = ctypes.c_void_p()
            if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(handle)) != 0:
                raise OSError(f"no NVML device at PCI {bus.decode()}")
            self.get_clock = lib.nvmlDeviceGetClockInfo
            # The same call under its newer name and its older one (both: device, unsigned long long *).
            self.get_reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) \
                or getattr(lib, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            self.handle, self.source = handle, "nvml"
            if self.read()[0] is None:
                raise OSError("nvmlDeviceGetClockInfo failed")
            return
        except Exception as e:  # noqa: BLE001 - optional: no driver library, an older one, no PCI ids
            self.handle, self.source, self.why = None, None, f"NVML: {e}"
        try:
            torch.cuda.clock_rate(device)
            self.source = "torch.cuda.clock_rate"
        except Exception as e:  # noqa: BLE001 - optional: pynvml missing, or no NVML
            self.why += f"; torch.cuda.clock_rate: {e}"

    def read(self) -> tuple[float | None, int]:
        """(SM MHz, clock-event reasons bitmask; -1 where unknown); (None, -1) where the read fails."""
        try:
            if self.source == "nvml":
                mhz, reasons = ctypes.c_uint(), ctypes.c_ulonglong()
                if self.get_clock(self.handle, 1, ctypes.byref(mhz)) != 0:  # 1: NVML_CLOCK_SM
                    return None, -1
                ok = self.get_reasons is not None and self.get_reasons(self.handle, ctypes.byref(reasons)) == 0
                return float(mhz.value), int(reasons.value) if ok else -1
            if self.source is not None:
                return float(torch.cuda.clock_rate()), -1
        except Exception:  # noqa: BLE001 - optional: a failed read is a missing figure, not a failed run
            pass
        return None, -1


@dataclasses.dataclass
class Records:
    """Per-call records of one timed loop (milliseconds; NaN / -1 where not measured)."""

    total: np.ndarray  # [n]
    stages: np.ndarray  # [n, len(STAGES)]
    gc_ms: np.ndarray  # [n] the collector's time during the call
    gc_gen: np.ndarray  # [n] oldest generation collected during the call, -1 none
    device_ms: np.ndarray  # [n] CUDA events around the sampler (the device's time for it)
    alloc_retries: np.ndarray  # [n] the caching allocator's num_alloc_retries added by the call
    reserved_mib: np.ndarray  # [n] its reserved memory's change over the call
    device_allocs: np.ndarray  # [n] cudaMalloc calls during the call (num_device_alloc), -1 unknown
    sm_mhz: np.ndarray  # [n] the SM clock read after the call
    clock_reasons: np.ndarray  # [n] NVML's clock-event reasons after the call, -1 unknown
    gc_outside: int = 0  # collector passes between calls

    @classmethod
    def empty(cls, n: int) -> Records:
        nan = lambda: np.full(n, np.nan)  # noqa: E731
        return cls(nan(), np.zeros((n, len(STAGES))), np.zeros(n), np.full(n, -1), nan(), np.zeros(n), np.zeros(n),
                   np.full(n, -1), nan(), np.full(n, -1))


def _wrap(fn, before, after):
    @functools.wraps(fn)  # keeps the signature: seeded_sample_actions reads whether it takes noise=
    def inner(*args, **kwargs):
        before()
        try:
            return fn(*args, **kwargs)
        finally:
            after()

    return inner


@contextlib.contextmanager
def patched(objects: list[tuple[object, str, object]]):
    """``setattr(obj, name, value)`` for each, undone on exit (an instance attribute removed again)."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in objects]
    try:
        for obj, name, value in objects:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


class Instrumented:
    """``runner``'s stages timed by ``clock`` while inside ``with``: its methods wrapped on the instance (and the
    sampler's ``sample_actions``, the policy's ``_text``, the spec's tokenizer), CUDA events around the sampler on
    a GPU. Behaviour is unchanged: each wrapper calls the original with the same arguments."""

    def __init__(self, runner, clock: StageClock, cuda: bool):
        self.runner, self.clock, self.cuda = runner, clock, cuda
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self.stack = contextlib.ExitStack()

    def _sampler_before(self) -> None:
        self.clock.push(LAUNCH)
        if self.events:
            self.events[0].record()

    def _sampler_after(self) -> None:
        if self.events:
            self.events[1].record()
        self.clock.pop()
        self.clock.switch(SYNC)  # back in act: what remains is the wait and the copy back

    def device_ms(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) if self.events else math.nan

    def __enter__(self) -> Instrumented:
        r, c = self.runner, self.clock
        p = r.processor
        push = lambda stage: lambda: c.push(stage)  # noqa: E731
        sampler, policy = r.sampler, r.policy
        patches = [(p, name, _wrap(getattr(p, name), push(PRE), c.pop)) for name in ("read", "batch")]
        patches += [(r, "read_rtc", _wrap(r.read_rtc, push(PRE), c.pop)),
                    (p, "to_commands", _wrap(p.to_commands, push(POST), c.pop)),
                    (r, "act", _wrap(r.act, push(H2D), c.pop)),
                    (sampler, "sample_actions", _wrap(sampler.sample_actions, self._sampler_before, self._sampler_after))]
        if callable(getattr(policy, "_text", None)):
            patches.append((policy, "_text", _wrap(policy._text, push(PROMPT), c.pop)))
        if p.spec.tokenizer is not None:  # the prompt's tokens are made by the processor, from its spec
            patches.append((p, "spec", dataclasses.replace(p.spec, tokenizer=_wrap(p.spec.tokenizer, push(PROMPT), c.pop))))
        self.stack.enter_context(patched(patches))
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


def _allocator(cuda: bool) -> tuple[float, float, float]:
    if not cuda:
        return 0.0, 0.0, -1.0
    s = torch.cuda.memory_stats()
    return float(s.get("num_alloc_retries", 0)), s.get("reserved_bytes.all.current", 0) / 2**20, \
        float(s.get("num_device_alloc", -1))


def measure(call, iters: int, clock: StageClock, cuda: bool, inst: Instrumented | None = None,
            sm: SmClock | None = None, warmup: int = 10, no_gc: bool = False) -> Records:
    """``iters`` timed calls of ``call()`` (after ``warmup`` untimed ones), each in ``clock``'s stages. ``no_gc``: the
    collector frozen (``gc.freeze()``) and disabled for the timed calls, enabled again after."""
    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize()
    rec = Records.empty(iters)
    gc.collect()
    with GcWatch(clock) as watch:
        if no_gc:
            gc.freeze()
            gc.disable()
        try:
            before = _allocator(cuda)
            for i in range(iters):
                watch.reset()
                clock.begin()
                call()
                clock.end()
                rec.stages[i] = clock.acc  # seconds, exclusive: they add up to the call's wall time
                rec.stages[i] *= 1000
                rec.total[i] = rec.stages[i].sum()
                rec.gc_ms[i], rec.gc_gen[i] = watch.ms, watch.top
                if inst is not None:
                    rec.device_ms[i] = inst.device_ms()
                after = _allocator(cuda)
                rec.alloc_retries[i] = after[0] - before[0]
                rec.reserved_mib[i] = after[1] - before[1]
                rec.device_allocs[i] = after[2] - before[2] if after[2] >= 0 else -1
                before = after
                if sm is not None and sm.source is not None:
                    rec.sm_mhz[i], rec.clock_reasons[i] = sm.read()
        finally:
            if no_gc:
                gc.enable()
                gc.unfreeze()
        rec.gc_outside = watch.outside
    return rec


# -- the report: arithmetic on the records ------------------------------------------------------------


def _pct(x: np.ndarray) -> dict:
    return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)), "max": float(np.max(x))}


def summary(rec: Records) -> dict:
    """p50 / p99 / max of the total and of each stage (ms), p99 / p50, the collector's passes."""
    out = {"calls": len(rec.total), "total": _pct(rec.total)}
    out["p99_over_p50"] = out["total"]["p99"] / out["total"]["p50"]
    out["stages"] = {name: _pct(rec.stages[:, i]) for i, name in enumerate(STAGES)}
    if not np.isnan(rec.device_ms).all():
        out["device"] = _pct(rec.device_ms)
    if not np.isnan(rec.sm_mhz).all():
        out["sm_mhz"] = {"min": float(np.nanmin(rec.sm_mhz)), "p50": float(np.nanmedian(rec.sm_mhz)),
                         "max": float(np.nanmax(rec.sm_mhz))}
    if (rec.clock_reasons >= 0).any():  # NVML's clock-event reasons (e.g. 0x1 idle, 0x4 power cap, 0x20/0x40 thermal)
        masks = collections.Counter(hex(int(m)) for m in rec.clock_reasons if m >= 0)
        out["clock_reasons"] = dict(masks.most_common())
    gcs = rec.gc_gen >= 0
    out["gc"] = {"calls_with_pass": int(gcs.sum()), "by_generation": {g: int((rec.gc_gen == g).sum()) for g in range(3)},
                 "ms_max": float(rec.gc_ms.max()), "passes_between_calls": rec.gc_outside}
    out["allocator"] = {"calls_with_retries": int((rec.alloc_retries > 0).sum()),
                        "calls_reserving": int((rec.reserved_mib != 0).sum()),
                        "calls_with_cudamalloc": int((rec.device_allocs > 0).sum())}
    return out


def slowest(rec: Records, share: float = 0.01) -> dict:
    """The slowest ``share`` of the calls (at least one): each call's stage that grew most over that stage's own
    median, how many of them had a collector pass, allocator activity, or an SM clock below its median."""
    n = max(1, math.ceil(share * len(rec.total)))
    idx = np.argsort(rec.total, kind="stable")[::-1][:n]
    med = np.median(rec.stages, axis=0)
    excess = rec.stages[idx] - med
    grew = collections.Counter(STAGES[int(j)] for j in np.argmax(excess, axis=1))
    out = {"calls": n, "index": [int(i) for i in idx],
           "excess_ms": float(np.mean(rec.total[idx] - np.median(rec.total))),
           "stage_grew": dict(grew.most_common()),
           "stage_excess_ms": {name: float(excess[:, i].mean()) for i, name in enumerate(STAGES)},
           "with_gc": int((rec.gc_gen[idx] >= 0).sum()),
           "gc_ms": float(rec.gc_ms[idx].mean()),
           "with_gc_gen2": int((rec.gc_gen[idx] == 2).sum()),
           "with_alloc_retry": int((rec.alloc_retries[idx] > 0).sum()),
           "with_reserve_change": int((rec.reserved_mib[idx] != 0).sum()),
           "with_cudamalloc": int((rec.device_allocs[idx] > 0).sum())}
    if not np.isnan(rec.device_ms).all():
        out["device_excess_ms"] = float(np.mean(rec.device_ms[idx] - np.nanmedian(rec.device_ms)))
    if not np.isnan(rec.sm_mhz).all():
        out["with_lower_clock"] = int((rec.sm_mhz[idx] < np.nanmedian(rec.sm_mhz)).sum())
    return out


def verdict(ratios: dict[str, float], target: float = TARGET) -> str:
    """Which cause holds the tail, from p99 / p50 of the variants (``full``, and where run ``nogc``: the collector
    off; ``act``: preprocessing done once; ``replay``: the sampler alone)."""
    full = ratios.get("full")
    if full is None:
        return "no full variant: nothing to compare"
    if full <= target:
        return f"p99/p50 {full:.2f} <= {target}: no tail to explain"
    for name, cause in (("nogc", "Python's garbage collector"), ("act", "the host preprocessing (read / batch)"),
                        ("replay", "the runner's per-call host work around the sampler (h2d / prompt / copy back)")):
        if name in ratios and ratios[name] <= target:
            return f"{cause}: p99/p50 {full:.2f} with it, {ratios[name]:.2f} without ({name})"
    if "replay" in ratios:
        return (f"the sampler itself: p99/p50 {ratios['replay']:.2f} replaying alone (read device ms and the SM clock "
                "of the slowest calls)")
    return f"not settled by the variants run ({sorted(ratios)})"


def table(name: str, rec: Records) -> str:
    """One variant's lines: the stages' p50 / p99 / max, and the slowest 1 %'s attribution."""
    s, w = summary(rec), slowest(rec)
    lines = [f"  {name}: {s['calls']} calls, total p50 {s['total']['p50']:.2f} p99 {s['total']['p99']:.2f} "
             f"max {s['total']['max']:.2f} ms, p99/p50 {s['p99_over_p50']:.2f}"]
    rows = [(n, s["stages"][n]) for n in STAGES] + ([("device", s["device"])] if "device" in s else [])
    lines += [f"    {n:>10}  p50 {v['p50']:8.3f}  p99 {v['p99']:8.3f}  max {v['max']:8.3f}" for n, v in rows]
    gcs = s["gc"]
    lines.append(f"    gc: passes in {gcs['calls_with_pass']} calls (by generation {gcs['by_generation']}), longest "
                 f"{gcs['ms_max']:.2f} ms, {gcs['passes_between_calls']} between calls; allocator: retries in "
                 f"{s['allocator']['calls_with_retries']}, reserved changed in {s['allocator']['calls_reserving']}, "
                 f"cudaMalloc in {s['allocator']['calls_with_cudamalloc']} calls"
                 + (f"; SM clock {s['sm_mhz']['min']:.0f}-{s['sm_mhz']['max']:.0f} MHz" if "sm_mhz" in s else "")
                 + (f" (clock-event reasons, calls: {s['clock_reasons']})" if "clock_reasons" in s else ""))
    grew = ", ".join(f"{k} {v}" for k, v in w["stage_grew"].items())
    lines.append(f"    slowest {w['calls']}: +{w['excess_ms']:.2f} ms over the median; stage that grew: {grew}; with a gc "
                 f"pass {w['with_gc']} (gen 2: {w['with_gc_gen2']}, mean {w['gc_ms']:.2f} ms); allocator retry "
                 f"{w['with_alloc_retry']}, cudaMalloc {w['with_cudamalloc']}"
                 + (f"; device +{w['device_excess_ms']:.2f} ms" if "device_excess_ms" in w else "")
                 + (f"; SM clock below median {w['with_lower_clock']}" if "with_lower_clock" in w else ""))
    return "\n".join(lines)
