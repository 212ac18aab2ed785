"""``serve.fp8_prefix``: the matrix products of a policy's prefix in float8, through torchao.

The prefix is what a request computes once before its denoising steps (``policy.prefix_modules()``; pi0 / pi0.5:
the vision tower, its projector and the language backbone's half of every layer). Each of its ``nn.Linear`` weights is quantized
once to float8 (e4m3) with a scale per output row, and at every call its input is quantized likewise, per row
(torchao's ``Float8DynamicActivationFloat8WeightConfig`` with ``PerRow`` granularity): the products run on the GPU's
FP8 matrix units. The denoising steps (the action expert, its products 50 rows tall at batch 1, bound by memory)
stay in bf16, and so does everything that is not a linear layer (attention, norms, the patch embedding).

Needs a GPU with FP8 matrix units (compute capability 8.9 or above: L40S, RTX 4090, H100, H200), the weights in
bf16 (``precision=bf16``) and torchao (``pip install -e '.[fp8]'``). Apply it after the weights are lowered and
before projections are fused (a quantized projection stays unfused:
:func:`slurmvla.inference.optimize.fuse_linears`), compiled or captured.

The actions differ from bf16's by the rounding of an 8-bit float (3 mantissa bits) in every prefix product:
``tests/inference/test_fp8.py`` holds them to a bound on 102 observations, on the CPU (torch's own float8 matrix product;
torchao refuses a CPU, so that test lifts its check), and ``benchmarks/fp8_prefix.py`` measures the same at the
published size on a GPU.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

OPTION = "serve.fp8_prefix=true"
# The compute capability of the first GPUs with FP8 matrix units (Ada Lovelace; Hopper is 9.0).
MIN_CAPABILITY = (8, 9)


def check_fp8(policy: nn.Module, device: torch.device) -> None:
    """A ValueError naming ``serve.fp8_prefix`` when the FP8 prefix cannot run here."""
    if policy.prefix_modules is None:
        raise ValueError(f"{OPTION} needs a policy with prefix_modules() (the modules a request runs once before "
                         f"denoising; pi0 and pi0.5 have it); {type(policy).__qualname__} has none: leave it off")
    if device.type != "cuda":
        raise ValueError(f"{OPTION} needs a GPU with FP8 matrix units (compute capability >= 8.9: L40S, RTX 4090, "
                         f"H100, H200); the policy is on {device}: leave it off")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"{OPTION} needs compute capability >= 8.9 (FP8 matrix units); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: leave it off")
    weights = {p.dtype for m in policy.prefix_modules() for p in m.parameters() if p.is_floating_point()}
    if weights != {torch.bfloat16}:
        raise ValueError(f"{OPTION} quantizes bf16 weights, but the prefix's are {sorted(map(str, weights))}; "
                         "serve with precision=bf16")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError(f"{OPTION} needs torchao: pip install -e '.[fp8]'") from None


def quantize_prefix(policy: nn.Module) -> int:
    """Every ``nn.Linear`` of ``policy.prefix_modules()`` in float8 (see the module docstring), but those torchao
    leaves in bf16: a dimension not a multiple of 16, which FP8 matrix units cannot tile (none at pi0 / pi0.5's
    published sizes). Returns how many were quantized. Call :func:`check_fp8` first."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    linears = [m for module in policy.prefix_modules() for m in module.modules() if type(m) is nn.Linear]
    ids = {id(m) for m in linears}
    for module in policy.prefix_modules():
        quantize_(module, config, filter_fn=lambda m, _name: id(m) in ids)
    count = sum(type(m.weight) is not nn.Parameter for m in linears)
    log.info("%s: %d of the prefix's %d linear layers in float8 (per-row scales)", OPTION, count, len(linears))
    return count
