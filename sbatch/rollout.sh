#!/usr/bin/env bash
#SBATCH --job-name=slurmvla-rollout
#SBATCH --nodes=2
#SBATCH --ntasks=3
#SBATCH --output=slurm-%x-%j.out
#
# Closed loop on a cluster: the policy server on the job's first node (its GPU when it has one), the
# simulated environments on the job's other tasks (CPU), reaching the server by node name:
#
#   sbatch [--nodes=N] [--ntasks=T] [--gpus-per-node=1] sbatch/rollout.sh SOURCE [OVERRIDES ...]
#
# SOURCE: a run directory, checkpoint folder or exported file (python -m slurmvla.serve takes it).
# rollout.* overrides go to every environment task, the others to the server (e.g. serve.device=cuda).
# Task 0 serves; tasks 1..T-1 each run every (T-1)-th episode (python -m slurmvla.rollout --shard) through
# openpi's client; the batch script merges their summaries into ROLLOUT_DIR/rollout.json (default
# outputs/rollout/<job id>) and prints the success rate. Environment: ROLLOUT_PORT (default 8000 +
# job id % 1000), SLURMVLA_API_KEY (the server requires it and the clients send it; when it is unset the
# job makes one of its own, kept in the job's environment: the server listens beyond its node).
# Submit from the repository root; install with bash scripts/install.sh sim on the nodes' environment.
set -uo pipefail
cd "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}" || exit 2
PY=${PYTHON:-python3}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: sbatch/rollout.sh runs inside a SLURM job: sbatch sbatch/rollout.sh SOURCE ... (or python -m slurmvla.rollout SOURCE)" >&2
  exit 2
fi
if [ $# -lt 1 ]; then
  echo "error: give a SOURCE: sbatch sbatch/rollout.sh RUN_DIR [rollout.episodes=50 ...]" >&2
  exit 2
fi
SOURCE=$1
shift
SERVE_ARGS=()
ROLLOUT_ARGS=()
for arg in "$@"; do
  case "$arg" in
    rollout.*) ROLLOUT_ARGS+=("$arg") ;;
    *) SERVE_ARGS+=("$arg") ;;
  esac
done
NTASKS=${SLURM_NTASKS:-1}
if [ "$NTASKS" -lt 2 ]; then
  echo "error: --ntasks=$NTASKS: one task serves and at least one more runs environments (e.g. --ntasks=3)" >&2
  exit 2
fi
CLIENTS=$((NTASKS - 1))
SERVER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=${ROLLOUT_PORT:-$((8000 + SLURM_JOB_ID % 1000))}
OUT=${ROLLOUT_DIR:-outputs/rollout/$SLURM_JOB_ID}
mkdir -p "$OUT"
echo "slurmvla: job $SLURM_JOB_ID: server on $SERVER_NODE:$PORT, $CLIENTS environment task(s), results in $OUT"

# The server listens on the node's every interface, so it needs a key: the environment's, else one for this
# job only, which the server and the environment tasks inherit (never printed).
if [ -z "${SLURMVLA_API_KEY+set}" ]; then
  SLURMVLA_API_KEY=$("$PY" -c 'import secrets; print(secrets.token_urlsafe(32))') || exit 1
  export SLURMVLA_API_KEY
fi

# The server: one task on the first node, with the node's GPUs; ended by PID below, also on failure.
srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE" --exact --kill-on-bad-exit=1 \
  "$PY" -m slurmvla.serve "$SOURCE" --host 0.0.0.0 --port "$PORT" "${SERVE_ARGS[@]}" > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() { kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; }
trap stop_server EXIT
for _ in $(seq 1 600); do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "error: the policy server exited before listening; its log:" >&2
    tail -n 20 "$OUT/server.log" >&2
    exit 1
  fi
  grep -q "^serving " "$OUT/server.log" 2>/dev/null && break
  sleep 0.5
done
grep -q "^serving " "$OUT/server.log" || { echo "error: the policy server did not listen within 300 s" >&2; exit 1; }

# The environments: every task but the server's, each its shard of the episodes.
srun --ntasks="$CLIENTS" --exact --kill-on-bad-exit=1 bash -c \
  'exec "$0" -m slurmvla.rollout "ws://$1:$2" --shard "$SLURM_PROCID/$3" rollout.out="$4" "${@:5}"' \
  "$PY" "$SERVER_NODE" "$PORT" "$CLIENTS" "$OUT" "${ROLLOUT_ARGS[@]}"
status=$?
if [ $status -ne 0 ]; then
  echo "error: an environment task failed (exit $status)" >&2
  exit $status
fi
"$PY" -m slurmvla.rollout --merge "$OUT"/rollout_shard*of"$CLIENTS".json --out "$OUT/rollout.json"
