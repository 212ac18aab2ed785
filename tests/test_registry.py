"""The registries are the only place names live: a new entry is usable everywhere, unchanged code around it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from slurmvla.checkpoint import load_model_file, resolve_checkpoint
from slurmvla.compose import compose, config_dir, to_config
from slurmvla.config import SchedulerConfig
from slurmvla.config.data import DATA_MODES, SAMPLE_MODES
from slurmvla.config.policy import PolicyConfig
from slurmvla.engine import Engine
from slurmvla.optim import build_scheduler
from slurmvla.registry import (
    ENGINES,
    POLICIES,
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
        if registry is POLICIES:
            assert issubclass(entry.load_schema(), PolicyConfig), name


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


# -- a policy added as one folder --------------------------------------------------------------------
# tests/policy_folder/pooled_flow/: its options and registry entry (config.py), its class (model.py). No YAML
# file, no registry line, no edit to slurmvla/config.py.

FOLDER = Path(__file__).parent / "policy_folder" / "pooled_flow"


@pytest.fixture
def pooled_flow_folder(monkeypatch, tmp_path):
    """``pooled_flow/`` on ``slurmvla.policy``'s path, as if it lay in slurmvla/policy/, and the policy table
    read afresh (the built-in folders and this one); all of it undone afterwards."""
    import slurmvla.policy
    from slurmvla.registry import policy_folders

    shutil.copytree(FOLDER, tmp_path / "policies" / "pooled_flow")
    monkeypatch.setattr(slurmvla.policy, "__path__", [*slurmvla.policy.__path__, str(tmp_path / "policies")])
    monkeypatch.setattr(POLICIES, "_table", {})
    monkeypatch.setattr(POLICIES, "_discover", policy_folders)
    yield
    for name in [m for m in sys.modules if m.startswith("slurmvla.policy.pooled_flow")]:
        del sys.modules[name]


def test_a_new_policy_is_one_folder(pooled_flow_folder, make_cfg, tmp_path):
    """Dropped in as one folder, a policy is selected by its name on the command line, its options are typed
    and checked by its schema (an option it lacks is the usual one line), it trains and checkpoints through
    the trainer, a saved config of it re-validates as its schema, and the run directory serves it to openpi's
    client: the chunk the client gets is the one the trained weights sample for that observation."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from slurmvla.inference.build import build_server
    from slurmvla.inference.harness import serving_in_thread

    assert "pooled_flow" in POLICIES and list(POLICIES)[-1] == "custom"
    assert not (config_dir() / "policy" / "pooled_flow.yaml").exists()
    with pytest.raises(ValueError, match=r"policy.name=pooled_flow has no option 'mlp_ratio' \(an option of "
                                         r"policy.name=flow_vla\); its options: \[.*'hidden'"):
        make_cfg("policy=pooled_flow", "policy.mlp_ratio=4")
    with pytest.raises(ValueError, match=r"policy.hidden=0 is not valid"):
        make_cfg("policy=pooled_flow", "policy.hidden=0")

    cfg = make_cfg("policy=pooled_flow", "policy.hidden=24", "trainer.max_steps=4", "checkpoint.every_steps=0",
                   "data.loader=map")
    schema = POLICIES.get("pooled_flow").load_schema()
    assert type(cfg.policy) is schema and (cfg.policy.name, cfg.policy.hidden) == ("pooled_flow", 24)
    saved = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert type(to_config(saved).policy) is schema

    trainer = Trainer(cfg, tmp_path / "run")
    try:
        assert type(trainer.policy).__name__ == "PooledFlowPolicy"
        start = {k: v.clone() for k, v in trainer.engine.model_state_dict().items()}
        last = trainer.fit()
        end = trainer.engine.model_state_dict()
    finally:
        trainer.close()
    assert torch.isfinite(torch.tensor(last["loss"]))
    assert any(not torch.equal(start[k], end[k]) for k in start if k.startswith("net."))
    assert load_model_file(resolve_checkpoint(tmp_path / "run")).keys() == end.keys()

    server = build_server(str(tmp_path / "run"), ["serve.host=127.0.0.1", "serve.port=0", "serve.seed=3"], device="cpu")
    runner = server.policy
    assert all(torch.equal(end[k], v) for k, v in runner.policy.state_dict().items())
    g = np.random.default_rng(0)
    # What openpi's DROID client sends for the cameras the policy reads (serve.cameras' keys).
    obs = {key: g.integers(0, 256, (224, 224, 3), dtype=np.uint8) for key in runner.processor.camera_keys if key}
    obs.update({"observation/joint_position": g.normal(size=7), "observation/gripper_position": g.uniform(size=1),
                "prompt": "pick up the cup"})
    with serving_in_thread(server) as port:
        client = WebsocketClientPolicy("127.0.0.1", port)
        served = np.asarray(client.infer(obs)["actions"])
        assert client.get_server_metadata()["policy"] == "pooled_flow"
    # The same observation through the runner in this process, and the trained model sampled directly.
    np.testing.assert_array_equal(served, runner.infer(obs)["actions"])
    assert served.shape == (cfg.policy.action_horizon, cfg.policy.action_dim) and np.isfinite(served).all()
