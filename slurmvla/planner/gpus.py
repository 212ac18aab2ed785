"""The GPUs the planner knows (memory, dense peak FLOP/s, each figure's source) and what of a GPU's memory a
plan may use."""

from __future__ import annotations

from dataclasses import dataclass

from slurmvla.units import GiB, MiB


@dataclass(frozen=True)
class GPU:
    name: str
    # Memory as the driver reports it (nvidia-smi's total, MiB).
    memory_mib: int
    # Dense (no 2:4 sparsity) peaks in TFLOP/s: bf16 on the tensor cores with fp32 accumulation, and plain
    # fp32 (no tensor cores: torch leaves TF32 off for matmuls, and slurmvla does not turn it on).
    bf16_tflops: float
    fp32_tflops: float
    source: str
    # Memory bandwidth (GB/s, the datasheet's): what the optimizer step's memory traffic runs at (0: unknown, the
    # step then counts no optimizer time).
    hbm_gbps: float = 0.0

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MiB

    def peak_flops(self, precision: str) -> float:
        return (self.bf16_tflops if precision == "bf16" else self.fp32_tflops) * 1e12


# Vendor datasheets; every figure dense (the datasheets print "with sparsity" figures at twice these). Memory
# bandwidth from the same datasheets (H100 SXM 3.35 TB/s, H200 4.8, A100 80GB 2,039 GB/s and 40GB 1,555, L40S 864,
# RTX 4090 1,008, RTX 3090 936; A10G 600 as AWS lists it).
GPUS: dict[str, GPU] = {g.name: g for g in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; FP32 67.
    GPU("h100-80gb", 81559, 989.0, 67.0, "NVIDIA H100 datasheet, SXM5", 3350.0),
    # NVIDIA H200 datasheet (SXM): same compute as the H100 SXM (BF16 1,979 sparse -> 989; FP32 67), 141 GB HBM3e.
    GPU("h200-141gb", 143771, 989.0, 67.0, "NVIDIA H200 datasheet, SXM", 4800.0),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 (624 sparse); FP32 19.5; 80 GB and 40 GB.
    GPU("a100-80gb", 81920, 312.0, 19.5, "NVIDIA A100 datasheet", 2039.0),
    GPU("a100-40gb", 40960, 312.0, 19.5, "NVIDIA A100 datasheet", 1555.0),
    # NVIDIA L40S datasheet: BF16 362.05 (733 sparse); FP32 91.6; 48 GB GDDR6 with ECC.
    GPU("l40s-48gb", 46068, 362.0, 91.6, "NVIDIA L40S datasheet", 864.0),
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: BF16 with FP32 accumulate 165.2 (330.4 sparse);
    # FP32 82.6.
    GPU("rtx4090-24gb", 24564, 165.0, 82.6, "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090", 1008.0),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090: BF16 with FP32 accumulate 71 (142 sparse);
    # FP32 35.6.
    GPU("rtx3090-24gb", 24576, 71.0, 35.6, "NVIDIA Ampere GA102 whitepaper, RTX 3090", 936.0),
    # AWS's A10G (G5 instances) has no NVIDIA datasheet of its own: 70 dense BF16 tensor TFLOPS and 35 FP32 as
    # AWS and third-party comparisons list them (the A10's datasheet says 125 / 31.2); 24 GB, 23028 MiB with ECC.
    GPU("a10g-24gb", 23028, 70.0, 35.0, "AWS G5 / A10G figures (no NVIDIA datasheet)", 600.0),
)}
# Kept for the CUDA context, cuBLAS / NCCL workspaces and the like, before any tensor.
RESERVED_BYTES = 1 * GiB
DEFAULT_MARGIN = 0.05
# The fraction of a GPU's dense peak a step's FLOPs are assumed to run at (the step-time estimate's default).
DEFAULT_UTILIZATION = 0.40
