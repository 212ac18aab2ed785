#!/usr/bin/env bash
# DROID post-training on top of launchers/train.sh.
#
#   KEEP_RANGES_PATH=/data/keep_ranges_1_0_1.json DROID_ROOT=/data/droid_1.0.1 bash launchers/droid.sh [OVERRIDES]
#
#   EXPERIMENT         the recipe (default droid; pi05_droid: openpi's pi0.5 fine-tuning, conf/experiment/)
#   DROID_ROOT         the LeRobot DROID copy (default: the experiment's data.root)
#   KEEP_RANGES_PATH   turns on the keep-ranges idle filter; unset: off; a missing file fails now
#   EPISODE_ID_TO_PATH the episode_id -> relative path mapping published beside the keep-ranges file
# plus everything launchers/train.sh reads (NNODES, NPROC_PER_NODE, EXTRA_TAIL_OVERRIDES, DRY_RUN...).
_slurmvla_droid() {
  local py=${PYTHON:-python3}
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  local -a extra=("experiment=${EXPERIMENT:-droid}")
  [ -n "${DROID_ROOT:-}" ] && extra+=("data.root=$DROID_ROOT")
  if [ -n "${KEEP_RANGES_PATH:-}" ]; then
    "$py" -m slurmvla.launch check-file KEEP_RANGES_PATH "$KEEP_RANGES_PATH" || return 2
    extra+=("data.keep_ranges.path=$KEEP_RANGES_PATH")
  fi
  if [ -n "${EPISODE_ID_TO_PATH:-}" ]; then
    "$py" -m slurmvla.launch check-file EPISODE_ID_TO_PATH "$EPISODE_ID_TO_PATH" || return 2
    extra+=("data.keep_ranges.episode_id_to_path=$EPISODE_ID_TO_PATH")
  fi
  source "$here/train.sh" "${extra[@]}" "$@"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  _slurmvla_droid "$@"
else
  _slurmvla_droid "$@"
fi
