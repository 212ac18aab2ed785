"""The training application: compose the config -> build the Trainer -> fit -> close.

    python -m slurmvla.train                                  # debug mode: one process, GPU or CPU
    python -m slurmvla.train experiment=demo trainer.max_steps=50
    torchrun --nproc_per_node=K -m slurmvla.train engine=...  # several processes
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from slurmvla.config import to_config
from slurmvla.launch.preempt import REQUEUE_EXIT_CODE


def config_dir() -> Path:
    """conf/ inside an installed wheel, else the repository's top-level conf/ (editable install)."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float | None:
    from slurmvla.trainer import Trainer  # after Hydra has parsed the command line: --help stays fast

    trainer = Trainer(to_config(cfg), HydraConfig.get().runtime.output_dir)
    try:
        metrics = trainer.fit()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    if trainer.stopped_for_requeue:
        # Checkpoint written. Under submitit its handler requeues now (and exits on rank 0); on the
        # sbatch path the batch script requeues on this exit code (SystemExit passes Hydra).
        trainer.preempt.hand_over()
        sys.exit(REQUEUE_EXIT_CODE)
    return metrics.get("loss")


if __name__ == "__main__":
    main()
