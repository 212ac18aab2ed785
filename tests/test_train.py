"""End-to-end training on the sample data: learning, bitwise resume, bf16 numerics, export, the CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.checkpoint import list_checkpoints
from slurmvla.export import export
from slurmvla.policy import build_policy
from slurmvla.trainer import Trainer


def train(cfg, run_dir, stop_at=None):
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.fit(stop_at=stop_at)
    finally:
        trainer.close()
    return trainer


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_loss_falls_well_below_its_start(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=300", "optim.lr=1e-3", "trainer.global_batch_size=16",
                   "trainer.log_every_steps=10", "checkpoint.every_steps=0")
    train(cfg, tmp_path)
    rec = records(tmp_path)
    first, last = rec[0]["loss"], sum(r["loss"] for r in rec[-3:]) / 3
    assert last < 0.6 * first, (first, last)
    for key in ("step", "loss", "lr", "grad_norm", "samples_per_s"):
        assert key in rec[-1]
    assert [r["step"] for r in rec] == list(range(10, 301, 10))


def _final_state(run_dir: Path):
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    return ckpt, load_file(str(ckpt / "model.safetensors")), torch.load(ckpt / "optimizer.pt", weights_only=True)


# bf16 (its fp32 master weights and optimizer state) and openpi's augmentation in the data workers are resumed in one
# run: each is deterministic on its own, so one run holds both (fp32 without augmentation is the plain path).
@pytest.mark.parametrize("precision, augment", [("fp32", "none"), pytest.param("bf16", "openpi", marks=pytest.mark.slow)])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(make_cfg, tmp_path, precision, augment):
    """N steps straight == N/2 steps, stop, restart in the same run directory, continue to N (with the
    training images augmented in the data workers too: each sample's augmentation is drawn from its seed)."""
    over = ["trainer.max_steps=24", "checkpoint.every_steps=6", "checkpoint.keep=2", "trainer.grad_accum_steps=2",
            "data.num_workers=2", f"precision={precision}", "scheduler.warmup_steps=5", f"data.augment={augment}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    before = set(multiprocessing.active_children())
    train(make_cfg(*over), straight)
    # A run's close ends its (persistent) data workers, not the garbage collector at some later run's start.
    assert set(multiprocessing.active_children()) <= before
    train(make_cfg(*over), resumed, stop_at=12)
    assert [p.name for p in list_checkpoints(resumed / "checkpoints")] == ["step_00000006", "step_00000012"]
    second = train(make_cfg(*over), resumed)
    assert second.resumed_from.name == "step_00000012"
    a_ckpt, a_model, a_opt = _final_state(straight)
    b_ckpt, b_model, b_opt = _final_state(resumed)
    assert a_ckpt.name == b_ckpt.name == "step_00000024"
    for k in a_model:
        assert torch.equal(a_model[k], b_model[k]), k
    for i, s in a_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b_opt["state"][i][k]), (i, k)
    # Metrics past the checkpoint were dropped on restart: no step is logged twice.
    steps = [r["step"] for r in records(resumed)]
    assert steps == sorted(set(steps)) and steps[-1] == 24
    # keep=2 kept the newest two.
    assert [p.name for p in list_checkpoints(resumed / "checkpoints")] == ["step_00000018", "step_00000024"]


def test_partial_checkpoints_are_never_resumed(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=4", "checkpoint.every_steps=2")
    train(cfg, tmp_path)
    # A crash mid-write leaves a temp folder; a folder without meta.json is incomplete too.
    (tmp_path / "checkpoints" / ".step_00000006.tmp-123").mkdir()
    (tmp_path / "checkpoints" / "step_00000008").mkdir()
    again = Trainer(make_cfg("trainer.max_steps=6", "checkpoint.every_steps=2"), tmp_path)
    try:
        assert again.resumed_from.name == "step_00000004" and again.step == 4
    finally:
        again.close()


def test_bf16_keeps_fp32_optimizer_state_and_tracks_fp32(make_cfg, tmp_path):
    """Every optimizer state tensor is fp32, and the bf16 run tracks an fp32 run.

    Tolerance: the two runs see the same data and noise, so they differ only by bf16 rounding in
    the forward/backward (8 mantissa bits, ~2e-3 relative per op). Measured after 20 steps at lr 1e-3:
    the weights differ by ~1% of the distance they travelled and the loss by ~0.01%; the bounds
    below (10%, 1%) leave room for other CPUs' kernels. A model cast to bf16 before AdamW is built
    fails the dtype checks (bf16 live parameters *and* bf16 exp_avg / exp_avg_sq).
    """
    over = ["trainer.max_steps=20", "optim.lr=1e-3", "checkpoint.every_steps=0"]
    results = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(make_cfg(*over, f"precision={precision}"), tmp_path / precision)
        try:
            start = trainer.engine.model_state_dict()
            last = trainer.fit()
            results[precision] = (start, trainer.engine.model_state_dict(), last["loss"], trainer)
        finally:
            trainer.close()
    w0, w32, loss32, _ = results["fp32"]
    w0_16, w16, loss16, t16 = results["bf16"]
    assert all(torch.equal(w0[k], w0_16[k]) for k in w0), "both runs start from the same fp32 weights"
    assert {p.dtype for p in t16.policy.parameters() if p.requires_grad} == {torch.bfloat16}
    state = t16.optimizer.state_dict()["state"]
    assert len(state) == sum(1 for p in t16.policy.parameters() if p.requires_grad)
    for s in state.values():
        for k, v in s.items():
            if k != "step":
                assert v.dtype == torch.float32, k
    assert {v.dtype for v in w16.values()} == {torch.float32}
    diff = sum(((w16[k] - w32[k]) ** 2).sum() for k in w32) ** 0.5
    travelled = sum(((w32[k] - w0[k]) ** 2).sum() for k in w32) ** 0.5
    assert diff / travelled < 0.1, (diff / travelled).item()
    assert abs(loss16 - loss32) / loss32 < 0.01, (loss16, loss32)


def test_export_round_trip(make_cfg, tmp_path):
    trainer = train(make_cfg("trainer.max_steps=6", "checkpoint.every_steps=3"), tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "policy.safetensors")
    weights = load_file(str(out))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float32}
    fresh = build_policy(trainer.cfg.policy)
    fresh.load_state_dict(weights, strict=True)
    batch = next(trainer.data.iterate(0, 0))
    noise = torch.randn(batch["actions"].shape, generator=torch.Generator().manual_seed(0))
    trainer.policy.eval()
    fresh.eval()
    assert torch.equal(fresh.sample_actions(batch, noise=noise), trainer.policy.sample_actions(batch, noise=noise))
    stats = json.loads((trainer.mixture.sources[0].meta.root / "meta" / "stats.json").read_text())
    assert torch.allclose(fresh.action_offset, torch.tensor(stats["action"]["mean"]))
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["step"] == "6" and meta["engine"] == "single" and "policy:" in meta["config_yaml"]


def _cli(args, cwd, env_extra=None):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "slurmvla.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_runs_and_leaves_a_complete_run_directory(sample_root, tmp_path):
    run = tmp_path / "run"
    res = _cli([f"data.root={sample_root}", "trainer.max_steps=4", "checkpoint.every_steps=2",
                "trainer.log_every_steps=2", "logging.wandb.mode=offline", f"hydra.run.dir={run}"], tmp_path,
               {"WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
    assert (run / "config.resolved.yaml").is_file()
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in records(run)] == [2, 4]
    run_id = (run / "wandb_run_id.txt").read_text()
    assert list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    # Started again with a higher max_steps: resumes from step 4 and continues the same wandb run.
    res = _cli([f"data.root={sample_root}", "trainer.max_steps=6", "checkpoint.every_steps=2",
                "trainer.log_every_steps=2", "logging.wandb.mode=offline", f"hydra.run.dir={run}"], tmp_path,
               {"WANDB_SILENT": "true"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["step"] for r in records(run)] == [2, 4, 6]
    assert (run / "wandb_run_id.txt").read_text() == run_id


def test_cli_rejects_a_bad_override_before_training(tmp_path):
    res = _cli(["engine=zero9"], tmp_path)
    assert res.returncode != 0
    assert "zero9" in res.stderr and "single" in res.stderr
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_step_time_benchmark_prints_its_ratio(sample_root):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_time.py"
    res = subprocess.run([sys.executable, str(script), "--steps", "2", "--warmup", "1", "--repeats", "1",
                          f"data.root={sample_root}", "trainer.global_batch_size=4"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ratio = float(res.stdout.strip().splitlines()[-1].split(":")[-1])
    assert ratio > 0


def test_validation_is_logged_by_group(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=4", "trainer.log_every_steps=2", "trainer.val_every_steps=2",
                   "data.val_fraction=0.25", "checkpoint.every_steps=0")
    train(cfg, tmp_path)
    val = [r for r in records(tmp_path) if "val/loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    for r in val:
        assert r["val/loss"] == r["val/mse"] == r["val/by_dataset/droid_sample/mse"] == r["val/by_control_mode/joint_position/mse"]
        assert r["val/num_samples"] > 0
    assert val[0]["val/loss"] != val[1]["val/loss"]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                    reason="torch.compile on the CPU needs a C++ compiler (inductor's CPU backend)")
def test_compiled_layers_train_like_eager_ones(sample_root, tmp_path):
    """trainer.compile=true (each repeated layer through torch.compile) changes no loss beyond float
    rounding: the demo's configuration, five steps each way, against eager mode."""
    from tests.conftest import run_train

    runs = {}
    for compiled in (False, True):
        run = tmp_path / f"compile_{compiled}"
        run_train(["experiment=demo", f"data.root={sample_root}", "data.num_workers=0", "trainer.max_steps=5",
                   f"trainer.compile={str(compiled).lower()}", "trainer.log_every_steps=1", "trainer.val_every_steps=0",
                   "checkpoint.every_steps=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
                   f"hydra.run.dir={run}"])
        runs[compiled] = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(runs[True]) == 5 and runs[True][-1] < runs[True][0]
    assert runs[True] == pytest.approx(runs[False], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["pi05_tiny", "pi0_tiny"])
def test_the_prompt_is_prepared_on_the_host_and_trains_bitwise_as_in_the_forward(policy, make_cfg, tmp_path,
                                                                                    monkeypatch):
    """The trainer does the policy's host-side work (pi0.5's prompt from the state, the prompt's padding cut)
    before the batch moves, in training and validation, so the forward waits on the device for nothing: the
    same weights and validation metrics, bitwise, as the forward doing it itself."""
    from slurmvla.policy.pi0.model import PROMPT_IDS

    def fit(run: str) -> tuple[dict, dict]:
        trainer = Trainer(make_cfg(f"policy={policy}", "trainer.max_steps=3", "checkpoint.every_steps=0",
                                   "data.val_fraction=0.25", "trainer.val_every_steps=3"), tmp_path / run)
        trainer.fit()
        weights, metrics = trainer.engine.model_state_dict(), trainer.validate()
        trainer.close()
        return weights, metrics

    trainer = Trainer(make_cfg(f"policy={policy}", "trainer.max_steps=3"), tmp_path / "probe")
    batch = trainer._next_batch()
    trainer.close()
    assert PROMPT_IDS in batch and "text" not in batch
    calls = []
    original = Trainer._host_part
    monkeypatch.setattr(Trainer, "_host_part", lambda self, batch: calls.append(1) or original(self, batch))
    prepared, prepared_val = fit("prepared")
    assert len(calls) > 3, "validation batches (after the 3 training steps) go through the host part too"
    monkeypatch.setattr(Trainer, "_host_part", lambda self, batch: batch)
    in_forward, in_forward_val = fit("in_forward")
    assert all(torch.equal(prepared[k], in_forward[k]) for k in prepared)
    assert prepared_val["val/loss"] > 0 and prepared_val == in_forward_val  # validation prepares its batches too
