"""Open-loop evaluation against an independent computation, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from slurmvla.compose import compose
from slurmvla.data.datasets import ValidationDataset
from slurmvla.data.mixture import Mixture
from slurmvla.evaluate import evaluate
from slurmvla.inference.load import Loaded
from slurmvla.policy import build_policy

REPO = Path(__file__).resolve().parents[1]


def recorded_actions(root: Path) -> dict[int, np.ndarray]:
    """Each episode's ``action`` column, read straight from the parquet files with pyarrow."""
    out: dict[int, list] = {}
    for f in sorted((root / "data").glob("**/*.parquet")):
        t = pq.read_table(f, columns=["episode_index", "frame_index", "action"]).to_pydict()
        for e, i, a in zip(t["episode_index"], t["frame_index"], t["action"]):
            out.setdefault(e, []).append((i, a))
    return {e: np.asarray([a for _, a in sorted(rows)], np.float64) for e, rows in out.items()}


def test_metrics_equal_an_independent_computation(sample_root, example_policy):
    """A deterministic policy (the MLP example) so every prediction can be recomputed one sample at a
    time; recorded actions from pyarrow, the action scale from meta/stats.json, errors in numpy."""
    cfg = compose([f"data.root={sample_root}", "data.num_workers=0", "data.val_fraction=0.25", "policy=custom",
                   f"policy.target={example_policy}"])
    spec = type(build_policy(cfg.policy)).sample_spec(cfg.policy)
    mixture = Mixture(cfg.data, spec, cfg.trainer.seed)
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, mixture.normalization("mean_std", "mean_std")).eval()
    metrics, _ = evaluate(Loaded(policy, cfg, 7, "memory"), split="val", batch_size=5)

    episodes = recorded_actions(sample_root)
    std = np.asarray(json.loads((sample_root / "meta" / "stats.json").read_text())["action"]["std"], np.float64)
    horizon = cfg.policy.action_horizon
    dataset = ValidationDataset(mixture)
    sq_sum, count, first_sum, n = 0.0, 0.0, 0.0, 0
    per_dim = np.zeros(len(std))
    val_episodes = set()
    for i in range(len(dataset)):
        sample = dataset[i]
        e, t = int(sample["episode_index"]), int(sample["frame_index"])
        val_episodes.add(e)
        with torch.no_grad():
            pred = policy.sample_actions({k: v[None] if torch.is_tensor(v) else [v] for k, v in sample.items()})[0]
        pred = pred.double().numpy()
        rec = episodes[e]
        for h in range(horizon):
            if t + h >= len(rec):  # past the episode's end: not counted
                break
            d2 = (pred[h] - rec[t + h]) ** 2
            per_dim += d2
            sq_sum += float((d2 / std**2).sum())
            count += 1
            if h == 0:
                first_sum += float((d2 / std**2).mean())
        n += 1
    assert metrics["num_samples"] == n > 0
    assert len(val_episodes) == 3  # 12 episodes x 0.25
    np.testing.assert_allclose(metrics["chunk_mse"], sq_sum / count / len(std), rtol=1e-6)
    np.testing.assert_allclose(metrics["first_step_mse"], first_sum / n, rtol=1e-6)
    np.testing.assert_allclose(list(metrics["chunk_mse_per_dim"].values()), per_dim / count, rtol=1e-6)
    assert list(metrics["by_dataset"]) == ["droid_sample"]
    assert metrics["by_dataset"]["droid_sample"]["chunk_mse"] == pytest.approx(metrics["chunk_mse"])
    assert metrics["by_control_mode"]["joint_position"]["num_samples"] == n
    assert metrics["validation_loss"]["loss"] > 0
    assert metrics["action_dims"][0].startswith("action")


def _evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmvla.evaluate", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def _evaluate_here(*args: str) -> subprocess.CompletedProcess:
    """The same command line through the CLI's main() in this process (no interpreter start-up):
    its exit code and what it wrote to stderr."""
    import contextlib
    import io

    from slurmvla.evaluate import main

    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


@pytest.mark.slow
def test_cli_writes_json_and_plots_and_repeats_its_numbers(trained_run, tmp_path):
    first = _evaluate_cli(str(trained_run), "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = _evaluate_here(str(trained_run / "policy.safetensors"), "--out", str(tmp_path / "b"), "--plot-episodes", "0")
    assert second.returncode == 0, second.stderr[-3000:]
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    # The flow policy samples from noise: only the seeds make the two runs agree.
    for key in ("chunk_mse", "first_step_mse", "chunk_mse_per_dim", "by_dataset", "validation_loss", "num_samples"):
        assert a[key] == b[key], key
    other = _evaluate_here(str(trained_run), "--out", str(tmp_path / "c"), "--seed", "1", "--plot-episodes", "0")
    assert json.loads((tmp_path / "c" / "metrics.json").read_text())["chunk_mse"] != a["chunk_mse"], other.stderr
    for name in ("trajectories.png", "error_per_dim.png"):
        data = (tmp_path / "a" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert not (tmp_path / "b" / "trajectories.png").exists()
    # Without --out, next to the run's checkpoints.
    default = _evaluate_here(str(trained_run), "--split", "all", "--plot-episodes", "0")
    assert default.returncode == 0, default.stderr[-3000:]
    out = json.loads((trained_run / "eval" / "step_00000008_all" / "metrics.json").read_text())
    assert out["num_samples"] > a["num_samples"] and out["split"] == "all"


@pytest.mark.parametrize("args, expected", [
    (["{run}", "--split", "test"], "--split='test' is not valid; choose one of ['val', 'all']"),
    (["{run}", "data.root=/no/such/data"], "/no/such/data"),
    (["{run}", "data.val_fraction=0.0"], "use --split all"),
])
def test_cli_mistakes_print_one_line(trained_run, args, expected):
    res = _evaluate_here(*(a.format(run=trained_run) for a in args))
    assert res.returncode == 2, res.stdout + res.stderr
    assert expected in res.stderr and "Traceback" not in res.stderr, res.stderr
