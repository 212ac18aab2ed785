"""serve.fp8_prefix (slurmvla/inference/fp8.py): pi0.5's prefix in float8 through torchao, against the same policy
in bf16, on 102 observations.

torchao quantizes only where a GPU has FP8 matrix units, so on the CPU this lifts torchao's hardware check: the
products then run through torch's own CPU float8 matrix product (``torch._scaled_mm``), with the same per-row
quantization of weights and inputs. tests/test_gpu.py runs the option as the server does on a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from slurmvla.inference.fp8 import check_fp8, quantize_prefix
from slurmvla.inference.optimize import fuse_projections, lower_weights
from tests.policy.test_pi0 import B, batch_for, perturbed_policy

# Observations: 34 batches of B = 3.
BATCHES = 34


# scripts/test.sh installs torchao here, beside the environment (transformers imports it in every process wherever
# it is installed).
TORCHAO = Path(__file__).resolve().parents[2] / ".test-deps" / "torchao"


@pytest.fixture
def fp8_on_the_cpu(monkeypatch):
    if importlib.util.find_spec("torchao") is None:
        if not (TORCHAO / "torchao").is_dir():
            pytest.skip(f"torchao is not installed (bash scripts/test.sh puts it in {TORCHAO})")
        monkeypatch.syspath_prepend(str(TORCHAO))
    import torchao.quantization.quant_api as quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda *args, **kwargs: None)


def prefix_linears(policy: nn.Module) -> list[nn.Linear]:
    return [m for part in policy.prefix_modules() for m in part.modules() if type(m) is nn.Linear]


def test_the_prefix_in_float8_keeps_the_actions_within_a_hundredth_of_bf16s(fp8_on_the_cpu):
    """Every linear layer of the prefix (vision tower, projector, backbone halves) and nothing else is quantized;
    the expert's projections still fuse, the prefix's quantized ones do not. The prefix's output moves by
    float8's rounding (~2 % relative: e4m3 keeps 3 mantissa bits), and the actions by at most 1 % of their
    spread (measured: 1.6e-3 at most, 1.6e-4 on average, against a spread of 1.02; bf16 against fp32 differ by
    up to 3.9e-3), and they do move: the float8 products ran."""
    cfg, reference = perturbed_policy("pi05_tiny")
    _, quantized = perturbed_policy("pi05_tiny")
    for policy in (reference, quantized):
        lower_weights(policy, torch.bfloat16)
    linears = prefix_linears(quantized)
    # What FP8 matrix units can tile: both dimensions multiples of 16 (pi05_tiny's 8-row key / value projections
    # are not, and stay bf16; at the published size every one is).
    tileable = [m for m in linears if m.in_features % 16 == 0 and m.out_features % 16 == 0]
    assert 0 < len(tileable) < len(linears)
    assert quantize_prefix(quantized) == len(tileable)
    assert all((type(m.weight).__name__ == "Float8Tensor") == (m in tileable) for m in linears)
    prefix = {id(m) for m in linears}
    rest = [m for m in quantized.modules() if type(m) is nn.Linear and id(m) not in prefix]
    assert rest and all(type(m.weight) is nn.Parameter and m.weight.dtype == torch.bfloat16 for m in rest)
    # The expert's q / k / v and gate / up groups fuse (one each per layer), and of the backbone's only the last
    # layer's key / value pair (no query there; both left bf16 here): a quantized projection stays unfused.
    assert fuse_projections(quantized) == 2 * cfg.depth + 1
    assert fuse_projections(reference) == 2 * cfg.depth * 2 - 1

    diffs, actions = [], []
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        for i in range(BATCHES):
            batch = batch_for(cfg, seed=i)
            if i == 0:
                a, b = reference._prefix(batch)[0].float(), quantized._prefix(batch)[0].float()
                moved = float((a - b).norm() / a.norm())
                assert 1e-3 < moved < 5e-2, moved
            noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim, generator=torch.Generator().manual_seed(i))
            want = reference.sample_actions(batch, noise=noise).float()
            got = quantized.sample_actions(batch, noise=noise).float()
            diffs.append((got - want).abs())
            actions.append(want)
    diff, spread = torch.cat(diffs), torch.cat(actions).std()
    print(f"{BATCHES * B} observations: float8 prefix against bf16, max {diff.max():.2e}, mean {diff.mean():.2e}; "
          f"actions' spread {spread:.3f}")
    assert 0 < diff.max() <= 0.01 * spread


def test_the_option_is_refused_where_it_cannot_run():
    """On the CPU, and for a policy without a prefix (before anything is quantized)."""
    _, policy = perturbed_policy("pi05_tiny")
    with pytest.raises(ValueError, match=r"serve.fp8_prefix=true needs a GPU with FP8 matrix units .* on cpu"):
        check_fp8(policy, torch.device("cpu"))
    from slurmvla.compose import compose
    from slurmvla.policy import build_policy

    tiny = build_policy(compose(["policy=tiny"]).policy)
    with pytest.raises(ValueError, match=r"needs a policy with prefix_modules\(\)"):
        check_fp8(tiny, torch.device("cpu"))
