#!/usr/bin/env bash
#SBATCH --job-name=slurmvla-serve
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --output=slurm-%x-%j.out
#
# Serve a trained policy from a compute node over openpi's websocket protocol:
#
#   sbatch [--gpus-per-node=1] [--time=4:00:00] sbatch/serve.sh SOURCE [--port 8000] [OVERRIDES ...]
#
# SOURCE: an exported .safetensors file, a checkpoint folder or a run directory (see
# python -m slurmvla.serve --help). The job log prints the address a robot's client connects to, e.g.
#   serving .../step_00001500 (step 1500) on ws://gpu-node-7:8000 (ws://10.1.2.17:8000)
# scancel ends the server cleanly (SIGTERM). Submit from the repository root.
set -uo pipefail
cd "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}" || exit 2
PY=${PYTHON:-python3}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: sbatch/serve.sh runs inside a SLURM job: sbatch sbatch/serve.sh SOURCE ... (or run python -m slurmvla.serve SOURCE)" >&2
  exit 2
fi
echo "slurmvla: job $SLURM_JOB_ID serving on $(hostname)"
exec "$PY" -m slurmvla.serve "$@"
