#!/usr/bin/env bash
#SBATCH --job-name=droid
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --signal=USR2@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
#
# DROID post-training (conf/experiment/droid.yaml) across nodes:
#
#   DROID_ROOT=/data/droid_1.0.1 KEEP_RANGES_PATH=/data/keep_ranges_1_0_1.json \
#   EPISODE_ID_TO_PATH=/data/episode_id_to_path.json sbatch --gpus-per-node=8 sbatch/droid.sh [OVERRIDES]
#   EXPERIMENT=pi05_droid ... sbatch/droid.sh policy.pretrained_path=...    # openpi's pi0.5 recipe
#
# Everything sbatch/train.sh documents applies; this only picks the DROID wrapper.
export LAUNCHER=launchers/droid.sh SLURMVLA_SBATCH_SCRIPT=${SLURMVLA_SBATCH_SCRIPT:-$0} SLURMVLA_JOB_NAME=droid
exec bash "${SLURMVLA_HOME:-${SLURM_SUBMIT_DIR:-.}}/sbatch/train.sh" "$@"
