"""``sample_actions`` replayed from CUDA graphs: the whole inference (vision, prefix, every denoising
step) launched as one graph, so a batch of one costs the GPU's time rather than thousands of kernel
launches from Python.

A policy takes part when it has ``prepare_inference(batch)``, the host's part of ``sample_actions``
done before the model runs (for pi0 / pi0.5: writing and tokenizing the prompt, cutting it to a
multiple of 32 tokens); on the batch it returns, ``sample_actions`` must never wait on the device.
One graph is captured per set of input shapes (batch size, cameras, frame size, prompt length: a
few per server), on first use, after warm-up runs; each call then copies its inputs into that
graph's static tensors and replays it. With ``compile=True`` the policy's repeated layers
(``wrap_units()``) are compiled first (``torch.compile``, regional: one compilation serves every
layer of a kind), and the graph holds the compiled kernels: fewer, fused launches.

The actions are those of ``policy.sample_actions`` on the same inputs, to the precision of the
kernels chosen (tests/test_gpu.py compares them); the noise is an input like the observation, drawn by
the caller (:func:`slurmvla.policy.base.seeded_sample_actions`). :func:`inference_sampler` is what the
server and the evaluator call ``sample_actions`` on.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch
from torch import nn

from slurmvla.inference.optimize import fuse_projections
from slurmvla.policy.compiled_layers import compile_units

log = logging.getLogger(__name__)
# Graphs kept at once (each holds its activations' memory); the least recently used goes first.
MAX_GRAPHS = 8
# A real-time chunking request's tensors among a graph's static inputs (slurmvla.policy.rtc.Guidance's).
RTC_FIELDS = ("rtc.prev_actions", "rtc.delay", "rtc.overlap")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    noise: torch.Tensor
    out: torch.Tensor


def check_graphable(policy: nn.Module, device: torch.device, what: str) -> None:
    """A ValueError naming ``what`` (the option that asked) when graphs cannot serve this policy here."""
    if device.type != "cuda":
        raise ValueError(f"{what} replays CUDA graphs and needs the policy on a GPU (it is on {device}); "
                         f"leave {what} off, or run on a GPU")
    if policy.prepare_inference is None:
        raise ValueError(f"{what} needs a policy with prepare_inference(batch) (the host's part of sample_actions, "
                         f"after which it never waits on the device; pi0 and pi0.5 have it); "
                         f"{type(policy).__qualname__} has none: leave {what} off")


def inference_sampler(policy: nn.Module, cuda_graph: bool, compile: bool, option: str = "cuda_graph",
                      fused: bool = True):
    """What the server or the evaluator calls ``sample_actions`` on: the policy itself (its layers compiled
    with ``compile``), or a :class:`GraphedSampler` with ``cuda_graph`` (``option``: that switch's name
    as the user wrote it, for errors); its projections fused first with ``fused``
    (:func:`slurmvla.inference.optimize.fuse_projections`)."""
    if fused:
        fuse_projections(policy)  # changes no output: a request refused below loses nothing
    if cuda_graph:
        return GraphedSampler(policy, compile=compile, what=option)
    if compile:
        compile_units(policy)
    return policy


class GraphedSampler:
    """``sample_actions(batch, noise=)`` of ``policy`` through CUDA graphs (see the module docstring)."""

    def __init__(self, policy: nn.Module, compile: bool = False, warmup: int = 2, what: str = "cuda_graph"):
        device = next(policy.parameters()).device
        check_graphable(policy, device, what)
        self.policy, self.warmup = policy, warmup
        self.supports_rtc = policy.supports_rtc is True
        self.graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        self.eager: set[tuple] = set()  # RTC input shapes whose capture failed: they run eagerly
        if compile:
            compile_units(policy)

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: torch.Tensor, rtc=None) -> torch.Tensor:
        """The policy's ``sample_actions(batch, noise=, rtc=)`` from the graph of these input shapes. A real-time
        chunking request (``rtc``, a :class:`slurmvla.policy.rtc.Guidance`) has graphs of its own: its previous
        chunk, delay and overlap are static tensors like the observation, so any delay replays the same graph
        (a clean prefix, or guidance differentiating through each flow step inside the graph). Should a
        capture of it fail, that shape's RTC requests run eagerly, with one warning."""
        batch = self.policy.prepare_inference(batch)
        loose = sorted(k for k, v in batch.items() if not torch.is_tensor(v))
        if loose:
            raise ValueError(f"{type(self.policy).__qualname__}.prepare_inference left non-tensor fields {loose} in the "
                             "batch; a CUDA graph's inputs are tensors")
        inputs = dict(batch)
        settings = None
        if rtc is not None:
            inputs.update({RTC_FIELDS[0]: rtc.prev_actions, RTC_FIELDS[1]: rtc.delay, RTC_FIELDS[2]: rtc.overlap})
            settings = rtc.settings()
        key = (tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in inputs.items())), tuple(noise.shape),
               torch.is_autocast_enabled("cuda"), settings)
        if key in self.eager:
            return self.policy.sample_actions(batch, noise=noise, rtc=rtc)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, inputs, noise, settings)
            except Exception as e:  # noqa: BLE001 - an RTC graph is an optimisation; plain graphs raise
                if rtc is None:
                    raise
                log.warning("real-time chunking requests of these shapes run eagerly: capturing their graph failed "
                            "(%s)", e)
                self.eager.add(key)
                return self.policy.sample_actions(batch, noise=noise, rtc=rtc)
        self.graphs.move_to_end(key)
        for name, value in inputs.items():
            entry.inputs[name].copy_(value, non_blocking=True)
        entry.noise.copy_(noise, non_blocking=True)
        entry.graph.replay()
        return entry.out.clone()

    def _run(self, inputs: dict, noise: torch.Tensor, settings: tuple | None) -> torch.Tensor:
        """``sample_actions`` on the static tensors (the RTC request rebuilt from its own)."""
        if settings is None:
            return self.policy.sample_actions(inputs, noise=noise)
        from slurmvla.policy.rtc import Guidance

        batch = {k: v for k, v in inputs.items() if k not in RTC_FIELDS}
        rtc = Guidance(*(inputs[k] for k in RTC_FIELDS), *settings)
        return self.policy.sample_actions(batch, noise=noise, rtc=rtc)

    def _capture(self, key: tuple, batch: dict, noise: torch.Tensor, settings: tuple | None = None) -> _Graph:
        device = next(self.policy.parameters()).device
        inputs = {k: v.to(device, copy=True) for k, v in batch.items()}
        static_noise = noise.to(device, copy=True)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (and compilation) outside the capture, as CUDA graphs require
            for _ in range(self.warmup):
                self._run(inputs, static_noise, settings)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(inputs, static_noise, settings)
        while len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        log.info("captured a CUDA graph of sample_actions for inputs %s", {k: tuple(v.shape) for k, v in inputs.items()})
        self.graphs[key] = entry = _Graph(graph, inputs, static_noise, out)
        return entry
