#!/usr/bin/env bash
# The GPU measurements of one session, in one call: each section's output in its own log under $OUT.
#
#   bash benchmarks/gpu_suite.sh [SECTION ...]     # default: tests latency train compile batch
#
# Sections (pi0.5 at its published size, bf16, one GPU):
#   tests     python -m pytest tests/test_gpu.py
#   latency   sample_actions at batch 1 (eager, CUDA graph, compiled + graph), the server through openpi's
#             client, and the kernels of each
#   unfused   the graphed modes with serve.fused_projections=false (latency runs them fused, the default)
#   denoise   the graphed modes with policy.denoise_attention=sdpa (latency runs matmul, the default)
#   droid2    latency's modes in the 2-camera layout of experiment=pi05_droid (exterior 1 + wrist), random weights
#   fp8       serve.fp8_prefix (the prefix's products in float8, torchao): actions against bf16 on 100 observations,
#             compiled + graphed latency of both (benchmarks/fp8_prefix.py; compute capability 8.9+)
#   jitter    where the graphed modes' p99 comes from: 500 served calls (PolicyRunner under serve.cuda_graph, then
#             serve.compile too) split into stages, with the collector, the allocator and the SM clock per call;
#             the same with the collector off and with the graph replayed alone (sample_latency.py --jitter)
#   train     python -m slurmvla.profile at micro-batch 16: phases, MFU, start-up, kernels
#   compile   the same with trainer.compile=true
#   efficient the compiled step with the memory-efficient attention kernel first (policy.attention_kernels)
#   bucket    the compiled step with the training prompt cut to each batch's exact length against the default
#             multiple of 32 tokens (policy.prompt_bucket): how much of cuDNN's per-shape planning it saves
#   plan      the plan's peak against the allocator's at micro-batch 12 and 16, compiled, no recomputation (both
#             peak in forward + backward, so the per-sample slopes compare the activations'; at 4 the step peaks)
#             (benchmarks/plan_vs_measured.py): what policy.gradient_checkpointing=auto decides from; planned
#             both at policy.max_text_len (the worst case) and at the measured batches' own prompt length
#   saved     what the compiled step keeps for the backward, by tensor shape, the plan's fake step against the GPU's
#             (benchmarks/saved_tensors.py, micro-batch 16 without recomputation: 84 GiB, an H200's)
#   sac       selective checkpointing (policy.checkpoint_saves=matmuls) at micro-batch 8 x 2
#   batch     the largest micro-batch that fits (benchmarks/max_micro_batch.py)
#   load      a pi0.5 checkpoint (weights, fp32 optimizer state) loaded by --resume against reading its files
#             (benchmarks/checkpoint_load.py; ~38 GB written to the disk first)
#   rtc       real-time chunking's guided sample_actions against plain sampling, eager (benchmarks/rtc_cost.py)
#   inference_tests  the GPU tests of inference (graphs, server) and of the step's host synchronisation
#   lerobot   benchmarks/vs_lerobot.py --parts model --device cuda (LeRobot's side: benchmarks/lerobot_python.sh;
#             the wheels of both sides: bash benchmarks/gpu_wheels.sh, here, before the call)
# Each runs under its own time limit (SUITE_LIMIT_<SECTION> seconds), so one that hangs costs only its share.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PI05=(policy=pi05 precision=bf16 data.num_workers=4)
PROFILE=(profile.warmup_steps=2 profile.steps=5 profile.peak_tflops=989 trainer.global_batch_size=16)

run() {  # run NAME LIMIT CMD...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/suite.log"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/suite.log"
    tail -n 60 "$OUT/$name.log"
}

section() {
    case $1 in
        tests) run tests "${SUITE_LIMIT_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs --durations=10 ;;
        latency) run latency "${SUITE_LIMIT_LATENCY:-240}" python3 benchmarks/sample_latency.py "${PI05[@]}" \
            --modes eager,graph,compile_graph --iters 30 --server --kernels 12 ;;
        unfused) run unfused "${SUITE_LIMIT_UNFUSED:-200}" python3 benchmarks/sample_latency.py "${PI05[@]}" \
            serve.fused_projections=false --modes eager,graph,compile_graph --iters 30 --kernels 12 ;;
        denoise) run denoise "${SUITE_LIMIT_DENOISE:-200}" python3 benchmarks/sample_latency.py "${PI05[@]}" \
            policy.denoise_attention=sdpa --modes eager,graph,compile_graph --iters 30 --kernels 12 ;;
        droid2) run droid2 "${SUITE_LIMIT_DROID2:-200}" python3 benchmarks/sample_latency.py experiment=pi05_droid \
            policy.stats_source=data --modes eager,graph,compile_graph --iters 100 --server ;;
        fp8) run fp8 "${SUITE_LIMIT_FP8:-300}" python3 benchmarks/fp8_prefix.py "${PI05[@]}" --observations 100 --iters 100 ;;
        jitter) run jitter "${SUITE_LIMIT_JITTER:-200}" python3 benchmarks/sample_latency.py "${PI05[@]}" --jitter \
            --modes graph,compile_graph --iters 500 --variants full,nogc,replay --deadline $(( ${SUITE_LIMIT_JITTER:-200} - 15 )) --json "$OUT/jitter.json" ;;
        train) run train "${SUITE_LIMIT_TRAIN:-150}" python3 -m slurmvla.profile "${PI05[@]}" "${PROFILE[@]}" \
            profile.kernels=15 ;;
        compile) run compile "${SUITE_LIMIT_COMPILE:-200}" python3 -m slurmvla.profile "${PI05[@]}" "${PROFILE[@]}" \
            trainer.compile=true profile.kernels=15 ;;
        efficient) run efficient "${SUITE_LIMIT_EFFICIENT:-200}" python3 -m slurmvla.profile "${PI05[@]}" "${PROFILE[@]}" \
            trainer.compile=true "policy.attention_kernels=[efficient,math]" profile.kernels=15 ;;
        bucket) run bucket "${SUITE_LIMIT_BUCKET:-300}" python3 -m slurmvla.profile "${PI05[@]}" "${PROFILE[@]}" \
            trainer.compile=true --compare policy.prompt_bucket=1 policy.prompt_bucket=32 ;;
        plan) run plan "${SUITE_LIMIT_PLAN:-240}" python3 benchmarks/plan_vs_measured.py "${PI05[@]}" trainer.compile=true \
            policy.gradient_checkpointing=false --sizes 12 16 ;;
        saved) run saved "${SUITE_LIMIT_SAVED:-200}" python3 benchmarks/saved_tensors.py "${PI05[@]}" trainer.compile=true \
            policy.gradient_checkpointing=false --micro 16 --top 25 ;;
        sac) run sac "${SUITE_LIMIT_SAC:-150}" python3 -m slurmvla.profile "${PI05[@]}" "${PROFILE[@]}" \
            trainer.grad_accum_steps=2 --compare policy.checkpoint_saves=inputs policy.checkpoint_saves=matmuls ;;
        batch) run batch "${SUITE_LIMIT_BATCH:-150}" python3 benchmarks/max_micro_batch.py --start 24 --limit 64 \
            --steps 1 "${PI05[@]}" data.num_workers=0 ;;
        load) run load "${SUITE_LIMIT_LOAD:-300}" python3 benchmarks/checkpoint_load.py --repeats 2 "${PI05[@]}" \
            data.num_workers=0 ;;
        lerobot) run lerobot "${SUITE_LIMIT_LEROBOT:-300}" python3 benchmarks/vs_lerobot.py --parts model \
            --device cuda --lerobot-python benchmarks/lerobot_python.sh --side-timeout 200 ;;
        rtc) run rtc "${SUITE_LIMIT_RTC:-200}" python3 benchmarks/rtc_cost.py "${PI05[@]}" --reps 20 \
            --json "$OUT/rtc_cost.json" ;;
        inference_tests) run inference_tests "${SUITE_LIMIT_INFERENCE_TESTS:-90}" python3 -m pytest -q -p no:cacheprovider \
            tests/test_gpu.py -k "graph or server or never_waits" ;;
        *) echo "unknown section $1; choose from tests latency unfused denoise jitter train compile efficient bucket plan saved sac batch load rtc inference_tests lerobot" >&2; exit 2 ;;
    esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/suite.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/suite.log"
for s in "${@:-tests latency train compile batch}"; do
    for one in $s; do section "$one"; done
done
