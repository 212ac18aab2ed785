"""Will a training configuration fit on a GPU, and how fast will it go: a plan before submitting.

    python -m slurmvla.plan [train overrides] --gpu h100-80gb [--nodes N] [--gpus-per-node G] [--compare] [--json OUT]
    python -m slurmvla.plan policy=pi05 precision=bf16 --gpu rtx4090-24gb
    python -m slurmvla.plan policy=pi05 precision=bf16 engine=fsdp_full --gpu h100-80gb --gpus-per-node 8 --compare

Nothing is allocated and no GPU is needed: the policy is built on the meta device (its parameters
counted exactly), and one training forward + backward of it runs on fake tensors (shapes and dtypes
only) while the bytes of every tensor it creates are tracked. It runs in seconds on a laptop for
pi0.5 at its published size.

What is counted, per GPU (the worst rank: shards are rounded up), in bytes:

* Model states, exact counts from the parameters' numbers of elements (``requires_grad`` tells
  trainable from frozen: ``policy.freeze_vision_encoder``, ``policy.train_expert_only`` and LoRA adapters
  all show there). AdamW keeps two fp32 moments per trainable element (8 B) and a 4-byte step count per
  trainable tensor. Per engine (``slurmvla/engine/``):

  - ``single`` / ``ddp`` (whole model on every GPU; ``engine/precision.py``): fp32: parameters 4 B, gradients
    4 B per trainable element. bf16: trainable parameters live in bf16 (2 B) with an fp32 master copy in the
    optimizer (4 B) and bf16 gradients (2 B); frozen parameters stay fp32 (4 B), or bf16 (2 B) with LoRA
    adapters (``policy.lora.enabled``). At the optimizer step the master-weight optimizer adds an fp32 copy
    of the gradients (4 B per trainable element; the activations are gone by then). DDP under bf16 with
    ``engine.reduce_dtype=fp32``: two 25 MiB gradient buckets in flight, each widened to fp32.
  - ``fsdp_full`` / ``hsdp`` / ``fsdp_grad_op`` (FSDP2 ``fully_shard`` per wrap unit, then the root;
    ``engine/fsdp.py``): parameters sharded in fp32 over the shard group (the world, or
    ``engine.shard_degree`` ranks for ``hsdp``; frozen ones bf16 with LoRA under bf16), each rank holding
    ceil(rows / shard) rows of every tensor; fp32 gradients and AdamW state sharded alike; no separate
    master (the fp32 shards are what the optimizer steps). Transient: the all-gathered parameters in the
    compute dtype (bf16 under bf16): the root's (whatever no wrap unit holds: pi0.5's token embedding), kept
    gathered from forward through backward, plus two copies of the largest wrap unit (the unit computing and
    the one prefetched); ``fsdp_grad_op`` keeps every unit gathered from its forward to its backward, so at
    the start of backward the whole model is gathered. Under bf16 with fp32 gradient reduction the largest
    unit's gradients are widened to fp32 for their reduce-scatter; at the end of backward the root's
    gradients are (phase "end of backward").
  - ``zero1`` / ``zero2`` / ``zero3`` (DeepSpeed, ``engine/zero.py``; the ZeRO paper, Rajbhandari et al. 2020,
    sec. 5: with Psi parameters, fp16/bf16 parameters 2 Psi + gradients 2 Psi + optimizer states K Psi, K = 12
    for mixed-precision Adam, P_os: 4 Psi + K Psi / N, P_os+g: 2 Psi + (2 + K) Psi / N, P_os+g+p: (4 + K) Psi / N;
    DeepSpeed's own estimators ``estimate_zero2_model_states_mem_needs``: 2 Psi + 18 Psi / N and
    ``estimate_zero3_model_states_mem_needs``: 4 x largest layer + 18 Psi / N, where 18 = the K = 12 plus an fp32
    gradient partition 4 plus a 2-byte gradient partition). Under bf16 DeepSpeed casts the whole module to bf16
    (2 B per parameter, frozen ones too) and keeps fp32 partitions of the trainable ones (4 B / N) and AdamW
    state on them (8 B / N); its flat groups (one per optimizer parameter group) are padded to a multiple of
    2 x N elements. zero1: bf16 gradients whole on every rank (2 B); zero2: partitioned (2 B / N); zero3:
    parameters partitioned too (2 B / N, each tensor rounded up), gathered per module: the largest module with
    parameters plus one prefetch bucket (``stage3_prefetch_bucket_size`` 5e7 elements) plus the small
    parameters kept whole (below ``stage3_param_persistence_threshold``, 1e5 elements), at most
    ``stage3_max_live_parameters`` (1e9). Transient in backward: DeepSpeed's gradient bucket
    (``reduce_bucket_size``, default 5e8 elements, in the model dtype, allocated whole) and, with
    ``communication_data_type=fp32`` (the engine's default under bf16), its fp32 copy for the reduction;
    at the step an fp32 copy of the gradient partition (4 B / N). Under fp32 everything is 4 B.

* Activations of one micro-batch: MEASURED, not modelled. The real policy (built on the meta device)
  runs one training forward + backward on fake tensors (``torch._subclasses.FakeTensorMode``) of the
  configured micro-batch, made from the policy's own ``sample_spec`` (random values of the right
  shapes; the instruction long enough to fill ``policy.max_text_len`` tokens: the worst case; pi0.5 writes
  its prompt from the state with its own ``prepare_inference``), with ``policy.gradient_checkpointing`` as
  configured, while a dispatch mode adds up the bytes of every storage created and frees them as they die
  (each rounded up to 512 B, as CUDA's caching allocator does). The peak of those live bytes is the
  activation figure: saved activations, the temporaries of forward and backward and, since the gradients
  are counted whole among the states, the fresh gradient each parameter gets before it is added into them.
  Parameters are held in the dtypes the engine computes with (see above) and gradients exist already.
  Fake tensors on a "cuda" device cannot run autograd in a CPU-only torch (the process aborts on the missing
  device guard), so the fake tensors live on the CPU and CUDA's autocast is reproduced by a
  ``TorchFunctionMode`` with CUDA's own casting lists (``aten/src/ATen/autocast_mode.cpp``; checked against
  the ops torch registers for ``AutocastCUDA``): matmuls, linears, convolutions and attention in bf16;
  norms, softmax, sums, pow / exp / log and losses in fp32. Attention with a mask and grouped key / value
  heads expands the heads first, as ``slurmvla.policy.flow_vla.attention`` does on a GPU. The CPU's
  fused attention kernel stands in for the GPU's (both keep q, k, v, the output and the log-sum-exp).
  Under FSDP the floating inputs of every unit's forward (and the root's) are cast to bf16 first, as its
  ``MixedPrecisionPolicy`` does. Two runs, at micro-batches 2 and the configured one (1 and 2 when that is
  smaller), give ``activations = fixed + per sample x B``: the configured size is measured, the largest
  micro-batch that fits is read off the line (an estimate beyond the measured sizes). Where a policy cannot run
  on fake tensors the activations are an analytic ESTIMATE instead (Korthikanti et al. 2022: 34 x tokens x
  width bytes per transformer layer in 16 bit, 2 x tokens x width with checkpointing, plus one layer), and
  the output says so.

* Peak per GPU = model states + the largest of (activations + forward / backward transients, the
  optimizer step's transients, the end of backward's). It fits when that stays under the budget: the GPU's
  memory less 1 GiB (CUDA context, cuBLAS and NCCL workspaces), less a margin (default 5 %) for the
  caching allocator's fragmentation. The largest micro-batch that fits, and the gradient-accumulation steps
  that keep ``trainer.global_batch_size``, follow.

* Time: an ESTIMATE. Model FLOPs per sample are counted (``torch.utils.flop_counter.FlopCounterMode`` on
  one more fake run, forward + backward, gradient checkpointing off; attention as its math path's matmuls,
  as ``slurmvla.profile`` counts); with checkpointing the step issues what its backward recomputes (counted
  in one more fake run as configured: ``policy.checkpoint_every`` / ``checkpoint_saves`` show there). Step
  time = issued FLOPs per GPU and optimizer step / (assumed utilization x the GPU's dense peak), the
  utilization 40 % unless ``--mfu`` says otherwise; MFU = model FLOPs / (step time x peak). Communication,
  data loading and the optimizer's memory traffic are not modelled: measure with ``python -m
  slurmvla.profile`` on the real hardware.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import shlex
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from slurmvla.compose import ArgumentParser, compose
from slurmvla.config import Config
from slurmvla.registry import ENGINES

log = logging.getLogger("slurmvla")

GiB = 2**30
MiB = 2**20


# -- GPUs -------------------------------------------------------------------------------------------


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

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MiB

    def peak_flops(self, precision: str) -> float:
        return (self.bf16_tflops if precision == "bf16" else self.fp32_tflops) * 1e12


# Vendor datasheets; every figure dense (the datasheets print "with sparsity" figures at twice these).
GPUS: dict[str, GPU] = {g.name: g for g in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; FP32 67.
    GPU("h100-80gb", 81559, 989.0, 67.0, "NVIDIA H100 datasheet, SXM5"),
    # NVIDIA H200 datasheet (SXM): same compute as the H100 SXM (BF16 1,979 sparse -> 989; FP32 67), 141 GB HBM3e.
    GPU("h200-141gb", 143771, 989.0, 67.0, "NVIDIA H200 datasheet, SXM"),
    # NVIDIA A100 Tensor Core GPU datasheet: BF16 312 (624 sparse); FP32 19.5; 80 GB and 40 GB.
    GPU("a100-80gb", 81920, 312.0, 19.5, "NVIDIA A100 datasheet"),
    GPU("a100-40gb", 40960, 312.0, 19.5, "NVIDIA A100 datasheet"),
    # NVIDIA L40S datasheet: BF16 362.05 (733 sparse); FP32 91.6; 48 GB GDDR6 with ECC.
    GPU("l40s-48gb", 46068, 362.0, 91.6, "NVIDIA L40S datasheet"),
    # NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: BF16 with FP32 accumulate 165.2 (330.4 sparse);
    # FP32 82.6.
    GPU("rtx4090-24gb", 24564, 165.0, 82.6, "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090: BF16 with FP32 accumulate 71 (142 sparse);
    # FP32 35.6.
    GPU("rtx3090-24gb", 24576, 71.0, 35.6, "NVIDIA Ampere GA102 whitepaper, RTX 3090"),
    # AWS's A10G (G5 instances) has no NVIDIA datasheet of its own: 70 dense BF16 tensor TFLOPS and 35 FP32 as
    # AWS and third-party comparisons list them (the A10's datasheet says 125 / 31.2); 24 GB, 23028 MiB with ECC.
    GPU("a10g-24gb", 23028, 70.0, 35.0, "AWS G5 / A10G figures (no NVIDIA datasheet)"),
)}
# Kept for the CUDA context, cuBLAS / NCCL workspaces and the like, before any tensor.
RESERVED_BYTES = 1 * GiB
DEFAULT_MARGIN = 0.05
DEFAULT_UTILIZATION = 0.40
# CUDA's caching allocator rounds every block up to a multiple of 512 bytes.
CUDA_BLOCK = 512


class PlanError(ValueError):
    """A user's mistake in the plan's own arguments: one line, exit 2."""


# -- parameters -------------------------------------------------------------------------------------


@dataclass
class Tensors:
    """The policy's parameters as an engine sees them: shapes, which train, how they group."""

    # (shape, trainable) per parameter.
    params: list[tuple[tuple[int, ...], bool]]
    buffer_bytes: int
    buffer_float_elements: int
    # Elements (all, trainable) of each wrap unit (policy.wrap_units()), and of whatever no unit holds.
    units: list[tuple[int, int]]
    root: tuple[int, int]
    # Trainable elements of each optimizer parameter group (DeepSpeed flattens each one).
    groups: list[int]
    # Elements of the module holding the most parameters directly (ZeRO-3 gathers per module) and of the
    # parameters small enough to stay whole under ZeRO-3.
    largest_module: int
    persistent: int
    adapters: int = 0

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for s, t in self.params if t)

    @property
    def frozen(self) -> int:
        return sum(math.prod(s) for s, t in self.params if not t)

    @property
    def trainable_tensors(self) -> int:
        return sum(1 for _, t in self.params if t)

    def sharded(self, shard: int, trainable: bool | None = None) -> int:
        """Elements per rank when every tensor is cut into ``shard`` parts along its first dimension, each
        rank holding ceil(rows / shard) rows (FSDP2's padded shards; the worst rank)."""
        total = 0
        for shape, t in self.params:
            if trainable is not None and t != trainable:
                continue
            rows = shape[0] if shape else 1
            total += -(-rows // shard) * (math.prod(shape[1:]) if shape else 1)
        return total

    def partitioned(self, world: int, trainable: bool | None = None) -> int:
        """Elements per rank when every tensor is flattened and cut into ``world`` parts (ZeRO-3)."""
        return sum(-(-math.prod(s) // world) for s, t in self.params if trainable is None or t == trainable)

    def flat_partitions(self, world: int) -> int:
        """Elements per rank of ZeRO-1/2's flat groups: each padded to a multiple of 2 x world, then split."""
        align = 2 * world
        return sum(-(-n // align) * align // world for n in self.groups)


ZERO3_PREFETCH = 50_000_000
ZERO3_PERSISTENCE = 100_000
ZERO3_MAX_LIVE = 1_000_000_000
DS_REDUCE_BUCKET = 500_000_000
DDP_BUCKET_BYTES = 25 * MiB


def shape_only(policy_cfg):
    """The policy's config without the local files its build would read (pretrained weights, a tokenizer):
    the plan needs shapes only, and the byte tokenizer fills the prompt as a worst case."""
    changes = {k: None for k in ("pretrained_path", "tokenizer_path") if getattr(policy_cfg, k, None)}
    if changes and getattr(policy_cfg, "stats_source", None) == "checkpoint":
        changes["stats_source"] = "data"
    return dataclasses.replace(policy_cfg, **changes) if changes else policy_cfg


def build_on_meta(cfg: Config) -> nn.Module:
    """Every parameter on the meta device, whether or not the policy initialises per parameter (a plug-in's
    too: ``build_policy(on_meta=True)`` builds those whole)."""
    from slurmvla.policy import build_policy
    from slurmvla.weights import parameters_on_meta

    with parameters_on_meta():
        return build_policy(shape_only(cfg.policy), stats=None)


def count_tensors(cfg: Config, policy: nn.Module) -> Tensors:
    from slurmvla.weights import is_adapter

    params = [(tuple(p.shape), p.requires_grad) for p in policy.parameters()]
    in_unit: dict[int, int] = {}
    units: list[tuple[int, int]] = []
    wrap = getattr(policy, "wrap_units", None)
    for i, unit in enumerate(wrap() if callable(wrap) else []):
        own = [p for p in unit.parameters() if id(p) not in in_unit]
        for p in own:
            in_unit[id(p)] = i
        units.append((sum(p.numel() for p in own), sum(p.numel() for p in own if p.requires_grad)))
    rest = [p for p in policy.parameters() if id(p) not in in_unit]
    root = (sum(p.numel() for p in rest), sum(p.numel() for p in rest if p.requires_grad))
    o = cfg.optim  # every built policy has the contract's param_groups (a plug-in gets the default)
    groups = [sum(p.numel() for p in g["params"]) for g in policy.param_groups(o.weight_decay, o.lr,
                                                                               o.backbone_lr_scale)]
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in policy.modules()), default=0)
    persistent = sum(p.numel() for p in policy.parameters() if p.numel() < ZERO3_PERSISTENCE)
    buffers = list(policy.buffers())
    adapters = sum(p.numel() for n, p in policy.named_parameters() if is_adapter(n))
    return Tensors(params, sum(b.nbytes for b in buffers), sum(b.numel() for b in buffers if b.is_floating_point()),
                   units, root, groups, largest, persistent, adapters)


# -- model states per engine --------------------------------------------------------------------------


@dataclass
class States:
    """Bytes per GPU: held for the whole run (``held``) and transient in three phases."""

    held: dict[str, int]
    forward_backward: dict[str, int]
    step: dict[str, int]
    end_of_backward: dict[str, int]
    # Parameter dtypes the engine computes with: (trainable, frozen).
    compute: tuple[torch.dtype, torch.dtype]
    notes: list[str] = field(default_factory=list)
    # FSDP2's mixed precision casts the floating inputs of every unit's (and the root's) forward to bf16.
    cast_inputs: bool = False

    @property
    def held_bytes(self) -> int:
        return sum(self.held.values())


def shard_group(cfg: Config, world: int, gpus_per_node: int) -> int:
    """Ranks a parameter is sharded over (FSDP); hsdp: its shard degree (slurmvla.engine.fsdp.hsdp_degrees)."""
    if cfg.engine.name != "hsdp":
        return world
    from slurmvla.engine.fsdp import hsdp_degrees
    from slurmvla.launch import DistEnv

    return hsdp_degrees(cfg.engine, DistEnv(world_size=world, local_world_size=gpus_per_node))[1]


def model_states(cfg: Config, t: Tensors, world: int, gpus_per_node: int) -> States:
    engine, low = cfg.engine.name, cfg.precision == "bf16"
    # With low-rank adapters the engines hold the frozen base in the compute dtype (engine/precision.py
    # lower_frozen_base); without them frozen parameters stay fp32.
    lora = t.adapters > 0
    bf16, fp32 = torch.bfloat16, torch.float32
    c = 2 if low else 4
    nt, nf, steps = t.trainable, t.frozen, 4 * t.trainable_tensors
    fp32_reduce = low and cfg.engine.reduce_dtype == "fp32"
    buffers = t.buffer_bytes
    if engine in ("single", "ddp"):
        frozen_bytes = 2 if (low and lora) else 4
        held = {"parameters": c * nt + frozen_bytes * nf, "gradients": c * nt, "fp32 master weights": 4 * nt if low else 0,
                "AdamW state": 8 * nt + steps, "buffers": buffers}
        fb = {"DDP gradient buckets widened to fp32": 2 * 2 * DDP_BUCKET_BYTES} if engine == "ddp" and fp32_reduce else {}
        step = {"fp32 copy of the gradients (master-weight optimizer)": 4 * nt} if low else {}
        return States(held, fb, step, {}, (bf16 if low else fp32, bf16 if (low and lora) else fp32))
    if engine in ("fsdp_full", "fsdp_grad_op", "hsdp"):
        if not t.units:
            raise PlanError(f"engine={engine} shards per wrap unit, but the policy's wrap_units() is empty")
        s = shard_group(cfg, world, gpus_per_node)
        frozen_bytes = 2 if (low and lora) else 4
        shard_t, shard_f = t.sharded(s, True), t.sharded(s, False)
        held = {"parameters": 4 * shard_t + frozen_bytes * shard_f, "gradients": 4 * shard_t, "fp32 master weights": 0,
                "AdamW state": 8 * shard_t + steps, "buffers": buffers}
        unit_all, unit_trainable = max(t.units)
        if engine == "fsdp_grad_op":
            fb = {"gathered parameters (whole model, kept from forward to backward)": c * (t.root[0] + sum(u for u, _ in t.units))}
        else:
            fb = {"gathered parameters (root, kept through backward)": c * t.root[0],
                  "gathered parameters (largest unit, x2: computing + prefetched)": 2 * c * unit_all}
        if fp32_reduce:
            fb["fp32 reduce-scatter input (largest unit's gradients)"] = 4 * unit_trainable
        end = {"gathered parameters (root)": c * t.root[0], "root's gradients": c * t.root[1]}
        if fp32_reduce:
            end["root's gradients widened to fp32 for the reduce-scatter"] = 4 * t.root[1]
        notes = [f"sharded over {s} rank(s)"]
        return States(held, fb, {}, end, (bf16 if low else fp32, bf16 if low else fp32), notes, cast_inputs=low)
    if engine in ("zero1", "zero2", "zero3"):
        stage = int(engine[-1])
        part = t.partitioned(world, True) if stage == 3 else t.flat_partitions(world)
        align = 2 * world
        flat = sum(-(-n // align) * align for n in t.groups)
        if stage == 3:
            params = c * t.partitioned(world)
        else:
            params = c * (flat + nf)
        grads = c * (nt if stage == 1 else part)
        held = {"parameters": params, "gradients": grads, "fp32 master weights": 4 * part,
                "AdamW state": 8 * part + 4 * len(t.groups),
                "buffers": (t.buffer_bytes - 2 * t.buffer_float_elements) if low else t.buffer_bytes}
        bucket = DS_REDUCE_BUCKET
        fb = {"DeepSpeed gradient bucket (reduce_bucket_size)": c * bucket}
        if low:  # communication_data_type=fp32 (slurmvla/engine/zero.py) unless engine.reduce_dtype=bf16
            if cfg.engine.reduce_dtype == "fp32":
                fb["its fp32 copy for the reduction"] = 4 * min(bucket, nt)
        if stage == 3:
            gathered = min(ZERO3_MAX_LIVE, t.largest_module + min(ZERO3_PREFETCH, nt + nf) + t.persistent)
            fb["gathered parameters (largest module + prefetch bucket + persistent)"] = c * gathered
        step = {"fp32 gradient partition": 4 * part} if low else {}
        return States(held, fb, step, {}, (bf16 if low else fp32, bf16 if low else fp32))
    raise PlanError(f"engine={engine!r}: the planner has no memory rules for it; it knows "
                    f"{['single', 'ddp', 'fsdp_full', 'fsdp_grad_op', 'hsdp', 'zero1', 'zero2', 'zero3']}")


# -- CUDA's autocast, reproduced on CPU fake tensors -------------------------------------------------

# aten/src/ATen/autocast_mode.cpp, the CUDA lists (torch 2.13): ops run in the lower precision ...
AUTOCAST_LOWER = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm",
    "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention"})
# ... in fp32 ...
AUTOCAST_FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "rms_norm", "norm",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "interpolate",
    "binary_cross_entropy"})
# ... in fp32 unless a dtype is given ...
AUTOCAST_FP32_OPT_DTYPE = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
                                     "linalg_matrix_norm", "sum"})
# ... and in the widest floating dtype of their inputs.
AUTOCAST_PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                              "index_put", "scatter_add", "tensordot"})
# Python entry points whose aten op has another name.
_ALIASES = {"interpolate": "interpolate", "upsample": "interpolate", "vector_norm": "linalg_vector_norm",
            "matrix_norm": "linalg_matrix_norm", "multi_dot": "linalg_multi_dot", "vecdot": "linalg_vecdot"}


def _op_name(func: Callable) -> str | None:
    """The aten-level name a Python torch function dispatches to first; None for in-place variants
    (autocast leaves them alone)."""
    name = getattr(func, "__name__", "") or ""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name.startswith("i") and name[1:] in ("matmul", "pow", "add", "mul", "sub", "truediv"):
            return None  # in place
        if name.startswith("r") and name[1:] in ("matmul", "pow"):
            name = name[1:]
    if name.endswith("_") and not name.startswith("_"):
        return None
    return _ALIASES.get(name, name)


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(dtype) if _eligible(x) and x.dtype != dtype else x, tree)


def _widest(tree: Any) -> torch.dtype | None:
    from torch.utils._pytree import tree_leaves

    dtypes = [x.dtype for x in tree_leaves(tree) if _eligible(x)]
    return max(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else None


class CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA's autocast policy at the Python API, for tensors on another device (fake CPU tensors here).

    Like ``torch.autocast("cuda")`` it acts before autograd records an op, so the casts' outputs are what
    backward saves; unlike it, no cache of cast fp32 leaf weights is kept (no engine here trains fp32
    leaves under bf16: single / DDP lower the trainable parameters, FSDP and DeepSpeed compute in bf16).
    ``gqa_expand``: attention with a mask over grouped key / value heads expands the heads first, as
    ``slurmvla.policy.flow_vla.attention`` does on a GPU (no fused CUDA kernel takes both)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, gqa_expand: bool = True):
        super().__init__()
        self.dtype, self.gqa_expand = dtype, gqa_expand

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        kwargs = dict(kwargs or {})
        name = _op_name(func)
        if name is None:
            return func(*args, **kwargs)
        if name == "scaled_dot_product_attention":
            args, kwargs = self._expand_heads(args, kwargs)
        if name in AUTOCAST_LOWER:
            args, kwargs = _cast((args, kwargs), self.dtype)
        elif name in AUTOCAST_FP32:
            args, kwargs = _cast((args, kwargs), torch.float32)
        elif name in AUTOCAST_FP32_OPT_DTYPE:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if _eligible(first) and kwargs.get("dtype") is None and first.dtype != torch.float32:
                kwargs["dtype"] = torch.float32
        elif name in AUTOCAST_PROMOTE:
            widest = _widest((args, kwargs))
            if widest is not None:
                args, kwargs = _cast((args, kwargs), widest)
        return func(*args, **kwargs)

    def _expand_heads(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not (self.gqa_expand and kwargs.get("enable_gqa")):
            return args, kwargs
        q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args):])[:3]
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if mask is None or k.shape[-3] == q.shape[-3]:
            return args, kwargs
        groups = q.shape[-3] // k.shape[-3]
        k, v = (x.repeat_interleave(groups, dim=-3) for x in (k, v))
        rest = {n: a for n, a in kwargs.items() if n not in ("query", "key", "value", "enable_gqa")}
        return (q, k, v, *args[3:]), rest


# -- tracking live bytes ------------------------------------------------------------------------------


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Adds up the bytes of every storage an op creates and takes them off when the storage dies; keeps
    the peak. Storages that existed before (``known``) never count."""

    def __init__(self, known: Iterator[torch.Tensor] = (), round_to: int = 1):
        super().__init__()
        self.round_to = max(1, round_to)
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
        from slurmvla.registry import SAMPLE_MODES

        mode = SAMPLE_MODES.index(cfg.data.mode) if cfg.data.mode in SAMPLE_MODES else 0
        batch["mode"] = torch.full((micro,), mode, dtype=torch.long)
        batch["future_states"] = torch.randn(micro, spec.action_horizon, p.state_dim, generator=g)
        batch["future_mask"] = torch.ones(micro, spec.action_horizon, dtype=torch.bool)
    prepare = getattr(policy, "prepare_inference", None)
    if callable(prepare):
        hushed = logging.getLogger("slurmvla.policy.pi0")
        level, hushed.level = hushed.level, logging.ERROR  # "a prompt filled max_text_len": meant to here
        try:
            with torch.no_grad():
                batch = prepare(batch, bucket=1)
        finally:
            hushed.level = level
    return batch


def _sdpa_flop_mapping() -> dict:
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


def _failure(e: Exception) -> str:
    """Why the fake-tensor pass could not run, in one line (the plan falls back to an analytic estimate)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


@dataclass
class Pass:
    micro: int
    peak_bytes: int
    flops: float
    forward_flops: float
    seconds: float


class FakeStep:
    """The policy on fake CPU tensors, ready for training forward + backward passes at any micro-batch and
    in any of the engines' parameter dtypes. Built once per plan."""

    def __init__(self, cfg: Config, meta_policy: nn.Module, round_to: int = CUDA_BLOCK,
                 frame: tuple[int, int] = DROID_FRAME):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.cfg, self.round_to = cfg, round_to
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.policy = meta_policy
        # One sample, prepared while the buffers (normalization statistics) are still real: pi0.5 writes its
        # prompt from the state's values, which a fake tensor does not have.
        self.sample = fake_batch(cfg, meta_policy, 1, frame)
        self._dtypes: tuple[torch.dtype, torch.dtype] | None = None
        with self.mode:
            self.policy.to_empty(device="cpu")
        self.policy.train()

    def use_dtypes(self, compute: tuple[torch.dtype, torch.dtype]) -> None:
        """Trainable / frozen parameters in these dtypes; every trainable one with a gradient already."""
        if compute == self._dtypes:
            return
        with self.mode, torch.no_grad():
            for p in self.policy.parameters():
                want = compute[0] if p.requires_grad else compute[1]
                if p.is_floating_point() and p.dtype != want:
                    p.data = p.data.to(want)
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        self._dtypes = compute

    @contextmanager
    def _checkpointing(self, on: bool | None) -> Iterator[None]:
        """``on`` False: gradient checkpointing off for this pass (the model FLOPs count); None: as configured."""
        has = hasattr(self.policy, "gradient_checkpointing")
        before = getattr(self.policy, "gradient_checkpointing", None)
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

        wrap = getattr(self.policy, "wrap_units", None)
        modules = [*(wrap() if callable(wrap) else []), self.policy]
        return [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]

    def run(self, micro: int, compute: tuple[torch.dtype, torch.dtype], low: bool, count_flops: bool = False,
            checkpointing: bool | None = None, cast_inputs: bool = False) -> Pass:
        from torch.utils.flop_counter import FlopCounterMode

        t0 = time.perf_counter()
        self.use_dtypes(compute)
        batch = {k: (v.expand(micro, *v.shape[1:]).clone() if isinstance(v, torch.Tensor) else list(v) * micro)
                 for k, v in self.sample.items()}
        with self.mode:
            batch = {k: (self.mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        known = [*self.policy.parameters(), *self.policy.buffers(),
                 *(p.grad for p in self.policy.parameters() if p.grad is not None),
                 *(v for v in batch.values() if isinstance(v, torch.Tensor))]
        tracker = LiveBytes(known, self.round_to)
        counter = FlopCounterMode(display=False, custom_mapping=_sdpa_flop_mapping()) if count_flops else None
        autocast = CudaAutocast(torch.bfloat16) if low else None
        hooks = self._cast_inputs() if cast_inputs else []
        try:
            with self._checkpointing(checkpointing), self.mode, tracker:
                with counter if counter is not None else _nothing(), autocast if autocast is not None else _nothing():
                    out = self.policy(batch)
                    loss = out["loss"] if isinstance(out, dict) else out
                    forward_flops = float(counter.get_total_flops()) if counter is not None else 0.0
                    backward(loss)
                del out, loss
        finally:
            for h in hooks:
                h.remove()
        flops = float(counter.get_total_flops()) if counter is not None else 0.0
        return Pass(micro, tracker.peak, flops, forward_flops, time.perf_counter() - t0)


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
    None for a policy whose config has no transformer shape."""
    p = cfg.policy
    need = ("width", "depth", "expert_width", "vision_width", "vision_depth", "patch_size")
    if not all(hasattr(p, k) for k in need):
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


# -- the plan --------------------------------------------------------------------------------------------


@dataclass
class Activations:
    """Bytes of one micro-batch's activations: ``fixed + per_sample x B``, and measured points."""

    fixed: float
    per_sample: float
    measured: dict[int, int]
    method: str  # "measured (fake tensors)" or "analytic ESTIMATE"
    model_flops_per_sample: float | None = None
    issued_flops_per_sample: float | None = None
    seconds: float = 0.0
    # The parameter dtypes of the fake runs: (trainable, frozen).
    compute: tuple[torch.dtype, torch.dtype] | None = None

    def at(self, micro: int) -> int:
        if micro in self.measured:
            return self.measured[micro]
        return int(self.fixed + self.per_sample * micro)


class Planner:
    """One configuration's policy, counted and measured once; plans for any engine of it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.policy = build_on_meta(cfg)
        self.tensors = count_tensors(cfg, self.policy)
        self._fake: FakeStep | None = None
        self._fake_error: str | None = None
        self._cache: dict[tuple, Pass] = {}
        self._flops: tuple[float, float] | None = None

    def _step(self) -> FakeStep | None:
        if self._fake is None and self._fake_error is None:
            try:
                self._fake = FakeStep(self.cfg, self.policy)
            except Exception as e:  # a policy that cannot live on fake tensors
                self._fake_error = _failure(e)
        return self._fake

    def measure(self, cfg: Config, micro: int, compute: tuple[torch.dtype, torch.dtype],
                cast_inputs: bool = False) -> Pass | None:
        """The peak live bytes of one training forward + backward at ``micro`` (cached)."""
        key = (micro, compute, cfg.precision, cast_inputs)
        if key not in self._cache:
            step = self._step()
            if step is None:
                return None
            try:
                self._cache[key] = step.run(micro, compute, cfg.precision == "bf16", cast_inputs=cast_inputs)
            except Exception as e:
                self._fake_error = _failure(e)
                return None
        return self._cache[key]

    def flops(self, cfg: Config, compute: tuple[torch.dtype, torch.dtype]) -> tuple[float, float] | None:
        """(model FLOPs, issued FLOPs) of one sample's forward + backward: counted in a pass of their own
        without gradient checkpointing; with it, in one more pass as configured, whose backward counts what
        it recomputes (every checkpointed layer's forward, less what ``policy.checkpoint_saves`` keeps)."""
        if self._flops is None and self._step() is not None:
            low = cfg.precision == "bf16"
            try:
                got = self._step().run(1, compute, low, count_flops=True, checkpointing=False)
                issued = got.flops
                if getattr(self._step().policy, "gradient_checkpointing", False):
                    issued = self._step().run(1, compute, low, count_flops=True).flops
            except Exception as e:
                self._fake_error = _failure(e)
                return None
            self._flops = (got.flops, issued)
        return self._flops

    def activations(self, cfg: Config, micro: int, compute: tuple[torch.dtype, torch.dtype],
                    cast_inputs: bool = False) -> Activations:
        """Measured at two micro-batches: 1 and 2, or 2 and the configured one when it is larger (a fixed
        part, e.g. a large embedding's gradient, dominates the smallest sizes); a straight line through them."""
        t0 = time.perf_counter()
        if self.tensors.frozen == 0:  # nothing frozen: one arrangement serves every engine
            compute = (compute[0], compute[0])
        sizes = (2, micro) if micro > 2 else (1, 2)
        points = {}
        for b in sizes:
            got = self.measure(cfg, b, compute, cast_inputs)
            if got is None:
                break
            points[b] = got.peak_bytes
        else:
            (b1, m1), (b2, m2) = sorted(points.items())
            per_sample = (m2 - m1) / (b2 - b1)
            fixed = m1 - per_sample * b1
            model, issued = self.flops(cfg, compute) or (None, None)
            return Activations(fixed, per_sample, points, "measured (fake tensors)", model, issued,
                               time.perf_counter() - t0, compute)
        per = analytic_activations(cfg, 1)
        if per is None:
            return Activations(0.0, 0.0, {}, f"NOT ESTIMATED (fake tensors failed: {self._fake_error})")
        return Activations(0.0, float(per), {}, f"analytic ESTIMATE (fake tensors failed: {self._fake_error})")


_LAST: list[tuple[str, Planner]] = []


def planner_for(cfg: Config) -> Planner:
    """The planner of this configuration's policy, reused when the previous call planned the same one (the
    engines of ``--compare``, or several plans in one process)."""
    from omegaconf import OmegaConf

    key = f"{OmegaConf.to_yaml(OmegaConf.structured(cfg.policy))}|{cfg.data.mode}|{cfg.optim}"
    if not (_LAST and _LAST[0][0] == key):
        _LAST[:] = [(key, Planner(cfg))]
    return _LAST[0][1]


def plan_engine(planner: Planner, cfg: Config, gpu: GPU, nodes: int, gpus_per_node: int,
                margin: float = DEFAULT_MARGIN, utilization: float = DEFAULT_UTILIZATION) -> dict[str, Any]:
    """Every figure of one configuration on ``nodes x gpus_per_node`` GPUs (a PlanError when the
    configuration cannot run there)."""
    world = nodes * gpus_per_node
    entry = ENGINES.get(cfg.engine.name)
    if not entry.multi_process and world > 1:
        raise PlanError(f"engine={entry.name} runs one process, but {nodes} x {gpus_per_node} GPUs is a world of "
                        f"{world}; choose one of {list(ENGINES.names(multi_process=True))}")
    micro = cfg.trainer.micro_batch_size(world)
    accum = cfg.trainer.grad_accum_steps
    t = planner.tensors
    states = model_states(cfg, t, world, gpus_per_node)
    acts = planner.activations(cfg, micro, states.compute, states.cast_inputs)
    budget = int((gpu.memory_bytes - RESERVED_BYTES) * (1 - margin))

    def peak_at(b: int) -> tuple[int, str]:
        phases = {"forward + backward": acts.at(b) + sum(states.forward_backward.values()),
                  "optimizer step": sum(states.step.values()),
                  "end of backward": sum(states.end_of_backward.values())}
        phase = max(phases, key=phases.get)
        return states.held_bytes + phases[phase], phase

    peak, phase = peak_at(micro)
    fits = peak <= budget
    # The largest micro-batch under the budget, from the linear activation model (an estimate beyond the
    # measured sizes).
    largest = 0
    if acts.per_sample > 0:
        room = budget - states.held_bytes - sum(states.forward_backward.values()) - acts.fixed
        largest = max(0, int(room // acts.per_sample))
        if max(sum(states.step.values()), sum(states.end_of_backward.values())) + states.held_bytes > budget:
            largest = 0
        while largest > 0 and peak_at(largest)[0] > budget:
            largest -= 1
    global_batch = cfg.trainer.global_batch_size
    suggestion = None
    if largest > 0:
        for a in range(1, global_batch // world + 1):
            if global_batch % (world * a) == 0 and global_batch // (world * a) <= largest:
                suggestion = {"grad_accum_steps": a, "micro_batch_size": global_batch // (world * a)}
                break
    result: dict[str, Any] = {
        "engine": cfg.engine.name, "precision": cfg.precision, "policy": cfg.policy.size,
        "world_size": world, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu.name,
        "global_batch_size": global_batch, "micro_batch_size": micro, "grad_accum_steps": accum,
        "gradient_checkpointing": bool(getattr(cfg.policy, "gradient_checkpointing", False)),
        "lora": cfg.policy.lora.enabled,
        "parameters": {"total": t.trainable + t.frozen, "trainable": t.trainable, "frozen": t.frozen,
                       "trainable_tensors": t.trainable_tensors, "adapters": t.adapters,
                       "wrap_units": len(t.units), "largest_unit": max(t.units)[0] if t.units else 0,
                       "root": t.root[0]},
        "held_bytes": dict(states.held),
        "forward_backward_bytes": dict(states.forward_backward),
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
    if acts.model_flops_per_sample:
        peak_flops = gpu.peak_flops(cfg.precision)
        per_gpu_samples = global_batch / world
        step_s = acts.issued_flops_per_sample * per_gpu_samples / (utilization * peak_flops)
        result["time_estimate"] = {
            "model_flops_per_sample": acts.model_flops_per_sample,
            "issued_flops_per_sample": acts.issued_flops_per_sample,
            "peak_tflops": peak_flops / 1e12, "assumed_utilization": utilization,
            "step_s": step_s, "samples_per_s": global_batch / step_s,
            "mfu": acts.model_flops_per_sample * per_gpu_samples / (step_s * peak_flops),
        }
    return result


# -- output -----------------------------------------------------------------------------------------------


def _unit(largest: float) -> tuple[str, float]:
    return ("GiB", GiB) if largest >= GiB / 4 else ("MiB", MiB)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _flops(n: float) -> str:
    return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"


def format_plan(r: dict[str, Any]) -> str:
    p, a = r["parameters"], r["activations"]
    name, div = _unit(max(r["peak_bytes"], r["budget_bytes"] if r["peak_bytes"] >= GiB / 4 else 0))

    def row(label: str, v: float) -> str:
        return f"  {label[:64]:64s} {v / div:9.2f}"

    lines = [
        f"policy={r['policy']} ({_count(p['total'])} parameters: {_count(p['trainable'])} trainable, "
        f"{_count(p['frozen'])} frozen{', LoRA adapters' if p['adapters'] else ''}), precision={r['precision']}, "
        f"engine={r['engine']}, gradient checkpointing {'on' if r['gradient_checkpointing'] else 'off'}",
        f"{r['world_size']} x {r['gpu']} ({r['nodes']} node(s) x {r['gpus_per_node']} GPU(s)); global batch "
        f"{r['global_batch_size']} = micro {r['micro_batch_size']} x accumulation {r['grad_accum_steps']} x "
        f"{r['world_size']} GPU(s)",
        f"{'per GPU (worst rank)':66s} {name:>9s}",
    ]
    lines += [row(k, v) for k, v in r["held_bytes"].items() if v]
    lines.append(row("= model states", sum(r["held_bytes"].values())))
    lines.append(row(f"activations, micro-batch {r['micro_batch_size']}: {a['method'].split(' (')[0]}",
                     a["bytes_at_micro_batch"]))
    if a["method"].startswith("measured"):
        lines.append(f"    = {a['fixed_bytes'] / div:.2f} {name} + {a['per_sample_bytes'] / div:.3f} {name} per sample "
                     f"(fake runs at micro-batch {' and '.join(a['measured_bytes'])}; parameters "
                     f"{'/'.join(a['compute_dtypes'])} (trainable/frozen))")
    else:
        lines.append(f"    {a['method']}")
    for title, key in (("forward + backward", "forward_backward_bytes"), ("optimizer step", "step_bytes"),
                       ("end of backward", "end_of_backward_bytes")):
        lines += [row(f"{title}: {k}", v) for k, v in r[key].items() if v]
    lines.append(row(f"= peak ({r['peak_phase']})", r["peak_bytes"]))
    verdict = "FITS" if r["fits"] else f"DOES NOT FIT (over by {(r['peak_bytes'] - r['budget_bytes']) / GiB:.2f} GiB)"
    lines.append(f"budget: {r['gpu_memory_bytes'] / GiB:.1f} GiB - {r['reserved_bytes'] / GiB:.0f} GiB reserved (CUDA "
                 f"context, workspaces) - {100 * r['margin']:.0f}% allocator margin = {r['budget_bytes'] / GiB:.2f} GiB "
                 f"-> {verdict}")
    if r["largest_micro_batch"] > 0:
        s = r["to_fit"]
        keep = (f"; trainer.grad_accum_steps={s['grad_accum_steps']} keeps the global batch {r['global_batch_size']} "
                f"at micro-batch {s['micro_batch_size']}") if s else \
            f"; no split of the global batch {r['global_batch_size']} over {r['world_size']} GPU(s) is that small"
        lines.append(f"largest micro-batch that fits: {r['largest_micro_batch']} (ESTIMATE: linear in the micro-batch "
                     f"beyond the measured sizes){keep}")
    else:
        lines.append("largest micro-batch that fits: none (the model states alone, or with one sample, exceed the "
                     "budget: shard them over more GPUs (engine=fsdp_full / zero2 / zero3), freeze parts, or use LoRA)")
    est = r.get("time_estimate")
    if est:
        lines.append(
            f"ESTIMATE, not a measurement: {_flops(est['model_flops_per_sample'])} per sample (forward + backward; "
            f"{_flops(est['issued_flops_per_sample'])} issued with recomputation); at an assumed "
            f"{100 * est['assumed_utilization']:.0f}% of {est['peak_tflops']:.0f} TFLOP/s ({r['precision']}, dense) a "
            f"step takes ~{est['step_s']:.3g} s, {est['samples_per_s']:.3g} samples/s, MFU {100 * est['mfu']:.0f}% "
            "(communication and data loading not modelled)")
    lines += [f"note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def format_comparison(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if "refused" not in r]
    name, div = _unit(max((r["peak_bytes"] for r in ok), default=GiB))
    lines = [f"{'engine':13s} {'params':>7s} {'grads':>7s} {'master':>7s} {'AdamW':>7s} {'transnt':>7s} "
             f"{'activ.':>7s} {'peak':>7s}  {'fits':4s} {'max micro':>9s} {'accum':>5s} {'step s':>7s}"]
    for r in rows:
        if "refused" in r:
            lines.append(f"{r['engine']:13s} {r['refused']}")
            continue
        h = r["held_bytes"]
        transient = max(sum(r["forward_backward_bytes"].values()), sum(r["step_bytes"].values()),
                        sum(r["end_of_backward_bytes"].values()))
        s = r["to_fit"]
        step = r.get("time_estimate", {}).get("step_s")
        g = lambda v: f"{v / div:7.2f}"  # noqa: E731
        lines.append(f"{r['engine']:13s} {g(h['parameters'])} {g(h['gradients'])} {g(h['fp32 master weights'])} "
                     f"{g(h['AdamW state'])} {g(transient)} {g(r['activations']['bytes_at_micro_batch'])} "
                     f"{g(r['peak_bytes'])}  {'yes' if r['fits'] else 'NO':4s} {r['largest_micro_batch']:9d} "
                     f"{(s['grad_accum_steps'] if s else '-')!s:>5s} {f'{step:7.3g}' if step else '      -'}")
    lines.append(f"{name} per GPU (worst rank). transnt: the largest transient besides the activations (gathered "
                 "parameters, buckets, fp32 gradient copies); activ.: measured at the configured micro-batch; accum: "
                 "the fewest grad_accum_steps that fit and keep the global batch; step s: an ESTIMATE at the assumed "
                 "utilization")
    return "\n".join(lines)


# -- the program ----------------------------------------------------------------------------------------


def compare_engines(world: int, gpus_per_node: int) -> list[str]:
    names = []
    for name in ENGINES:
        if name == "single" and world > 1:
            continue
        if name == "hsdp" and world % gpus_per_node:
            continue
        names.append(name)
    return names


def run(overrides: list[str], gpu: GPU, nodes: int, gpus_per_node: int, compare: bool = False,
        margin: float = DEFAULT_MARGIN, utilization: float = DEFAULT_UTILIZATION) -> tuple[list[dict[str, Any]], str]:
    """The plan of the configuration the overrides compose, or (``compare``) of every engine that can run on
    this many GPUs; and the configured engine's name."""
    cfg = compose(overrides)
    planner = planner_for(cfg)
    if not compare:
        return [plan_engine(planner, cfg, gpu, nodes, gpus_per_node, margin, utilization)], cfg.engine.name
    rows = []
    for name in compare_engines(nodes * gpus_per_node, gpus_per_node):
        try:
            variant = compose([*overrides, f"engine={name}"])
            rows.append(plan_engine(planner, variant, gpu, nodes, gpus_per_node, margin, utilization))
        except ValueError as e:  # e.g. zero3 refuses gradient checkpointing; hsdp degrees that do not multiply
            rows.append({"engine": name, "refused": f"refused: {str(e).splitlines()[0]}"})
    return rows, cfg.engine.name


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train overrides (key=value), as python -m slurmvla.train takes them")
    parser.add_argument("--gpu", default="h100-80gb", help=f"the GPU model: one of {list(GPUS)} (default h100-80gb)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    parser.add_argument("--compare", action="store_true", help="every engine side by side for this configuration")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--mfu", type=float, default=DEFAULT_UTILIZATION,
                        help="assumed fraction of the GPU's dense peak the step's FLOPs run at (default 0.4)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="fraction of the usable memory kept free for the allocator's fragmentation (default 0.05)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        gpu = GPUS.get(args.gpu.lower())
        if gpu is None:
            raise PlanError(f"--gpu {args.gpu} is not a GPU the planner knows; choose one of {list(GPUS)}")
        for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
            if value < 1:
                raise PlanError(f"{flag} {value} is not valid; it must be >= 1")
        if not 0 < args.mfu <= 1:
            raise PlanError(f"--mfu {args.mfu} is not valid; it must be in (0, 1], e.g. 0.4")
        if not 0 <= args.margin < 1:
            raise PlanError(f"--margin {args.margin} is not valid; it must be in [0, 1), e.g. 0.05")
        rows, configured = run(list(args.overrides), gpu, args.nodes, args.gpus_per_node, args.compare, args.margin,
                               args.mfu)
    except ValueError as e:  # PlanError, a config mistake (compose's one line), a batch that does not divide
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    if args.compare:
        full = next((r for r in rows if "refused" not in r and r["engine"] == configured),
                    next((r for r in rows if "refused" not in r), None))
        if full is not None:
            print(format_plan(full), flush=True)
            print()
        print(f"all engines, {args.nodes * args.gpus_per_node} x {gpu.name}, "
              f"{' '.join(shlex.quote(o) for o in args.overrides) or 'defaults'}:")
        print(format_comparison(rows))
    else:
        print(format_plan(rows[0]))
    if args.json:
        args.json.write_text(json.dumps({"gpu": dataclasses.asdict(gpu), "plans": rows}, indent=2, default=str))


if __name__ == "__main__":
    main()
