#!/usr/bin/env bash
# Set up and run the demo: local debug training of the tiny reference policy on the DROID-format
# sample dataset (written into ~/.cache/slurmvla on first use), then open-loop evaluation of the
# trained policy on the held-out episodes (metrics.json and plots under RUN_DIR/eval/). Uses the GPU
# when there is one. Extra arguments are Hydra overrides, e.g.  bash scripts/demo.sh trainer.max_steps=100
# (bash scripts/demo.sh policy=pi05_tiny: the same demo with pi0.5's code path at toy size).
# RUN_DIR (default outputs/demo/<date>_<time>) is the run directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh eval,vla
PY=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-outputs/demo/$(date +%Y-%m-%d_%H-%M-%S)}
"$PY" -m slurmvla.train experiment=demo "hydra.run.dir=$RUN_DIR" "$@"
"$PY" -m slurmvla.evaluate "$RUN_DIR"
echo "serve it to openpi's client: python -m slurmvla.serve $RUN_DIR --host 127.0.0.1   (pip install -e '.[serve]'; beyond this machine: SLURMVLA_API_KEY, docs/serving.md)"
