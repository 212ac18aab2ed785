"""Metrics: ``metrics.jsonl`` in the run directory, wandb (offline by default), rank 0 only."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from slurmvla.config import WandbConfig

WANDB_ID_FILE = "wandb_run_id.txt"


class MetricLogger:
    def __init__(self, run_dir: Path, wandb_cfg: WandbConfig, run_name: str, config: dict[str, Any], enabled: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.wandb_cfg = wandb_cfg
        self.run_name = run_name
        self.config = config
        self.run_dir = Path(run_dir)
        self._wandb = None

    def start(self, resumed_step: int) -> None:
        """Open the sinks; on resume, drop records past the checkpoint so steps never repeat."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resumed_step]
            self.path.write_text("".join(f"{line}\n" for line in kept))
        if self.wandb_cfg.mode != "disabled":
            import wandb

            # One id per run directory: a resumed run continues the same wandb run.
            id_file = self.run_dir / WANDB_ID_FILE
            if not id_file.exists():
                id_file.write_text(uuid.uuid4().hex[:12])
            self._wandb = wandb.init(
                project=self.wandb_cfg.project, entity=self.wandb_cfg.entity, name=self.run_name,
                id=id_file.read_text().strip(), resume="allow", mode=self.wandb_cfg.mode,
                dir=str(self.run_dir), config=self.config, tags=list(self.wandb_cfg.tags),
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
