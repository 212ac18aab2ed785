#!/usr/bin/env bash
# Set up (with DeepSpeed: the ZeRO engines are tested for real) and run the whole test suite. Extra arguments go to pytest, e.g.  bash scripts/test.sh -k resume
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev,deepspeed
exec "${PYTHON:-python3}" -m pytest "$@"
