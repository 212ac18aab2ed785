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
# another machine), so it needs an API key (without one it refuses to start); then only clients that
# send it are served (HTTP 401/403 before the websocket opens; GET /healthz stays open). This script
# passes one:
#   - $SLURMVLA_API_KEY when it is set (sbatch passes the submitting shell's environment: --export=ALL,
#     the default; where the site sets SBATCH_EXPORT=NONE, add --export=ALL):
#       export SLURMVLA_API_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
#       sbatch sbatch/serve.sh SOURCE
#   - else the key in $SLURMVLA_API_KEY_FILE (default ~/.slurmvla_api_key, on storage the robot's machine
#     can read, or copy it there), created readable only by you (chmod 600) on first use, then reused, so a
#     robot keeps its key across jobs.
# Overrides that choose (serve.api_key_file=..., serve.api_key_env=..., serve.allow_unauthenticated=...) are
# passed as given. The key never appears in the job log; the log says where it is and how a client sends it:
#   WebsocketClientPolicy(host, port, api_key=KEY)    # openpi_client: sends "Authorization: Api-Key KEY"
#   SLURMVLA_API_KEY=$(cat ~/.slurmvla_api_key) python -m slurmvla.rollout ws://NODE:PORT
# Requests are bounded (default: derived from the policy's observation size; --max-request-mb MB or
# serve.max_request_mb=MB).
set -uo pipefail
cd "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}" || exit 2
PY=${PYTHON:-python3}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "error: sbatch/serve.sh runs inside a SLURM job: sbatch sbatch/serve.sh SOURCE ... (or run python -m slurmvla.serve SOURCE)" >&2
  exit 2
fi
echo "slurmvla: job $SLURM_JOB_ID serving on $(hostname)"

chosen=
for arg in "$@"; do
  case "$arg" in
    serve.api_key_file=* | serve.api_key_env=* | serve.allow_unauthenticated=*) chosen=1 ;;
  esac
done
KEY_ARGS=()
if [ -n "$chosen" ]; then
  :
elif [ -n "${SLURMVLA_API_KEY+set}" ]; then
  echo "slurmvla: API key from \$SLURMVLA_API_KEY; clients send it: WebsocketClientPolicy(host, port, api_key=KEY)" \
       "(header 'Authorization: Api-Key KEY'), python -m slurmvla.rollout reads \$SLURMVLA_API_KEY"
else
  KEY_FILE=${SLURMVLA_API_KEY_FILE:-$HOME/.slurmvla_api_key}
  if [ ! -s "$KEY_FILE" ]; then
    # Written to a private temporary file, then linked into place: a job starting at the same moment
    # never reads a half-written key, and an existing key is never replaced.
    tmp=$(umask 077 && mktemp "$KEY_FILE.XXXXXX") || { echo "error: cannot create the API key file $KEY_FILE" >&2; exit 1; }
    chmod 600 "$tmp"
    "$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' > "$tmp" && ln "$tmp" "$KEY_FILE" 2>/dev/null
    rm -f "$tmp"
    [ -s "$KEY_FILE" ] || { echo "error: cannot write the API key file $KEY_FILE" >&2; exit 1; }
    echo "slurmvla: wrote a new API key to $KEY_FILE (readable only by you)"
  fi
  KEY_ARGS=("serve.api_key_file=$KEY_FILE")
  echo "slurmvla: API key in $KEY_FILE; clients send it: WebsocketClientPolicy(host, port, api_key=KEY)" \
       "(header 'Authorization: Api-Key KEY'), or SLURMVLA_API_KEY=\$(cat $KEY_FILE) python -m slurmvla.rollout ws://..."
fi
exec "$PY" -m slurmvla.serve "$@" "${KEY_ARGS[@]}"
