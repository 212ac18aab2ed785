#!/usr/bin/env bash
# Build LeRobot 0.4.4 with openpi's patched transformers (transformers-openpi==4.53.3): a second
# reference oracle for pi0 / pi0.5, in a virtualenv of its own, never in slurmvla's.
#
#   bash tests/reference/make_env_lerobot044.sh [VENV_DIR]      # default: ../lerobot044 beside the checkout
#   VENV_DIR/bin/python tests/reference/compare_lerobot044.py   # writes tests/golden/lerobot061/agreement_lerobot044.json
#
# Recipe: shared/reference/lerobot-reference-env.md, "LeRobot 0.4.4 with openpi's patched transformers".
# Python 3.11 (pyenv). torch 2.10 + torchvision 0.25 go in first and are pinned with a constraints file,
# so no later step replaces them (an unpinned torchvision once pulled another torch). On Linux x86-64
# the registry's torch 2.10 is the CUDA build (nvidia wheels come with it); it runs on the CPU.
# lerobot 0.4.4 goes in with --no-deps (its own pins would fight transformers-openpi), then the
# packages its imports need, one by one. pip reports some of lerobot's pins (huggingface-hub,
# packaging, setuptools, ...) as unmet; the imports work. One catch: 0.4.4 decides whether transformers is
# installed from a distribution named "transformers", which transformers-openpi is not, so the check
# below (and compare_lerobot044.py) sets lerobot.utils.import_utils._transformers_available before
# importing the models. Nothing here is needed by the suite.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-../lerobot044}
PY311=${PY311:-"$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")/versions/3.11.7/bin/python3.11"}
[ -x "$PY311" ] || { echo "error: Python 3.11 not found at $PY311 (set PY311=/path/to/python3.11)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PY311" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.10.*" "torchvision==0.25.*" numpy
PINS=$(mktemp)
trap 'rm -f "$PINS"' EXIT
"$VENV/bin/python" -c "import importlib.metadata as m; print(f\"torch=={m.version('torch')}\ntorchvision=={m.version('torchvision')}\")" >"$PINS"
# lerobot 0.4.4's own pins for the packages installed below (it goes in with --no-deps, so pip would not
# apply them): unpinned, `datasets` pulls huggingface-hub 2.x, which transformers-openpi 4.53.3 and its
# tokenizers 0.21 do not support (< 1.0), and draccus / av / datasets newer than lerobot allows.
cat >>"$PINS" <<'PINS_EOF'
huggingface-hub>=0.34.2,<0.36.0
datasets>=4.0.0,<5.0.0
draccus==0.10.0
av>=15.0.0,<16.0.0
diffusers>=0.27.2,<0.36.0
deepdiff>=7.0.1,<9.0.0
PINS_EOF
"${PIP[@]}" -c "$PINS" "transformers-openpi==4.53.3"
"${PIP[@]}" -c "$PINS" --no-deps "lerobot==0.4.4"
"${PIP[@]}" -c "$PINS" draccus datasets pillow accelerate imageio einops av safetensors
"${PIP[@]}" -c "$PINS" --no-deps "diffusers>=0.27.2,<0.36.0" pyserial future iso8601 "deepdiff>=7.0.1,<9.0.0" orderly_set cachebox
"$VENV/bin/python" - "$PINS" <<'PY'
import importlib.metadata as m
import sys

import lerobot.utils.import_utils as iu

# 0.4.4 looks for a distribution named "transformers"; openpi's is "transformers-openpi", so the flag is
# False and the modeling modules would bind the transformers classes to None (the import alone succeeds).
# compare_lerobot044.py forces it, as here, before importing them.
seen = iu._transformers_available
iu._transformers_available = True
from lerobot.policies.pi0 import modeling_pi0  # noqa: E402
from lerobot.policies.pi0.modeling_pi0 import PI0Policy  # noqa: E402,F401
from lerobot.policies.pi05 import modeling_pi05  # noqa: E402
from lerobot.policies.pi05.modeling_pi05 import PI05Policy  # noqa: E402,F401
from transformers.models.siglip import check  # noqa: E402

for mod in (modeling_pi0, modeling_pi05):
    assert mod.PaliGemmaForConditionalGeneration is not None and mod.GemmaForCausalLM is not None, mod.__name__
assert check.check_whether_transformers_replace_is_installed_correctly()
print("lerobot's own transformers check:", seen, "(forced to True)")

pins = dict(line.strip().split("==") for line in open(sys.argv[1]) if line.startswith("torch"))
got = {k: m.version(k) for k in ("torch", "torchvision")}
assert got == pins, f"torch was replaced: pinned {pins}, now {got}"
print("reference env ok:", {k: m.version(k) for k in ("lerobot", "torch", "torchvision", "transformers-openpi",
                                                     "huggingface-hub", "datasets", "draccus")},
      "python", sys.version.split()[0])
PY
