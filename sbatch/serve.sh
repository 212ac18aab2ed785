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
#
# The server listens on every interface of the node (serve.host=0.0.0.0: the robot connects from
# another machine), so give it an API key; then only clients that send it are served (HTTP 401/403
# before the websocket opens; GET /healthz stays open). Either
#   export SLURMVLA_API_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
#   sbatch sbatch/serve.sh SOURCE     # sbatch passes the submitting shell's environment (--export=ALL,
#                                     # the default; where the site sets SBATCH_EXPORT=NONE, add --export=ALL)
# or keep the key in a file on shared storage that only you can read, and name it:
#   (umask 077; python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > ~/.slurmvla_api_key)
#   sbatch sbatch/serve.sh SOURCE serve.api_key_file=$HOME/.slurmvla_api_key
# The key never appears in the job log. The robot's client passes it:
#   WebsocketClientPolicy(host, port, api_key=KEY)    # openpi_client: sends "Authorization: Api-Key KEY"
# Without a key the server still starts, with one warning line in the log. Requests are bounded
# (default: derived from the policy's observation size; --max-request-mb MB or serve.max_request_mb=MB).
set -uo pipefail
cd "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}" || exit 2
PY=${PYTHON:-python3}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: sbatch/serve.sh runs inside a SLURM job: sbatch sbatch/serve.sh SOURCE ... (or run python -m slurmvla.serve SOURCE)" >&2
  exit 2
fi
echo "slurmvla: job $SLURM_JOB_ID serving on $(hostname)"
exec "$PY" -m slurmvla.serve "$@"
