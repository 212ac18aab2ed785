#!/usr/bin/env bash
# The LeRobot 0.6.1 side of benchmarks/vs_lerobot.py on the GPU machine (no internet there):
#   python3 benchmarks/vs_lerobot.py --device cuda --lerobot-python benchmarks/lerobot_python.sh
# Installs .whl_lerobot/*.whl once into /tmp/site_lerobot (lerobot 0.6.1, draccus and its deps, gymnasium,
# transformers 5.5.4: LeRobot 0.6.1's pi_gemma calls create_causal_mask(cache_position=...), which the
# machine's transformers 5.17 no longer takes), then runs the machine's python3 (its torch, tokenizers,
# accelerate, numpy, huggingface_hub) with that folder first on the path, never /tmp/site (slurmvla's
# transformers 5.23).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=/tmp/site_lerobot
if [ ! -d "$SITE" ]; then
    rm -rf "$SITE.tmp"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE.tmp" "$ROOT"/.whl_lerobot/*.whl >&2
    # transformers 5.5.4 pins tokenizers<=0.23.0 at import; the machine has 0.23.2 (a patch release).
    sed -i 's/"tokenizers>=0.22.0,<=0.23.0"/"tokenizers>=0.22.0,<0.24"/' "$SITE.tmp/transformers/dependency_versions_table.py"
    mv "$SITE.tmp" "$SITE"
fi
exec env PYTHONPATH="$SITE:$ROOT" HF_HUB_OFFLINE=1 python3 "$@"
