#!/usr/bin/env bash
# Build LeRobot 0.6.1 (the pi0 / pi0.5 test oracle, and the other side of benchmarks/vs_lerobot.py) in a virtualenv of its own, never in slurmvla's.
#
#   bash tests/reference/make_env.sh [VENV_DIR]      # default: ../lerobot061 beside the checkout
#   VENV_DIR/bin/python tests/reference/generate_pi0_golden.py    # then writes tests/golden/lerobot061/
#   python tests/reference/interop_lerobot.py                      # datasets both ways (docs/data.md)
#
# Python 3.12 (LeRobot 0.6.1 needs >= 3.12; pyenv has it), torch pinned first with a constraints file
# so lerobot's requirements never pull a second torch. On Linux x86-64 the registry's torch 2.11.0 is
# the CUDA build; it runs on the CPU. Nothing here is needed by the suite: the generator's outputs are
# committed, and the suite compares against them.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-../lerobot061}
PY312=${PY312:-"$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.12.1/bin/python3.12"}
[ -x "$PY312" ] || { echo "error: Python 3.12 not found at $PY312 (set PY312=/path/to/python3.12)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
# torchcodec (LeRobot's default video decoder) loads FFmpeg's shared libraries from the system.
if ! ldconfig -p | grep -q libavcodec.so && command -v apt-get >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get install -y --no-install-recommends libavcodec59 libavformat59 libavutil57 libswscale6 \
        libswresample4 libavfilter8 libavdevice59 >/dev/null
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.11.0" "torchvision==0.26.0"
PINS=$(mktemp)
"$VENV/bin/python" -c "import importlib.metadata as m; print(f\"torch=={m.version('torch')}\ntorchvision=={m.version('torchvision')}\")" >"$PINS"
"${PIP[@]}" -c "$PINS" "lerobot[pi,dataset]==0.6.1" safetensors psutil
rm -f "$PINS"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
from lerobot.policies.pi0.modeling_pi0 import PI0Policy  # noqa: F401
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: F401
print("reference env ok:", {k: m.version(k) for k in ("lerobot", "torch", "transformers")})
PY
