"""The registries are the only place names live: a new entry is usable everywhere, unchanged code around it."""

from __future__ import annotations

import pytest
import torch

from slurmvla.checkpoint import load_model_file, resolve_checkpoint
from slurmvla.compose import compose
from slurmvla.config import SchedulerConfig
from slurmvla.engine import Engine
from slurmvla.optim import build_scheduler
from slurmvla.registry import (
    DATA_MODES,
    ENGINES,
    POLICIES,
    SAMPLE_MODES,
    SCHEDULERS,
    EngineEntry,
    SchedulerEntry,
)
from slurmvla.trainer import Trainer


@pytest.mark.parametrize("registry", [ENGINES, POLICIES, SCHEDULERS], ids=["engines", "policies", "schedulers"])
def test_every_entry_resolves(registry):
    for name in registry:
        entry = registry.get(name)
        # An empty target is a policy named by the config (policy=custom policy.target=...).
        assert callable(entry.load()) if entry.target else registry is POLICIES, name


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match=r"engine.name='fsdp3' is not valid; choose one of \['single', 'ddp'"):
        ENGINES.get("fsdp3")
    with pytest.raises(ValueError, match=r"scheduler.name='linear' is not valid; choose one of \['cosine'"):
        SCHEDULERS.get("linear")
    assert set(SAMPLE_MODES) < set(DATA_MODES) and "joint" in DATA_MODES


def test_capabilities_drive_config_validation():
    assert ENGINES.names(activation_checkpointing=False) == ("zero3",)
    assert ENGINES.names(multi_process=False) == ("single",)
    assert set(ENGINES.names(resumes_at_any_world_size=False)) == {"zero1", "zero2", "zero3"}


def halving_schedule(cfg: SchedulerConfig, max_steps: int, group_names: list[str]):
    return [lambda s: 0.5 ** s for _ in group_names]


def test_a_new_schedule_is_one_entry(monkeypatch):
    monkeypatch.setitem(SCHEDULERS._entries, "halving", SchedulerEntry("halving", f"{__name__}:halving_schedule"))
    cfg = compose(["scheduler.name=halving", "optim.lr=0.8"])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    sched = build_scheduler(cfg.scheduler, opt, max_steps=10)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [0.8, 0.4, 0.2]


def test_a_new_engine_is_one_entry(monkeypatch, make_cfg, tmp_path):
    """An engine registered under a new name trains, checkpoints and exports through the same code,
    and gives the same weights as the engine it is built from (nothing branches on the name)."""
    monkeypatch.setitem(ENGINES._entries, "one_process",
                        EngineEntry("one_process", "slurmvla.engine.single:SingleEngine", multi_process=False))
    weights = {}
    for name in ("single", "one_process"):
        cfg = make_cfg(f"engine.name={name}", "trainer.max_steps=2", "checkpoint.every_steps=0", "data.loader=map")
        trainer = Trainer(cfg, tmp_path / name)
        assert isinstance(trainer.engine, Engine)
        trainer.fit()
        trainer.close()
        weights[name] = load_model_file(resolve_checkpoint(tmp_path / name))
    assert weights["single"].keys() == weights["one_process"].keys()
    assert all(torch.equal(weights["single"][k], weights["one_process"][k]) for k in weights["single"])
