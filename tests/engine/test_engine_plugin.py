"""A new engine is one module plus one registry entry. This module is such a module: an engine class and its
memory rule, registered (for the tests here only) under a name no conf/engine/ file has. It trains through the
trainer and ``python -m slurmvla.plan`` plans it, neither of them edited for it.
"""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest

from slurmvla import plan
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.memory import States, Tensors
from slurmvla.engine.single import SingleEngine
from slurmvla.engine.single import model_states as replicated_states
from slurmvla.registry import ENGINES, EngineEntry
from slurmvla.trainer import Trainer

NAME = "counting"
PROBE_BYTES = 3 * 2**20


class CountingEngine(SingleEngine):
    """The single engine, counting its optimizer steps and holding a probe buffer of ``probe_bytes`` (an
    option of its registry entry, given to the class and to its memory rule alike)."""

    def __init__(self, *args, probe_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.probe_bytes, self.steps = probe_bytes, 0

    def step(self) -> None:
        super().step()
        self.steps += 1


def model_states(cfg: EngineConfig, precision: str, t: Tensors, world: int, gpus_per_node: int,
                 probe_bytes: int) -> States:
    """The single engine's states, and the probe buffer through forward and backward."""
    states = replicated_states(cfg, precision, t, world, gpus_per_node)
    states.forward_backward["probe buffer"] = probe_bytes
    return states


@pytest.fixture
def counting(monkeypatch):
    """The engine registered for one test, and gone after it."""
    entry = EngineEntry(NAME, f"{__name__}:CountingEngine", MappingProxyType({"probe_bytes": PROBE_BYTES}),
                        multi_process=False, memory_rule=f"{__name__}:model_states")
    monkeypatch.setitem(ENGINES._entries, NAME, entry)
    return entry


def test_the_new_engine_trains(counting, make_cfg, tmp_path):
    cfg = make_cfg(f"engine.name={NAME}", "trainer.max_steps=3", "checkpoint.every_steps=0", "data.loader=map")
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.fit()
        assert isinstance(trainer.engine, CountingEngine)
        assert trainer.engine.steps == 3 and trainer.engine.probe_bytes == PROBE_BYTES
    finally:
        trainer.close()


def test_the_planner_plans_the_new_engine_by_its_rule(counting, capsys, tmp_path):
    out = tmp_path / "plan.json"
    plan.main(["policy=tiny", f"engine.name={NAME}", "--compare", "--json", str(out)])
    text = capsys.readouterr().out
    assert f"engine={NAME}" in text and "probe buffer" in text
    rows = {r["engine"]: r for r in json.loads(out.read_text())["plans"]}
    assert set(rows) == set(ENGINES) and not any("refused" in r for r in rows.values())
    ours, single = rows[NAME], rows["single"]
    assert ours["held_bytes"] == single["held_bytes"]
    # Its rule is the single engine's plus the probe: gradients made in backward as single's are.
    assert ours["forward_backward_bytes"] == {**single["forward_backward_bytes"], "probe buffer": PROBE_BYTES}
    assert ours["peak_bytes"] == single["peak_bytes"] + PROBE_BYTES


def test_an_engine_without_memory_rules_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(ENGINES._entries, "unplanned",
                        EngineEntry("unplanned", "slurmvla.engine.single:SingleEngine", multi_process=False))
    with pytest.raises(SystemExit) as e:
        plan.main(["policy=tiny", "engine.name=unplanned"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "engine='unplanned'" in err and "no memory rules" in err, err
