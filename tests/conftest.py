from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from slurmvla.config import Config, to_config
from slurmvla.data.synthetic import write_droid_sample
from slurmvla.train import config_dir


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory) -> Path:
    """A small DROID-format dataset (LeRobot v3.0, real mp4), several episodes per file."""
    return write_droid_sample(tmp_path_factory.mktemp("data") / "droid_sample", num_episodes=12, seed=1,
                              episodes_per_file=5)


@pytest.fixture(scope="session")
def sample_root_v21(tmp_path_factory) -> Path:
    """A second dataset in the LeRobot v2.1 layout (one parquet and one mp4 per episode)."""
    return write_droid_sample(tmp_path_factory.mktemp("data") / "droid_v21", num_episodes=6, seed=2, format="v2.1")


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return compose(config_name="config", overrides=overrides)


@pytest.fixture
def make_cfg(sample_root):
    """Compose the shipped config with test defaults, then apply ``overrides``."""

    def make(*overrides: str) -> Config:
        base = [f"data.root={sample_root}", "data.num_workers=0", "logging.wandb.mode=disabled",
                "trainer.progress_bar=false", "trainer.global_batch_size=8", "trainer.log_every_steps=5"]
        return to_config(compose_cfg([*base, *overrides]))

    return make
