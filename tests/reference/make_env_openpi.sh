#!/usr/bin/env bash
# Build the reference environment that writes the tiny openpi checkpoints: JAX (CPU) and orbax-checkpoint,
# the library openpi saves and restores its parameter trees with (src/openpi/training/checkpoints.py,
# src/openpi/models/model.py restore_params), in a virtualenv of its own, never in slurmvla's.
#
#   bash tests/reference/make_env_openpi.sh [VENV_DIR]                 # default: ../openpi_ckpt beside the checkout
#   VENV_DIR/bin/python tests/reference/generate_openpi_checkpoint.py  # writes tests/golden/openpi_tiny_{pi0,pi05}/
#
# Pins: openpi's own (Physical-Intelligence/openpi at 15a9616, pyproject.toml / uv.lock): jax 0.5.3 (here its
# CPU build; openpi installs jax[cuda12]), orbax-checkpoint 0.11.13, tensorstore 0.1.74. numpy only besides:
# the generator builds the parameter tree with numpy and writes the expected tensors as .npz.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-../openpi_ckpt}
PY311=${PY311:-"$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.11.7/bin/python3.11"}
[ -x "$PY311" ] || { echo "error: Python 3.11 not found at $PY311 (set PY311=/path/to/python3.11)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY311" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "jax[cpu]==0.5.3" "jaxlib==0.5.3" "orbax-checkpoint==0.11.13" "tensorstore==0.1.74" "numpy==2.2.6"
"$VENV/bin/python" -c "import jax, importlib.metadata as m; print({k: m.version(k) for k in ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', 'numpy')}, jax.devices())"
