#!/usr/bin/env bash
# Build the reference environment for openpi's training image augmentation: JAX (CPU) and augmax, the
# library openpi's preprocess_observation(train=True) calls (src/openpi/models/model.py), in a virtualenv
# of its own, never in slurmvla's.
#
#   bash tests/reference/make_env_openpi_aug.sh [VENV_DIR]          # default: ../openpi_aug beside the checkout
#   VENV_DIR/bin/python tests/reference/generate_augment_golden.py  # writes tests/golden/openpi_augment/
#
# Pins: augmax 0.4.1 is the version openpi's uv.lock resolves (Physical-Intelligence/openpi at 15a9616);
# jax 0.5.3 is openpi's jax pin, here its CPU build (openpi installs jax[cuda12]; the augmentation's
# arithmetic is the same XLA on the CPU). Nothing here is needed by the suite.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-../openpi_aug}
PY311=${PY311:-"$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.11.7/bin/python3.11"}
[ -x "$PY311" ] || { echo "error: Python 3.11 not found at $PY311 (set PY311=/path/to/python3.11)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY311" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    "jax==0.5.3" "jaxlib==0.5.3" "augmax==0.4.1" "einops==0.8.1" "numpy==2.2.6"
"$VENV/bin/python" -c "import jax, augmax, importlib.metadata as m; print('jax', jax.__version__, 'augmax', m.version('augmax'), jax.devices())"
