#!/usr/bin/env bash
# The closed loop on one machine: record the scripted expert's demonstrations of the simulated pick task
# (once, into $SLURMVLA_CACHE), train a policy on them from scratch (experiment=sim_pick), then roll it out
# through the policy server and openpi's client and print its success rate with a 95% interval.
#   bash scripts/sim_demo.sh                      # the keypoint policy (policy=keypoints)
#   bash scripts/sim_demo.sh policy=pi05_tiny     # pi0.5's code path at toy size
#   bash scripts/sim_demo.sh policy=custom policy.target=slurmvla.policy.baselines.MeanChunkPolicy   # the baseline
# Extra arguments are Hydra overrides of the training run; RUN_DIR (default outputs/sim_pick/<date>_<time>)
# is its run directory, ROLLOUT_ARGS (e.g. "rollout.episodes=100") go to the rollout.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh sim
PY=${PYTHON:-python3}
CACHE=${SLURMVLA_CACHE:-$HOME/.cache/slurmvla}
DATA=$CACHE/sim_pick_r2_150ep
if [ ! -f "$DATA/meta/info.json" ]; then
  "$PY" -m slurmvla.sim.record --out "$DATA" --episodes 150 --noise 0.15
fi
RUN_DIR=${RUN_DIR:-outputs/sim_pick/$(date +%Y-%m-%d_%H-%M-%S)}
"$PY" -m slurmvla.train experiment=sim_pick "data.root=$DATA" "hydra.run.dir=$RUN_DIR" "$@"
# shellcheck disable=SC2086 # ROLLOUT_ARGS are separate overrides
"$PY" -m slurmvla.rollout "$RUN_DIR" ${ROLLOUT_ARGS:-}
