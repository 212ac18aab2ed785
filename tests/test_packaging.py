"""Configs are found from an editable checkout and from a built wheel installed elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import slurmvla
from slurmvla.train import config_dir

REPO = Path(__file__).resolve().parents[1]


def test_editable_install_uses_the_repository_conf():
    assert config_dir() == REPO / "conf"
    assert Path(slurmvla.__file__).resolve().parent == REPO / "slurmvla"


@pytest.mark.slow
def test_wheel_ships_the_configs(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(REPO)],
                   check=True, timeout=300)
    (wheel,) = wheels.glob("slurmvla-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    shipped = sorted(p.relative_to(target / "slurmvla" / "conf").as_posix() for p in (target / "slurmvla" / "conf").rglob("*.yaml"))
    in_repo = sorted(p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml"))
    assert shipped == in_repo
    # Every package of the source tree is in the wheel (the list in pyproject.toml is written by hand).
    packages = sorted(p.parent.relative_to(REPO).as_posix() for p in (REPO / "slurmvla").rglob("__init__.py"))
    missing = [p for p in packages if not (target / p / "__init__.py").is_file()]
    assert not missing, f"packages the wheel lacks (pyproject.toml's [tool.setuptools] packages): {missing}"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", "import slurmvla, slurmvla.train as t; print(slurmvla.__file__); print(t.config_dir())"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    ).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == str(target / "slurmvla" / "conf")
    # The installed app composes its configs (prints the job config, trains nothing).
    res = subprocess.run([sys.executable, "-m", "slurmvla.train", "--cfg", "job", "policy=small"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "size: small" in res.stdout and "name: single" in res.stdout
