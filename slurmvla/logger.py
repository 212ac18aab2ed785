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
        self._late_axis = False
        self._late: list[dict[str, float]] = []  # log_at's rows not yet written to wandb

    def start(self, resumed_step: int | None) -> None:
        """Open the sinks; on resume, drop records past the checkpoint so steps never repeat (``None``: keep every
        record: a program adding to a finished run's metrics, python -m slurmvla.eval_array gather)."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and resumed_step is not None:
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
            row = dict(metrics)
            if self._late and not any(k.startswith("rollout/") for k in row):
                row.update(self._late.pop(0))  # one earlier step's metrics rides along this row (log_at)
            self._wandb.log(row, step=step)

    def log_at(self, step: int, metrics: dict[str, float]) -> None:
        """Metrics of an earlier step, known only now (an evaluation gathered from a SLURM job array while training
        went on): metrics.jsonl gets them at ``step`` at once. wandb's steps only go up, so there they are drawn
        against their own axis, ``rollout/step`` (``wandb.define_metric``: every ``rollout/*`` chart), and written
        with the next training row that has no ``rollout/*`` of its own, one earlier step per row (at ``close``:
        the rest, one row each)."""
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._wandb is not None:
            if not self._late_axis:
                self._wandb.define_metric("rollout/step")
                self._wandb.define_metric("rollout/*", step_metric="rollout/step")
                self._late_axis = True
            self._late.append({**metrics, "rollout/step": step})

    def close(self) -> None:
        if self._wandb is not None:
            if self._late:
                self._wandb.log({}, commit=True)  # the open training row first: each rest on a row of its own
            for row in self._late:
                self._wandb.log(row)
            self._late = []
            self._wandb.finish()
            self._wandb = None
