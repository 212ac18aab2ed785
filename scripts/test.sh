#!/usr/bin/env bash
# Set up (with DeepSpeed: the ZeRO engines are tested for real; with transformers: pi0 / pi0.5; with MuJoCo: the
# closed loop; with peft: LoRA; with JAX + orbax: openpi's checkpoint directory; torchao beside them:
# serve.fp8_prefix) and run the whole test suite. Extra arguments go to pytest, e.g.  bash scripts/test.sh -k resume
set -euo pipefail
cd "$(dirname "$0")/.."
# The example policy package and the Meta-World study's plug-in are installed as a user installs their own (the
# plug-in tests train them), in the same call.
bash scripts/install.sh dev,deepspeed,vla,sim,lora,openpi examples/custom_policy examples/metaworld_study
# torchao (the [fp8] extra: serve.fp8_prefix) beside the environment, not in it: transformers imports it whenever it is
# installed, +0.45 s in every process that builds pi0 / pi0.5; tests/inference/test_fp8.py puts this folder on its own path.
[ -d .test-deps/torchao/torchao ] || "${PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target .test-deps/torchao torchao==0.18.0
# Three workers (pytest-xdist) on two cores: the SLURM tests (one worker, about 10 minutes) mostly wait on the
# cluster's timers and jobs, so the other two keep both cores busy meanwhile (docs/testing.md has the figures).
# tests/conftest.py keeps together the tests that share a module's fixture (one SLURM cluster, one parity job per
# policy). SLURMVLA_TEST_WORKERS=N sets the number; 0 runs the suite in this one process.
exec "${PYTHON:-python3}" -m pytest -n "${SLURMVLA_TEST_WORKERS:-3}" --dist loadgroup "$@"
