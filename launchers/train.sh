#!/usr/bin/env bash
# Portable torchrun wrapper: works under any scheduler, or none.
#
#   bash launchers/train.sh [HYDRA_OVERRIDES ...]
#
# Environment (all optional):
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT  multi-node rendezvous (sbatch/*.sh exports them);
#                                             unset: exactly the single-node torchrun invocation
#   NPROC_PER_NODE                            processes per node (default: GPUS_PER_NODE, SLURM's
#                                             GPUs on the node, the CUDA device count, else 1)
#   EXTRA_TAIL_OVERRIDES                      Hydra overrides appended last (they win); shell-like
#                                             quoting ('key=a b'), never executed
#   DRY_RUN=1                                 print the command line instead of running it
# Works when run (bash launchers/train.sh) and when sourced.
_slurmvla_train() {
  local py=${PYTHON:-python3}
  local nproc tail_file
  nproc=$("$py" -m slurmvla.launch nproc-per-node) || return $?
  # torchrun (slurmvla.launch.torchrun: torch.distributed.run, but a run whose ranks all stopped for a requeue ends
  # with one line and exit code 75, not torchrun's failure report). The agent does not handle SIGTERM (SLURM's
  # preemption signal reaches every process of the step; the trainers checkpoint and stop, and the agent ends
  # with them instead of killing them 30 s later).
  local -a cmd=("$py" -m slurmvla.launch.torchrun "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT" "--nproc_per_node=$nproc")
  if [ -n "${NNODES:-}" ] && [ -n "${NODE_RANK:-}" ] && [ -n "${MASTER_ADDR:-}" ]; then
    cmd+=("--nnodes=$NNODES" "--node_rank=$NODE_RANK" "--master_addr=$MASTER_ADDR" "--master_port=${MASTER_PORT:-29500}")
  fi
  # Split by the library (shlex), not eval: the string is data. A malformed one stops here.
  tail_file=$(mktemp)
  if ! "$py" -m slurmvla.launch.overrides > "$tail_file"; then rm -f "$tail_file"; return 2; fi
  local -a tail=()
  readarray -d '' tail < "$tail_file"
  rm -f "$tail_file"
  cmd+=(-m slurmvla.train "$@" "${tail[@]}")
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf 'torchrun command:'; printf ' %q' "${cmd[@]}"; printf '\n'
    return 0
  fi
  # SIGTERM and USR2 (preemption, time limit) are for the training processes: ignored here and,
  # inherited through exec, by the torchrun agent, and by each trainer for the second before it
  # installs its own handler.
  trap '' TERM USR2
  "${cmd[@]}"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  _slurmvla_train "$@"
else
  _slurmvla_train "$@"
fi
