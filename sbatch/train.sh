#!/usr/bin/env bash
#SBATCH --job-name=slurmvla
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
#
# Multi-node training: one SLURM task per node, each runs $LAUNCHER (torchrun fans out per GPU).
#
#   sbatch [--nodes=N] [--gpus-per-node=G] [--partition=P] [--time=T] sbatch/train.sh [HYDRA_OVERRIDES ...]
#
# sbatch options on the command line override the #SBATCH lines above; the same file runs on a GPU
# cluster (--gpus-per-node=8) and on a CPU one (NPROC_PER_NODE=2). Submit from the repository root.
# Environment (exported to the job by sbatch):
#   NPROC_PER_NODE         processes per node (default: GPUs on the node, else 1)
#   RUN_DIR                run directory (default outputs/<job name>/<job id>: stable across requeues)
#   SLURMVLA_MAX_RESTARTS  requeue budget (default 3), counted by SLURM_RESTART_COUNT (also for SLURM's own
#                          requeue after a node failure)
#   EXTRA_TAIL_OVERRIDES   Hydra overrides appended last (quoted values work; never executed)
#   LAUNCHER               the per-node wrapper (default launchers/train.sh)
#   DRY_RUN=1              print the srun and torchrun command lines, run nothing
#   SLURMVLA_SIGNAL_DELAY_S  the @seconds of --signal above (default 120; SLURM does not tell a job its
#                          --signal): the trainer warns when a checkpoint does not fit in it
# Signals. USR2 arrives 120 s before the time limit; on preemption SLURM sends SIGTERM (or USR2 where the
# site sets preempt_send_user_signal) and SIGKILL when the partition's GraceTime ends. Either way the
# trainer checkpoints at the next step (or validation batch), the step ends, and this script requeues
# the job until the run is finished or the budget is spent (SLURM itself requeues a preempted job only
# if it is still running when the grace time ends). A checkpoint must fit in the time between the
# signal and the kill: the trainer measures its saves and warns when they do not fit in
# SLURMVLA_SIGNAL_DELAY_S or the partition's GraceTime; then ask for --signal=USR2@<more> (and set
# SLURMVLA_SIGNAL_DELAY_S to match). A lost node ends the step (the surviving ranks fail fast, naming the
# rank that went away); SLURM declares the node down and requeues the job, which resumes from the newest
# complete checkpoint.
set -uo pipefail
cd "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}" || exit 2
PY=${PYTHON:-python3}
LAUNCHER=${LAUNCHER:-launchers/train.sh}

if [ -z "${SLURM_JOB_ID:-}" ]; then
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf 'sbatch command:'; printf ' %q' sbatch "${SLURMVLA_SBATCH_SCRIPT:-$0}" "$@"; printf '\n'
    export SLURM_JOB_ID=0 SLURM_JOB_NAME=${SLURMVLA_JOB_NAME:-slurmvla} SLURM_NNODES=${SLURM_NNODES:-2} SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-node[1-2]}
  else
    echo "error: sbatch/train.sh runs inside a SLURM job: sbatch sbatch/train.sh ... (or DRY_RUN=1 bash sbatch/train.sh)" >&2
    exit 2
  fi
fi

export SLURMVLA_SIGNAL_DELAY_S=${SLURMVLA_SIGNAL_DELAY_S:-120}
# A signal meant for the batch shell (scancel --batch, --signal=B:...) must not end it before the
# training step has checkpointed and this script has requeued: bash runs these after srun returns.
trap 'echo "slurmvla: the batch script got SIGTERM; waiting for the training step"' TERM
trap 'echo "slurmvla: the batch script got SIGUSR2; waiting for the training step"' USR2

# SLURM requeues a --requeue job by itself after a node failure: the restart budget holds for those too.
[ "${DRY_RUN:-0}" = 1 ] || "$PY" -m slurmvla.launch check-budget || exit 1

# The node count comes from SLURM, never typed twice; the library picks address and port.
export NNODES=$SLURM_NNODES
MASTER_ADDR=$("$PY" -m slurmvla.launch master-addr) || exit 2
MASTER_PORT=$("$PY" -m slurmvla.launch master-port) || exit 2
export MASTER_ADDR MASTER_PORT
RUN_DIR=${RUN_DIR:-outputs/${SLURM_JOB_NAME}/${SLURM_JOB_ID}}

# NODE_RANK is read inside each task ($SLURM_NODEID of that task), not here at submit time.
srun_cmd=(srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c 'export NODE_RANK=$SLURM_NODEID; exec bash "$0" "$@"'
          "$LAUNCHER" "hydra.run.dir=$RUN_DIR" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf 'srun command:'; printf ' %q' "${srun_cmd[@]}"; printf '\n'
  printf 'environment: NNODES=%s MASTER_ADDR=%s MASTER_PORT=%s RUN_DIR=%s EXTRA_TAIL_OVERRIDES=%q\n' \
    "$NNODES" "$MASTER_ADDR" "$MASTER_PORT" "$RUN_DIR" "${EXTRA_TAIL_OVERRIDES:-}"
  NODE_RANK=0 bash "$LAUNCHER" "hydra.run.dir=$RUN_DIR" "$@"
  exit $?
fi
echo "slurmvla: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST; master $MASTER_ADDR:$MASTER_PORT; run dir $RUN_DIR"
"${srun_cmd[@]}"
rc=$?
"$PY" -m slurmvla.launch requeue "$RUN_DIR" "$rc"
