"""The registries are the only place names live: a new entry is usable everywhere, unchanged code around it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from slurmvla.checkpoint import load_model_file, resolve_checkpoint
from slurmvla.compose import compose, config_dir, to_config
from slurmvla.config import PolicyConfig, SchedulerConfig, check_positive
from slurmvla.engine import Engine
from slurmvla.optim import build_scheduler
from slurmvla.policy.flow import flow_matching_loss, noise_and_time, noisy_actions
from slurmvla.registry import (
    DATA_MODES,
    ENGINES,
    POLICIES,
    SAMPLE_MODES,
    SCHEDULERS,
    EngineEntry,
    PolicyEntry,
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


# -- a policy added in one module ------------------------------------------------------------------
# Its options (a PolicyConfig subclass), its class and one registry entry naming both: no YAML file, no
# edit to slurmvla/config.py. This test module is that one module.

@dataclass
class PooledFlowConfig(PolicyConfig):
    """``policy=pooled_flow``: the options of the policy below."""

    name: str = "pooled_flow"
    size: str = "pooled_flow"
    hidden: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("policy.hidden", self.hidden)


class PooledFlowPolicy(nn.Module):
    """Flow matching as the built-in policies train it (slurmvla/policy/flow.py): the mean colour of each
    frame, the normalized state, the noisy chunk and the time in, the velocity out, through one MLP."""

    def __init__(self, cfg: PooledFlowConfig, stats: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.horizon, self.action_dim, self.steps = cfg.action_horizon, cfg.action_dim, cfg.num_inference_steps
        frames = cfg.num_obs_history * cfg.num_cameras
        inputs = 3 * frames + cfg.num_obs_history * cfg.state_dim + cfg.action_horizon * cfg.action_dim + 1
        self.net = nn.Sequential(nn.Linear(inputs, cfg.hidden), nn.GELU(), nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
                                 nn.Linear(cfg.hidden, cfg.action_horizon * cfg.action_dim))
        for part, dim in (("state", cfg.state_dim), ("action", cfg.action_dim)):
            offset = torch.zeros(dim) if stats is None else stats[f"{part}_offset"].float().reshape(dim)
            scale = torch.ones(dim) if stats is None else stats[f"{part}_scale"].float().reshape(dim)
            self.register_buffer(f"{part}_offset", offset.clone())
            self.register_buffer(f"{part}_scale", scale.clone())

    def wrap_units(self) -> list[nn.Module]:
        return [self.net]

    def velocity(self, batch: dict, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b = x_t.shape[0]
        pixels = batch["images"].float().mean(dim=(2, 3)).flatten(1) / 255.0
        state = ((batch["state"].float() - self.state_offset) / self.state_scale).reshape(b, -1)
        out = self.net(torch.cat([pixels, state, x_t.flatten(1), t[:, None]], dim=1))
        return out.view(b, self.horizon, self.action_dim)

    def forward(self, batch: dict) -> dict:
        actions = (batch["actions"].float() - self.action_offset) / self.action_scale
        noise, t = noise_and_time(batch, actions, None, None)
        pred = self.velocity(batch, noisy_actions(actions, noise, t), t)
        return flow_matching_loss(pred, noise, actions, batch["action_mask"])

    @torch.no_grad()
    def sample_actions(self, batch: dict) -> torch.Tensor:
        """Euler steps from noise (t = 1) to the chunk (t = 0), in the dataset's units."""
        b = batch["state"].shape[0]
        x = torch.randn(b, self.horizon, self.action_dim, device=batch["state"].device)
        for i in range(self.steps):
            t = torch.full((b,), 1.0 - i / self.steps, device=x.device)
            x = x - self.velocity(batch, x, t) / self.steps
        return x * self.action_scale + self.action_offset


def test_a_new_policy_is_one_module_and_one_entry(monkeypatch, make_cfg, tmp_path):
    """Registered from one module, a policy is selected by its name on the command line, its options are
    typed and checked by its schema (an option it lacks is the usual one line), it trains and checkpoints
    through the trainer, and a saved config of it re-validates as its schema."""
    monkeypatch.setitem(POLICIES._entries, "pooled_flow", PolicyEntry(
        "pooled_flow", f"{__name__}:PooledFlowPolicy", schema=f"{__name__}:PooledFlowConfig"))
    assert not (config_dir() / "policy" / "pooled_flow.yaml").exists()
    with pytest.raises(ValueError, match=r"policy.name=pooled_flow has no option 'mlp_ratio' \(an option of "
                                         r"policy.name=flow_vla\); its options: \[.*'hidden'"):
        make_cfg("policy=pooled_flow", "policy.mlp_ratio=4")
    with pytest.raises(ValueError, match=r"policy.hidden=0 is not valid"):
        make_cfg("policy=pooled_flow", "policy.hidden=0")

    cfg = make_cfg("policy=pooled_flow", "policy.hidden=24", "trainer.max_steps=4", "checkpoint.every_steps=0",
                   "data.loader=map")
    assert type(cfg.policy) is PooledFlowConfig and (cfg.policy.name, cfg.policy.hidden) == ("pooled_flow", 24)
    saved = OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert type(to_config(saved).policy) is PooledFlowConfig

    trainer = Trainer(cfg, tmp_path / "run")
    try:
        assert isinstance(trainer.policy, PooledFlowPolicy)
        start = {k: v.clone() for k, v in trainer.engine.model_state_dict().items()}
        last = trainer.fit()
        end = trainer.engine.model_state_dict()
    finally:
        trainer.close()
    assert torch.isfinite(torch.tensor(last["loss"]))
    assert any(not torch.equal(start[k], end[k]) for k in start if k.startswith("net."))
    assert load_model_file(resolve_checkpoint(tmp_path / "run")).keys() == end.keys()
