"""A source and overrides -> a policy ready to answer requests (:func:`build_runner`) and the server in front
of it (:func:`build_server`): what ``python -m slurmvla.serve`` and ``python -m slurmvla.rollout`` start."""

from __future__ import annotations

import logging

import torch

from slurmvla.inference.auth import check_exposure, read_api_key
from slurmvla.inference.fp8 import check_fp8, quantize_prefix
from slurmvla.inference.graphs import inference_sampler
from slurmvla.inference.load import Loaded, load_exported
from slurmvla.inference.optimize import lower_weights
from slurmvla.inference.runner import PolicyRunner
from slurmvla.inference.server import PolicyServer
from slurmvla.units import MiB

log = logging.getLogger("slurmvla.serve")


def build_runner(source: str, overrides: list[str], device: str | None = None) -> PolicyRunner:
    """Load ``source`` (see :func:`slurmvla.inference.load.load_exported`) onto ``serve.device`` (or
    ``device``), its weights in the dtype it runs in, its projections fused, compiled or captured as
    ``serve.*`` asks, and map its inputs."""
    return _runner(load_exported(source, overrides, device="cpu"), device)


def _runner(loaded: Loaded, device: str | None) -> PolicyRunner:
    want = device or loaded.cfg.serve.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        loaded.policy.to(torch.device(want))
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"serve.device={want!r} cannot be used here ({e}); choose auto, cpu or cuda") from None
    cfg = loaded.cfg
    if cfg.precision == "bf16" and torch.device(want).type == "cuda":
        # The weights in bf16, as training's forward holds them (under autocast): no cast of every weight
        # at every request.
        lower_weights(loaded.policy, torch.bfloat16)
    if cfg.serve.fp8_prefix:  # before the projections are fused: a quantized one stays unfused
        check_fp8(loaded.policy, torch.device(want))
        quantize_prefix(loaded.policy)
    sampler = inference_sampler(loaded.policy, cfg.serve.cuda_graph, cfg.serve.compile, "serve.cuda_graph=true",
                                fused=cfg.serve.fused_projections)
    return PolicyRunner(loaded, sampler)


def build_server(source: str, overrides: list[str], device: str | None = None,
                 environ: dict[str, str] | None = None) -> PolicyServer[PolicyRunner]:
    """:func:`build_runner`'s policy behind a :class:`PolicyServer` on ``serve.host:serve.port``, with the API
    key :func:`slurmvla.inference.auth.read_api_key` finds (in ``environ``, default ``os.environ``). A host
    beyond this machine without a key is refused (:func:`slurmvla.inference.auth.check_exposure`) before the
    policy moves to its device."""
    loaded = load_exported(source, overrides, device="cpu")
    serve = loaded.cfg.serve
    api_key = read_api_key(serve, environ)
    check_exposure(serve.host, api_key, serve.allow_unauthenticated, serve.api_key_env)
    runner = _runner(loaded, device)
    if serve.max_request_mb is not None and runner.max_request_bytes < runner.observation_bytes():
        log.warning("serve.max_request_mb=%s is below one observation at the policy's image size (%.2f MiB): "
                    "requests will be refused", serve.max_request_mb, runner.observation_bytes() / MiB)
    return PolicyServer(runner, serve.host, serve.port, api_key=api_key, api_key_env=serve.api_key_env,
                        allow_unauthenticated=serve.allow_unauthenticated, max_connections=serve.max_connections,
                        max_pending=serve.max_pending)
