"""The time a step takes: an ESTIMATE from the FLOPs the fake step counts (model FLOPs, and those issued with
gradient checkpointing's recomputation) at an assumed fraction of the GPU's dense peak. Communication, data
loading and the optimizer's memory traffic are not modelled."""

from __future__ import annotations

from typing import Any

import torch

from slurmvla.planner.gpus import GPU


def sdpa_flop_mapping() -> dict:
    """FlopCounterMode counts the GPU's fused attention kernels, not the CPU's, which stands in for them here:
    its forward as torch's formula for the fused kernels (two matmuls), its backward as four (the gradients of
    the scores, the values, the queries and the keys; torch's formula for the fused backward adds a fifth, the
    kernel's recomputation of the scores), so that model FLOPs are those of the math path, as
    ``slurmvla.profile.count_flops_per_sample`` counts them on the meta device."""
    from torch.utils.flop_counter import sdpa_flop_count

    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return {}

    def forward(query, key, value, *args, **kwargs) -> int:
        return sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward(grad_out, query, key, value, *args, **kwargs) -> int:
        return 2 * sdpa_flop_count(query.shape, key.shape, value.shape)

    forward._get_raw = backward._get_raw = True
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}



def time_estimate(model_flops: float, issued_flops: float, gpu: GPU, precision: str, global_batch: int, world: int,
                  utilization: float) -> dict[str, Any]:
    """Step time = issued FLOPs per GPU and optimizer step / (utilization x the GPU's dense peak); MFU = model
    FLOPs / (step time x peak)."""
    peak_flops = gpu.peak_flops(precision)
    per_gpu_samples = global_batch / world
    step_s = issued_flops * per_gpu_samples / (utilization * peak_flops)
    return {
        "model_flops_per_sample": model_flops,
        "issued_flops_per_sample": issued_flops,
        "peak_tflops": peak_flops / 1e12, "assumed_utilization": utilization,
        "step_s": step_s, "samples_per_s": global_batch / step_s,
        "mfu": model_flops * per_gpu_samples / (step_s * peak_flops),
    }
