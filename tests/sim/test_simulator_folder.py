"""A simulator added as one folder (tests/sim/simulator_folder/point_mass/: a point mass in NumPy): put on
``slurmvla.sim``'s path, it is a ``rollout.env`` choice and a ``--env`` of the recorder, and its demonstrations record,
train, serve and roll out with nothing else added. References: the expert's own episodes (the simulator is
deterministic for a seed), which a policy replaying the recorded actions must reproduce through the server and
client, and a policy that never moves, which must never succeed."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("websockets.sync.client", reason="pip install -e '.[sim]'")

from slurmvla.compose import compose  # noqa: E402
from slurmvla.config.rollout import RolloutConfig  # noqa: E402
from slurmvla.registry import SIMULATORS, simulator_folders  # noqa: E402

FOLDER = Path(__file__).parent / "simulator_folder" / "point_mass"
SEEDS = 6


@pytest.fixture
def point_mass(monkeypatch, tmp_path):
    """``point_mass/`` on ``slurmvla.sim``'s path, as if it lay in slurmvla/sim/, and the simulator table read
    afresh; all of it undone afterwards."""
    import slurmvla.sim

    shutil.copytree(FOLDER, tmp_path / "simulators" / "point_mass")
    monkeypatch.setattr(slurmvla.sim, "__path__", [*slurmvla.sim.__path__, str(tmp_path / "simulators")])
    monkeypatch.setattr(SIMULATORS, "_table", {})
    monkeypatch.setattr(SIMULATORS, "_discover", simulator_folders)
    yield
    for name in [m for m in sys.modules if m.startswith("slurmvla.sim.point_mass")]:
        del sys.modules[name]


def _train(demos: Path, run_dir: Path, policy: str, *kwargs: str) -> Path:
    from slurmvla.trainer import Trainer

    cfg = compose([
        f"data.root={demos}", "data.cameras=[observation.images.top]", "data.state_keys=[observation.state]",
        "data.action_keys=[action]", "data.keep_ranges.path=null", "data.val_fraction=0", "data.num_workers=0",
        "data.loader=map", "policy=custom", f"policy.target=slurmvla.policy.baselines.{policy}", *kwargs,
        "policy.num_cameras=1", "policy.state_dim=2", "policy.action_dim=2", "policy.action_horizon=4",
        "policy.image_size=32", "serve.cameras=[observation/image]", "serve.state=[observation/state]",
        "rollout.env=point_mass", "rollout.height=32", "rollout.width=32", "rollout.max_steps=30",
        "rollout.replan_steps=2", "rollout.videos=1", "trainer.max_steps=1", "checkpoint.every_steps=1",
        "trainer.global_batch_size=4", "trainer.val_every_steps=0", "trainer.progress_bar=false",
        "logging.wandb.mode=disabled"])
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return run_dir


def test_a_new_simulator_is_one_folder(point_mass, tmp_path):
    from slurmvla.rollout import run
    from slurmvla.sim.record import main as record

    assert "point_mass" in SIMULATORS and RolloutConfig(env="point_mass").env == "point_mass"
    with pytest.raises(ValueError, match=r"rollout.task='fly' is not a variant of the point mass \(rollout.env=point_mass\)"):
        RolloutConfig(env="point_mass", task="fly")

    demos = tmp_path / "demos"
    record(["--env", "point_mass", "--out", str(demos), "--episodes", str(SEEDS)])
    recorded = json.loads((demos / "point_mass.json").read_text())
    assert recorded["seeds"] == list(range(SEEDS)) and all(recorded["success"])
    info = json.loads((demos / "meta" / "info.json").read_text())
    assert info["features"]["observation.images.top"]["shape"][:2] == [32, 32]

    replay = _train(demos, tmp_path / "replay", "ReplayPolicy", f"+policy.kwargs={{root: '{demos}', action_keys: [action]}}")
    summary = run(str(replay), ["rollout.first_seed=0", f"rollout.episodes={SEEDS}", "serve.device=cpu"],
                  out=tmp_path / "rollout")
    # Replaying the recorded actions through the server and client is the expert, seed for seed.
    assert [e["seed"] for e in summary["episodes"]] == recorded["seeds"]
    assert all(e["success"] for e in summary["episodes"]), summary["episodes"]
    assert (tmp_path / "rollout" / "episode_0.mp4").is_file()

    still = _train(demos, tmp_path / "still", "ZeroPolicy", "policy.kwargs={}")
    summary = run(str(still), ["rollout.first_seed=0", f"rollout.episodes={SEEDS}", "serve.device=cpu", "rollout.videos=0"],
                  out=tmp_path / "still_rollout")
    assert not any(e["success"] for e in summary["episodes"])
