"""The moving average of the weights (trainer.ema_decay): openpi's formula over the weights training
really had, kept of the fp32 masters, checkpointed, resumed bitwise and exported on request. Every
sharding engine keeps it too: tests/test_distributed.py compares each one's average with one
process's and checks its resume."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from slurmvla.checkpoint import list_checkpoints
from slurmvla.inference.load import load_exported
from slurmvla.trainer import Trainer

DECAY = 0.7
REPO = Path(__file__).resolve().parents[2]


def run(cfg, run_dir: Path, stop_at: int | None = None) -> dict:
    trainer = Trainer(cfg, run_dir)
    start = trainer.engine.model_state_dict()
    try:
        trainer.fit(stop_at=stop_at)
    finally:
        trainer.close()
    return start


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_average_is_openpis_formula_over_every_steps_weights_and_resumes_bitwise(make_cfg, tmp_path, precision):
    cfg = make_cfg(f"precision={precision}", "trainer.max_steps=6", "checkpoint.every_steps=1", "checkpoint.keep=10",
                   f"trainer.ema_decay={DECAY}", "optim.lr=1e-2")
    ema = {k: v.double() for k, v in run(cfg, tmp_path / "straight").items()}  # starts at the initial weights
    steps = list_checkpoints(tmp_path / "straight" / "checkpoints")
    assert len(steps) == 6
    for step in steps:
        weights = load_file(str(step / "model.safetensors"))  # the fp32 masters under bf16
        saved = load_file(str(step / "ema.safetensors"))
        assert sorted(saved) == sorted(weights) and all(v.dtype == torch.float32 for v in saved.values())
        ema = {k: DECAY * ema[k] + (1 - DECAY) * weights[k].double() for k in weights}
        for k in weights:
            assert torch.allclose(saved[k].double(), ema[k], rtol=1e-6, atol=1e-7), (step.name, k)
    # The average lags the weights (the test above could not pass with the weights themselves).
    last = load_file(str(steps[-1] / "model.safetensors"))
    assert any(not torch.allclose(saved[k], last[k]) for k in last if last[k].is_floating_point())

    run(cfg, tmp_path / "resumed", stop_at=3)
    run(cfg, tmp_path / "resumed")
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_00000006" / "ema.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "checkpoints" / "step_00000006" / "ema.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_export_and_serving_take_the_average_where_the_run_keeps_one(make_cfg, tmp_path):
    """serve.weights=auto (the default) loads the moving average of a run that keeps one, as openpi serves
    its EMA parameters; export writes the same; trained / ema choose, and a choice that cannot be met is
    refused naming the checkpoint or file."""
    cfg = make_cfg("trainer.max_steps=4", "checkpoint.every_steps=4", f"trainer.ema_decay={DECAY}")
    run(cfg, tmp_path / "run")
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    average, trained = load_file(str(step / "ema.safetensors")), load_file(str(step / "model.safetensors"))
    assert not _equal(average, trained)

    def served(source, *overrides):
        loaded = load_exported(source, list(overrides))
        return {k: v for k, v in loaded.policy.state_dict().items() if k in average}, loaded.weights

    for source, overrides in [(tmp_path / "run", ()), (step, ("serve.weights=ema",))]:
        state, which = served(source, *overrides)
        assert which == "ema" and _equal(state, average), overrides
    state, which = served(tmp_path / "run", "serve.weights=trained")
    assert which == "trained" and _equal(state, trained)

    export = [sys.executable, "-m", "slurmvla.export", str(tmp_path / "run")]
    for flags, name, want, label in [((), "auto", average, "moving average"), (("--ema",), "ema", average, "moving average"),
                                     (("--weights", "trained"), "trained", trained, "trained")]:
        subprocess.run([*export, str(tmp_path / f"{name}.safetensors"), *flags], check=True, cwd=REPO,
                       capture_output=True)
        assert _equal(load_file(str(tmp_path / f"{name}.safetensors")), want), name
        with safe_open(str(tmp_path / f"{name}.safetensors"), "pt") as f:
            assert f.metadata()["weights"] == label
    assert served(tmp_path / "auto.safetensors")[1] == "ema"
    assert served(tmp_path / "trained.safetensors")[1] == "trained"
    assert _equal(served(tmp_path / "auto.safetensors", "serve.weights=ema")[0], average)
    with pytest.raises(ValueError, match=r"serve.weights=ema: .*trained.safetensors' is an exported file of the "
                                         r"trained weights .* which holds no moving average"):
        load_exported(tmp_path / "trained.safetensors", ["serve.weights=ema"])
    with pytest.raises(ValueError, match=r"serve.weights='everything' is not one of auto, trained, ema"):
        load_exported(tmp_path / "run", ["serve.weights=everything"])

    cfg = make_cfg("trainer.max_steps=2", "checkpoint.every_steps=2")
    run(cfg, tmp_path / "plain")
    plain = load_file(str(tmp_path / "plain" / "checkpoints" / "step_00000002" / "model.safetensors"))
    state, which = served(tmp_path / "plain")  # auto: the trained weights, there being no average
    assert which == "trained" and all(torch.equal(state[k], plain[k]) for k in state)
    with pytest.raises(ValueError, match=r"step_00000002 holds no moving average \(ema.safetensors\)"):
        load_exported(tmp_path / "plain", ["serve.weights=ema"])
    res = subprocess.run([*export[:3], str(tmp_path / "plain"), str(tmp_path / "x.safetensors"), "--ema"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "holds no moving average" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run([*export, str(tmp_path / "y.safetensors"), "--ema", "--weights", "trained"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "contradict" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("weights", ["auto", "trained"])
def test_the_periodic_closed_loop_evaluates_the_average_and_training_goes_on_untouched(make_cfg, tmp_path, weights):
    """trainer.rollout_every_steps with trainer.ema_decay: the closed loop is handed the policy holding the
    moving average of that step (serve.weights=auto), or its trained weights (trained); either way the
    run's weights afterwards are bit for bit those of the same run without closed loops."""
    seen = []

    def closed_loop(policy, cfg, step, run_dir, rank, world_size, weights):
        seen.append((step, weights, {k: v.detach().clone() for k, v in policy.state_dict().items()}))
        return None

    common = ("trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep=10", f"trainer.ema_decay={DECAY}",
              "optim.lr=1e-2")
    trainer = Trainer(make_cfg(*common, "trainer.rollout_every_steps=2", f"serve.weights={weights}"),
                      tmp_path / "loop", closed_loop=closed_loop)
    try:
        trainer.fit()
    finally:
        trainer.close()
    run(make_cfg(*common), tmp_path / "none")
    which = "trained" if weights == "trained" else "ema"
    assert [(s, w) for s, w, _ in seen] == [(2, which), (4, which)]
    for step, _, state in seen:
        ckpt = tmp_path / "loop" / "checkpoints" / f"step_{step:08d}"
        want = load_file(str(ckpt / ("model.safetensors" if weights == "trained" else "ema.safetensors")))
        assert all(torch.equal(state[k], want[k]) for k in want), step
    for step in (2, 4):
        a, b = (load_file(str(tmp_path / r / "checkpoints" / f"step_{step:08d}" / "model.safetensors"))
                for r in ("loop", "none"))
        assert _equal(a, b), step

    with pytest.raises(ValueError, match=r"serve.weights=ema evaluates the moving average of the weights, which "
                                         r"this run does not keep \(trainer.ema_decay=null\)"):
        make_cfg("trainer.rollout_every_steps=2", "serve.weights=ema")


def test_a_decay_outside_zero_one_is_refused(make_cfg):
    with pytest.raises(ValueError, match=r"trainer.ema_decay=1.0 must lie strictly between 0 and 1"):
        make_cfg("trainer.ema_decay=1.0")
