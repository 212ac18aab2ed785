"""Checkpoints: atomic, newest-k kept, found again automatically on restart.

Layout under the run directory::

    checkpoints/step_00000100/   model.safetensors  optimizer.pt  trainer_state.pt  meta.json
    checkpoints/step_00000200/   ...

A checkpoint is written into a hidden ``.step_XXXXXXXX.tmp`` folder and renamed into place only
after every file is flushed, so a folder named ``step_*`` is complete by construction; a crash mid-
write leaves a temp folder that is ignored and cleaned up. Loading uses safetensors and
``torch.load(weights_only=True)``: a checkpoint is data and never runs pickled code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slurmvla.registry import ENGINES

TRAINER_FILE = "trainer_state.pt"
RANK_FILE = "rank_{rank:05d}.pt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints/`` folder), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest complete one in a run directory."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise ValueError(f"{str(path)!r} is neither a checkpoint folder (with {META_FILE}) nor a run directory holding one")


class CheckpointManager:
    def __init__(self, run_dir: Path, keep: int, is_main: bool):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.is_main = is_main

    def latest(self) -> Path | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def save(self, step: int, engine: Any, trainer_state: dict[str, Any], rank: int, rank_state: dict[str, Any]) -> Path:
        """Every rank calls this; ``rank_state`` (RNG streams) is per rank, the rest is written once."""
        final = self.root / f"step_{step:08d}"
        # The same name on every rank (each writes its shards into it); never a complete checkpoint.
        tmp = self.root / f".step_{step:08d}.tmp"
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        engine.save(tmp)
        torch.save(rank_state, tmp / RANK_FILE.format(rank=rank))
        _barrier()
        if self.is_main:
            torch.save(trainer_state, tmp / TRAINER_FILE)
            meta = {"step": step, "engine": engine.name, "precision": engine.precision,
                    "world_size": engine.env.world_size, "format": 1}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
            _fsync_tree(tmp)
            if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)

    def load(self, path: Path, engine: Any, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
        meta = json.loads((path / META_FILE).read_text())
        if meta["engine"] != engine.name:
            raise ValueError(
                f"checkpoint {path} was written by engine={meta['engine']!r}, this run uses engine={engine.name!r}; "
                "resume with the same engine, or export it (python -m slurmvla.export) and start from the weights"
            )
        if meta["world_size"] != engine.env.world_size and not ENGINES.get(engine.name).resumes_at_any_world_size:
            raise ValueError(
                f"checkpoint {path} was written at world size {meta['world_size']}, this run has "
                f"{engine.env.world_size}; engine={engine.name!r} resumes at the same world size only"
            )
        engine.load(path)
        state = torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True)
        rank_file = path / RANK_FILE.format(rank=rank)
        # A rank that did not exist when the checkpoint was written (resumed on more ranks) starts
        # fresh RNG streams; the training noise itself comes from the data and does not depend on them.
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=True) if rank_file.is_file() else {}
        return state, rank_state


def load_model_file(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full fp32 policy state of a checkpoint, whatever engine wrote it, in one process."""
    meta = json.loads((checkpoint / META_FILE).read_text())
    return ENGINES.get(meta["engine"]).load_full_state(checkpoint)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
