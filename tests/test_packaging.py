"""Configs are found from an editable checkout and from a built wheel installed elsewhere."""

from __future__ import annotations

import os
import re
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


# -- install hints: every one names an extra that exists and installs what the message says is missing -----------

HINT = re.compile(r"pip install -e '\.\[([a-z0-9_,]+)\]'|scripts/install\.sh ([a-z0-9_,]+)")
# What an error says is missing -> the extra its hint names (the messages in slurmvla/ that carry one).
NEEDS = {
    "sim": ("mujoco", "metaworld", "websockets", "msgpack"),  # inference/closed_loop.py: require_sim, INSTALL
    "serve": ("websockets", "msgpack"),  # serve.py
    "vla": ("transformers",),  # policy/pi0/model.py
    "lora": ("peft",),  # policy/lora.py
    "openpi": ("jax", "orbax"),  # policy/pi0/openpi.py
    "fp8": ("torchao",),  # inference/fp8.py
    "deepspeed": ("deepspeed",),  # engine/__init__.py, check/__init__.py
    "eval": ("matplotlib",),  # evaluate.py
    "profile": ("matplotlib",),  # profile.py
}


def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _module_of(requirement: str) -> str:
    """The top-level module a requirement installs (its distribution's name, as these distributions name them)."""
    name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
    return {"orbax-checkpoint": "orbax", "dm-tree": "tree"}.get(name, name.replace("-", "_"))


def test_every_install_hint_names_an_extra_that_exists():
    """The hints in the errors, the docs and the scripts: each extra they name is one pyproject.toml defines (or one
    scripts/install.sh handles), and none asks for the package from an index (``slurmvla[...]``: this checkout is
    the package)."""
    extras = set(_extras())
    files = [*(REPO / "slurmvla").rglob("*.py"), REPO / "README.md", *(REPO / "docs").glob("*.md"),
             *(REPO / "scripts").glob("*.sh")]
    named = {}
    for path in files:
        text = path.read_text()
        assert "install 'slurmvla[" not in text and 'install "slurmvla[' not in text, path
        for match in HINT.finditer(text):
            for extra in (match.group(1) or match.group(2)).split(","):
                named.setdefault(extra, path.relative_to(REPO))
    unknown = {extra: str(where) for extra, where in named.items() if extra not in extras}
    assert not unknown, f"install hints name extras pyproject.toml lacks: {unknown}"
    assert {"sim", "serve", "vla", "lora", "fp8", "deepspeed"} <= set(named)


def test_each_extra_installs_what_its_hint_promises():
    """An error that says a module is missing names the extra that brings it: the closed loop's ``pip install -e
    '.[sim]'`` brings every module a rollout imports (the simulators, and websockets and msgpack for the client: no
    openpi client needed), and so on for each hint (NEEDS)."""
    from slurmvla.inference import closed_loop

    extras = _extras()
    assert closed_loop.INSTALL == "pip install -e '.[sim]'"
    for extra, modules in NEEDS.items():
        installed = {_module_of(r) for r in extras[extra]}
        assert set(modules) <= installed, f"[{extra}] lacks {set(modules) - installed}: {extras[extra]}"
    # The check itself: a hint promising a module no extra brings fails it.
    assert "openpi_client" not in {_module_of(r) for r in extras["sim"]}


def test_the_wheel_lists_every_package_of_the_source_tree():
    """pyproject.toml lists the packages a wheel ships by name: each folder of slurmvla/ with an ``__init__.py`` (a
    new simulator or policy folder) must be among them, or a wheel installs without it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "slurmvla").rglob("__init__.py")}
    assert found - listed == set(), f"pyproject.toml's packages lack {sorted(found - listed)}"
