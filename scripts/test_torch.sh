#!/usr/bin/env bash
# The engines and checkpoints on another torch than the pinned one: the floor pyproject declares is a
# release this has passed on.
#
#   bash scripts/test_torch.sh 2.11.0 [VENV_DIR]      # default VENV_DIR: ../torch-<version>
#
# Builds VENV_DIR with that torch first (on x86-64 Linux the registry's wheel is the CUDA build: a few GB
# with its nvidia packages; it runs on the CPU), then this project with the same extras as the suite,
# then runs the tests that exercise every engine, checkpoint, resume and export path (the parity matrix
# over the reference policy, resume, the checker, EMA) on gloo. Not part of CI: the download is too
# large to repeat on every run; the note of the change that moves the floor records the result.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: bash scripts/test_torch.sh TORCH_VERSION [VENV_DIR]}
VENV=${2:-../torch-$VERSION}
PY=${PYTHON:-python3.11}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==$VERSION"
PINS=$(mktemp)
echo "torch==$VERSION" >"$PINS"
DS_BUILD_OPS=0 "${PIP[@]}" -c "$PINS" -e ".[dev,deepspeed,vla]"
"${PIP[@]}" -c "$PINS" -e examples/custom_policy
"${PIP[@]}" --no-deps openpi-client==0.1.2
rm -f "$PINS"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q \
  tests/test_distributed.py tests/test_train.py tests/engine/test_ema.py tests/policy/test_policy_check.py tests/engine/test_optim.py \
  -k "reference or not test_strategy_matches_single_process" "${@:3}"
