#!/usr/bin/env bash
# Set up and run the demo: local debug training of the tiny reference policy on the DROID-format
# sample dataset (written into ~/.cache/slurmvla on first use). Uses the GPU when there is one.
# Extra arguments are Hydra overrides, e.g.  bash scripts/demo.sh trainer.max_steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m slurmvla.train experiment=demo "$@"
