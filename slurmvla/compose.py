"""The training application's configuration: where its YAML lives, and how overrides become a ``Config``.

The schemas themselves are in ``slurmvla.config``; this module registers them in Hydra's
ConfigStore (on import), checks override keys against them, and composes, resolves and validates.
Every entry point (train, profile, inspect, the tests) composes through :func:`compose`.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from slurmvla.config import Config

SCHEMA_NAME = "slurmvla_schema"


def check_override_keys(overrides: list[str], groups: list[str]) -> None:
    """Fail on a misspelled key with the keys that exist there (Hydra names only the bad one).

    ``groups`` are the config group names (``engine=ddp`` selects an option, it is no key path).
    Overrides of Hydra itself, additions (``+``), deletions (``~``) and package syntax (``@``) pass.
    """
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or key.startswith(("hydra", "+", "~")) or "@" in key or key in groups:
            continue
        node: Any = Config
        walked: list[str] = []
        for part in key.split("."):
            if not dataclasses.is_dataclass(node):
                break
            names = {f.name for f in dataclasses.fields(node)}
            if part not in names:
                where = ".".join(walked) or "the top level"
                raise ValueError(f"unknown config key {key!r}: {where} has no {part!r}; valid keys there: "
                                 f"{sorted(names)}")
            walked.append(part)
            # The field's declared type: a nested schema is descended into, anything else ends the walk.
            node = typing.get_type_hints(node)[part]


def config_dir() -> Path:
    """conf/ inside an installed wheel, else the repository's top-level conf/ (editable install)."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


def config_groups() -> list[str]:
    return sorted(p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def compose(overrides: list[str]) -> Config:
    """The typed config a run with these overrides would get (keys checked first, every rule run)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    check_override_keys(overrides, config_groups())
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return to_config(hydra_compose("config", overrides=overrides))


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed dataclasses, running every validation rule."""
    # Hydra's own node, when present, is not part of the schema.
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    typed = OmegaConf.merge(OmegaConf.structured(Config), container)
    return OmegaConf.to_object(typed)


def register_configs() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


register_configs()
