"""Schedules against hand-computed values; the fp32-master optimizer against plain fp32 AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from slurmvla.config import OptimConfig, SchedulerConfig
from slurmvla.engine.precision import MasterWeightOptimizer
from slurmvla.optim import build_adamw, build_scheduler


def _opt(names=("backbone_decay", "expert_decay"), lr=1.0):
    groups = [{"name": n, "params": [torch.nn.Parameter(torch.zeros(2))], "param_names": [n], "lr": lr,
               "weight_decay": 0.0} for n in names]
    return build_adamw(groups, OptimConfig(lr=lr), torch.device("cpu"))


def _lrs(scheduler_cfg, steps, max_steps=100):
    opt = _opt()
    sched = build_scheduler(scheduler_cfg, opt, max_steps)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def test_warmup_cosine_by_hand():
    lrs = _lrs(SchedulerConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1), 101)
    assert lrs[0][0] == pytest.approx(0.1) and lrs[9][0] == pytest.approx(1.0)
    assert lrs[10][0] == pytest.approx(1.0)
    assert lrs[55][0] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    assert lrs[100][0] == pytest.approx(0.1)


def test_cosine_with_its_own_decay_horizon_by_hand():
    """openpi's pi05_droid_finetune: the cosine runs over 30000 steps while training stops at 20000."""
    lrs = _lrs(SchedulerConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1, decay_steps=310), 300, max_steps=200)
    assert lrs[160][0] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 150 / 300)))
    assert lrs[199][0] > 0.3 and lrs[299][0] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 289 / 300)))
    with pytest.raises(ValueError, match="scheduler.decay_steps=10 must exceed scheduler.warmup_steps=10"):
        SchedulerConfig(name="cosine", warmup_steps=10, decay_steps=10)


def test_constant_and_warmup_constant():
    assert {lr[0] for lr in _lrs(SchedulerConfig(name="constant"), 20)} == {1.0}
    lrs = _lrs(SchedulerConfig(name="warmup_constant", warmup_steps=4), 10)
    assert [x[0] for x in lrs] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1, 1, 1, 1, 1, 1])


def test_frozen_backbone_schedule():
    cfg = SchedulerConfig(name="frozen_backbone", frozen_backbone_steps=20, warmup_steps=5, min_lr_ratio=0.0)
    lrs = _lrs(cfg, 100)
    assert all(backbone == 0.0 for backbone, _ in lrs[:20])
    assert all(expert > 0.0 for _, expert in lrs)
    assert lrs[20][0] == pytest.approx(0.2) and lrs[24][0] == pytest.approx(lrs[24][1])
    assert lrs[60] == pytest.approx([lrs[60][1]] * 2)
    with pytest.raises(ValueError, match="frozen_backbone_steps=100 must be smaller than trainer.max_steps=100"):
        build_scheduler(SchedulerConfig(name="frozen_backbone", frozen_backbone_steps=100), _opt(), 100)


def _live_and_master(seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.Parameter(torch.randn(64, 16))
    live = torch.nn.Parameter(ref.detach().to(torch.bfloat16))
    return ref, live


def test_master_weights_follow_fp32_adamw_exactly():
    """Given the same fp32 gradients, the masters are bitwise plain fp32 AdamW's parameters."""
    ref, live = _live_and_master()
    with torch.no_grad():
        ref.copy_(live.float())  # start both from the bf16-representable values
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    group = lambda p: [{"name": "expert_decay", "params": [p], "param_names": ["w"], "lr": 1e-3, "weight_decay": 0.1}]  # noqa: E731
    plain = build_adamw(group(ref), cfg, torch.device("cpu"))
    master = MasterWeightOptimizer(group(live), lambda g: build_adamw(g, cfg, torch.device("cpu")))
    for step in range(10):
        g = torch.randn(64, 16, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        ref.grad, live.grad = g.float(), g.clone()
        plain.step()
        master.step()
    assert torch.equal(master.masters[0], ref.detach())
    assert torch.equal(live.detach(), ref.detach().to(torch.bfloat16))
    for state in master.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.is_floating_point() and v.ndim > 0:
                assert v.dtype == torch.float32


def test_bf16_adamw_stalls_where_masters_keep_learning():
    """The failure this guards against: tiny updates vanish in bf16 parameters and bf16 state."""
    cfg = OptimConfig(lr=1e-4, weight_decay=0.0)
    group = lambda p: [{"name": "expert_decay", "params": [p], "param_names": ["w"], "lr": 1e-4, "weight_decay": 0.0}]  # noqa: E731
    naive = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    live = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    naive_opt = build_adamw(group(naive), cfg, torch.device("cpu"))
    master_opt = MasterWeightOptimizer(group(live), lambda g: build_adamw(g, cfg, torch.device("cpu")))
    for _ in range(100):
        naive.grad = torch.ones(8, dtype=torch.bfloat16)
        live.grad = torch.ones(8, dtype=torch.bfloat16)
        naive_opt.step()
        master_opt.step()
    assert torch.equal(naive.detach(), torch.ones(8, dtype=torch.bfloat16)), "bf16 AdamW does not move"
    assert master_opt.masters[0][0].item() == pytest.approx(1.0 - 100 * 1e-4, rel=1e-3)
    assert live[0].item() < 1.0


def test_scheduler_on_the_wrapper_steers_the_inner_optimizer_also_after_load():
    _, live = _live_and_master()
    cfg = OptimConfig(lr=1.0)
    groups = [{"name": "expert_decay", "params": [live], "param_names": ["w"], "lr": 1.0, "weight_decay": 0.0}]
    opt = MasterWeightOptimizer(groups, lambda g: build_adamw(g, cfg, torch.device("cpu")))
    assert isinstance(opt, torch.optim.Optimizer)
    sched = build_scheduler(SchedulerConfig(name="warmup_constant", warmup_steps=10), opt, 100)
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.1)
    live.grad = torch.ones_like(live)
    opt.step()
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.2)
    opt.load_state_dict(opt.state_dict())
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.3)
    assert opt.param_groups is opt.inner.param_groups


def test_clip_uses_the_fp32_master_gradients():
    _, live = _live_and_master()
    cfg = OptimConfig(lr=1.0)
    groups = [{"name": "expert_decay", "params": [live], "param_names": ["w"], "lr": 1.0, "weight_decay": 0.0}]
    opt = MasterWeightOptimizer(groups, lambda g: build_adamw(g, cfg, torch.device("cpu")))
    live.grad = torch.full_like(live, 3.0)
    norm = opt.clip_grad_norm(1.0)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(3.0 * 32)
    assert opt.masters[0].grad.norm().item() == pytest.approx(1.0, rel=1e-5)
