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


def test_export_writes_the_average_on_request(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=4", "checkpoint.every_steps=4", f"trainer.ema_decay={DECAY}")
    run(cfg, tmp_path / "run")
    cmd = [sys.executable, "-m", "slurmvla.export", str(tmp_path / "run"), str(tmp_path / "ema.safetensors"), "--ema"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    exported = load_file(str(tmp_path / "ema.safetensors"))
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000004" / "ema.safetensors"))
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        assert f.metadata()["weights"] == "moving average"

    cfg = make_cfg("trainer.max_steps=2", "checkpoint.every_steps=2")
    run(cfg, tmp_path / "plain")
    res = subprocess.run([*cmd[:3], str(tmp_path / "plain"), str(tmp_path / "x.safetensors"), "--ema"], cwd=REPO,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "holds no moving average" in res.stderr and "Traceback" not in res.stderr


def test_a_decay_outside_zero_one_is_refused(make_cfg):
    with pytest.raises(ValueError, match=r"trainer.ema_decay=1.0 must lie strictly between 0 and 1"):
        make_cfg("trainer.ema_decay=1.0")
