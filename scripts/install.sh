#!/usr/bin/env bash
# Install slurmvla (editable) and its dependencies into the active Python environment.
#
#   bash scripts/install.sh          # runtime dependencies
#   bash scripts/install.sh dev      # + test tools        (extras are comma separated: dev,deepspeed)
#   bash scripts/install.sh sim      # + the closed loop: MuJoCo, openpi's client, and (as root, with apt)
#                                    #   the EGL libraries MuJoCo renders offscreen with
#   bash scripts/install.sh dev examples/custom_policy   # more editable packages, in the same pip call
#
# torch is installed first and exactly once: an environment that already has torch keeps it (a
# cluster's CUDA build stays); otherwise torch==$TORCH_VERSION (default 2.13.0) is installed, which
# resolves to the CUDA wheel on a GPU cluster and to the local CPU build on a CPU-only machine.
# Set TORCH_VERSION to replace an installed torch with that version.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${1:-}
ALSO=()
for path in "${@:2}"; do ALSO+=(-e "$path"); done
PIP=("$PYTHON" -m pip install --quiet --disable-pip-version-check)
# Versions from the installed packages' metadata: importing torch to ask costs seconds.
version_of() { "$PYTHON" -c "from importlib.metadata import version; print(version('$1'))" 2>/dev/null || true; }

have=$(version_of torch)
if [ -n "${TORCH_VERSION:-}" ] && [ "${have%%+*}" != "$TORCH_VERSION" ]; then
  "${PIP[@]}" "torch==$TORCH_VERSION"
elif [ -z "$have" ]; then
  "${PIP[@]}" "torch==2.13.0"
fi
# DeepSpeed (the [deepspeed] extra) compiles its ops just in time when they are used; building them
# at install time would need CUDA. TORCH_EXTENSIONS_DIR caches what it compiles.
export DS_BUILD_OPS=${DS_BUILD_OPS:-0}
# The editable builds use this environment's setuptools when it is new enough (pyproject.toml's build-system):
# an isolated build environment per package costs several seconds each.
BUILD=()
if "$PYTHON" -c "from importlib.metadata import version; assert int(version('setuptools').split('.')[0]) >= 71" 2>/dev/null; then
  BUILD=(--no-build-isolation)
fi
# (${A[@]+"${A[@]}"}: an empty array under set -u, which bash before 4.4 calls unbound.)
"${PIP[@]}" ${BUILD[@]+"${BUILD[@]}"} -e ".${EXTRAS:+[$EXTRAS]}" ${ALSO[@]+"${ALSO[@]}"}
if [[ ",$EXTRAS," == *",dev,"* ]] && ! command -v c++ >/dev/null; then
  # torch.compile on the CPU (trainer.compile, serve.compile; their tests) builds C++ with the system's compiler.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
  else
    echo "slurmvla: torch.compile on the CPU needs a C++ compiler (Debian/Ubuntu: apt-get install g++)" >&2
  fi
fi
if [[ ",$EXTRAS," == *",sim,"* ]]; then
  # MuJoCo renders offscreen through EGL: Mesa's (llvmpipe on a CPU machine; a GPU node's driver has its own).
  if ! ldconfig -p 2>/dev/null | grep -q 'libEGL_mesa.so\|libEGL_nvidia.so'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libegl1 libegl-mesa0 libgl1-mesa-dri >/dev/null
    else
      echo "slurmvla: the simulator renders through EGL; install Mesa's (Debian/Ubuntu: apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri)" >&2
    fi
  fi
  # openpi's client pins numpy<2 although its code runs on numpy 2: --no-deps keeps this environment's numpy.
  "${PIP[@]}" --no-deps openpi-client==0.1.2
fi
echo "slurmvla installed with torch $(version_of torch)"
