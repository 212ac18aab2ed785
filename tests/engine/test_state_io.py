"""The engine's two faces (slurmvla/engine/base.py): the step API (``Engine``) and the state I/O (``StateIO``), every
engine implementing both; and its checkpoint strategy, declared (``StateIO.checkpointing``) and agreeing with its
registry entry's ``background_save``. The checkpoint layer writes by the declared strategy alone: an engine that
happens to have a ``snapshot`` method but declares none is saved synchronously."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slurmvla.checkpoint import META_FILE, CheckpointManager
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.base import (
    BackgroundSave,
    Engine,
    SnapshotThenWrite,
    StateIO,
    StepSettings,
    Synchronous,
    TrainingEngine,
    WriteInBackground,
)
from slurmvla.engine.single import SingleEngine
from slurmvla.formats import CHECKPOINT
from slurmvla.launch import DistEnv
from slurmvla.registry import ENGINES, EngineEntry


def _declared(protocol: type) -> set[str]:
    """The methods and properties a protocol's own body declares."""
    return {n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}


STEP_API = {"prepare", "autocast", "backward", "no_sync", "clip_grad_norm", "step"}
STATE_IO = {"checkpointing", "model_state_dict", "master_tensors", "load_model_state_dict", "save", "load"}


def test_the_step_api_and_the_state_io_are_two_protocols():
    assert _declared(Engine) == STEP_API and _declared(StateIO) == STATE_IO
    assert not _declared(TrainingEngine) and set(TrainingEngine.__mro__) >= {Engine, StateIO}


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_engine_implements_both_and_declares_a_strategy_its_registry_entry_agrees_with(name):
    entry = ENGINES.get(name)
    cls = entry.load()
    found = {m: inspect.getattr_static(cls, m, None) for m in STEP_API | STATE_IO}
    missing = [m for m, v in found.items() if not (callable(v) or isinstance(v, property))]
    assert not missing and isinstance(found["checkpointing"], property), missing
    # The declaration reads no state: the strategy of a bare instance is the class's.
    bare = cls.__new__(cls)
    strategy = bare.checkpointing
    assert isinstance(strategy, (Synchronous, SnapshotThenWrite, WriteInBackground))
    assert type(strategy).background == entry.background_save, (name, strategy)
    call = strategy.snapshot if isinstance(strategy, SnapshotThenWrite) else \
        strategy.start if isinstance(strategy, WriteInBackground) else None
    assert call is None or call.__self__ is bare  # bound to this engine's own method


def test_a_built_engine_is_a_training_engine():
    engine = SingleEngine(EngineConfig(name="single"), DistEnv(), "fp32", torch.device("cpu"), StepSettings(1, 1, 0.0))
    assert isinstance(engine, TrainingEngine) and isinstance(engine, Engine) and isinstance(engine, StateIO)
    assert engine.checkpointing == SnapshotThenWrite(engine.snapshot)


class _Held:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Declares:
    """A state I/O that declares ``strategy`` and has a ``snapshot`` method whatever it declares."""

    name, precision = "declares", "fp32"
    env = SimpleNamespace(world_size=1)
    module = None

    def __init__(self, strategy: str):
        self.strategy = strategy

    @property
    def checkpointing(self) -> Synchronous | SnapshotThenWrite | WriteInBackground:
        if self.strategy == "background":
            return WriteInBackground(self.start)
        return SnapshotThenWrite(self.snapshot) if self.strategy == "snapshot" else Synchronous()

    def save(self, directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"written synchronously")

    def snapshot(self):  # noqa: ANN201
        def write(directory: Path) -> None:
            (directory / "weights.bin").write_bytes(b"written from the snapshot")

        return write

    def start(self, directory: Path) -> BackgroundSave:
        (directory / "weights.bin").write_bytes(b"written in the background")
        return BackgroundSave(finish=lambda: ["weights.bin"], group=None)


@pytest.mark.parametrize("strategy, background", [("snapshot", True), ("synchronous", False), ("background", True)])
def test_the_checkpoint_layer_writes_by_the_declared_strategy(strategy, background, monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(ENGINES._entries, Declares.name, EngineEntry(Declares.name, "x:y", background_save=True))
    manager = CheckpointManager(tmp_path, keep=2, engine=Declares(strategy), state=_Held(), rank_state=_Held(),
                                async_save=True)
    with caplog.at_level(logging.WARNING, logger="slurmvla"):
        for step in (1, 2):
            manager.save(step)
            manager.wait()
    final = tmp_path / "checkpoints" / "step_00000002"
    expected = {"snapshot": b"written from the snapshot", "synchronous": b"written synchronously",
                "background": b"written in the background"}[strategy]
    assert (final / "weights.bin").read_bytes() == expected and manager.background == background
    meta = json.loads((final / META_FILE).read_text())
    assert meta["files"]["weights.bin"]["bytes"] == len(expected)
    # Whichever strategy wrote it, the checkpoint records this release's checkpoint format (slurmvla/formats.py).
    assert meta["format"] == CHECKPOINT.current
    said = caplog.text.count("engine=declares cannot save in the background")
    assert said == (0 if background else 1)


def test_an_entry_without_background_save_keeps_a_background_strategy_synchronous(monkeypatch, tmp_path):
    """The registry entry is the opt-in (as for a plug-in registered without background_save)."""
    monkeypatch.setitem(ENGINES._entries, Declares.name, EngineEntry(Declares.name, "x:y"))
    manager = CheckpointManager(tmp_path, keep=2, engine=Declares("snapshot"), state=_Held(), rank_state=_Held(),
                                async_save=True)
    manager.save(1)
    assert (tmp_path / "checkpoints" / "step_00000001" / "weights.bin").read_bytes() == b"written synchronously"
    assert not manager.background
