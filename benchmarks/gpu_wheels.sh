#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12, torch and no internet (benchmarks/gpu_suite.sh there):
# slurmvla's dependencies that such an image lacks into .whl/, and LeRobot 0.6.1's (for
# benchmarks/vs_lerobot.py --device cuda, run through benchmarks/lerobot_python.sh) into .whl_lerobot/.
# Both folders are ignored by git; carry them to the machine and install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
get() {  # get FOLDER NAME==VERSION ...
    local dir=$1
    shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@"
}
# omegaconf's parser runtime is published as source only: built here (pure Python) into a wheel.
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
get .whl hydra-core==1.3.2 omegaconf==2.3.0 submitit==1.5.4 \
    hydra-submitit-launcher==1.2.0 av==18.1.0 transformers==5.23.0 openpi-client==0.1.2 websockets==15.0.1 \
    dm-tree==0.1.10 torchao==0.18.0
# LeRobot 0.6.1's pi0.5 path needs transformers < 5.6 (its pi_gemma passes cache_position to
# create_causal_mask, which later releases no longer take): 5.5.4, beside slurmvla's 5.23.0 in its own folder.
get .whl_lerobot lerobot==0.6.1 transformers==5.5.4 draccus==0.11.6 toml==0.10.2 mergedeep==1.3.4 \
    gymnasium==1.4.0 farama-notifications==0.0.6
du -sh .whl .whl_lerobot
