"""Regional ``torch.compile`` of a policy's repeated layers, shared by training (``trainer.compile``) and
inference (:mod:`slurmvla.inference.graphs`: ``serve.compile``, ``evaluate --compile``)."""

from __future__ import annotations

import torch
from torch import nn

RECOMPILE_LIMIT = 64


def compile_units(policy: nn.Module, dynamic: bool | None = False) -> None:
    """``torch.compile`` each of the policy's repeated layers in place (regional compilation: layers of
    one kind share their compiled code, so the cost is one compilation per kind, not per layer).
    ``dynamic=False`` (inference, captured per shape anyway): one compilation per input shape and call
    path; ``None`` (training, whose prompt length changes from batch to batch): the length becomes
    symbolic at its first change, one more compilation, none after."""
    # Inference compiles once per input shape (batch size, prompt bucket) and call path (the first
    # denoising step, the cached ones, the last layer); torch's default limit (8) would fall back to
    # eager after a few prompt lengths.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for unit in policy.wrap_units():
        unit.compile(dynamic=dynamic)
