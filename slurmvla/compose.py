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

from slurmvla.config import POLICY_SCHEMAS, Config, policy_options, policy_schema

SCHEMA_NAME = "slurmvla_schema"


def check_override_keys(overrides: list[str], groups: list[str], policy_name: str | None = None) -> None:
    """Fail on a misspelled key with the keys that exist there (Hydra names only the bad one).

    ``groups`` are the config group names (``engine=ddp`` selects an option, it is no key path).
    Overrides of Hydra itself, additions (``+``), deletions (``~``) and package syntax (``@``) pass.
    ``policy.*`` keys are checked against the schema of ``policy_name`` (skipped when it is None:
    the caller checks them once it knows which policy the overrides choose).
    """
    for item in overrides:
        key = item.split("=", 1)[0]
        if "=" not in item or key.startswith(("hydra", "+", "~")) or "@" in key or key in groups:
            continue
        if key.startswith("policy."):
            if policy_name is not None:
                check_policy_keys(policy_name, [key.split(".")[1]])
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
    from hydra import initialize_config_dir

    # A config file's option its policy lacks is translated by _hydra_compose itself: the probe that
    # learns the chosen policy is needed only for policy.* overrides given here.
    check_overrides(overrides, probe=any(o.split("=", 1)[0].startswith("policy.") for o in overrides))
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return to_config(_hydra_compose(overrides))


def check_overrides(overrides: list[str], probe: bool = True) -> None:
    """Every key checked before Hydra runs: misspelled keys, and ``policy.*`` options (given here or set by a
    config file) against the schema of the policy the other overrides choose (one composition without
    them tells which)."""
    from hydra import initialize_config_dir

    check_override_keys(overrides, config_groups())
    if not probe:
        return
    own = [o for o in overrides if "=" in o and o.split("=", 1)[0].startswith("policy.")]
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            chosen = _hydra_compose([o for o in overrides if o not in own]).policy.name
        except ValueError:
            raise
        except Exception:  # sweep syntax (-m policy=a,b) and the like: Hydra reports it per job
            return
    check_policy_keys(chosen, [o.split("=", 1)[0].split(".")[1] for o in own])


def _hydra_compose(overrides: list[str]) -> DictConfig:
    """Hydra's composition; a config file setting an option its policy lacks is said as a policy error."""
    from hydra import compose as hydra_compose
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigKeyError

    try:
        return hydra_compose("config", overrides=overrides)
    except ConfigCompositionException as e:
        cause = e.__cause__ or e.__context__
        key = str(getattr(cause, "full_key", "") or "")
        schema = getattr(cause, "object_type", None)
        if isinstance(cause, ConfigKeyError) and key.startswith("policy.") and schema in POLICY_SCHEMAS.values():
            name = next(n for n, c in POLICY_SCHEMAS.items() if c is schema)
            check_policy_keys(name, [key.split(".")[1]])
        raise


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed dataclasses, running every validation rule."""
    # Hydra's own node, when present, is not part of the schema.
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    typed = OmegaConf.structured(Config)
    # The policy node takes the schema of the policy it names (a saved config re-validates the same way).
    policy = container.get("policy") or {}
    check_policy_keys(policy.get("name", "custom"), policy)
    typed.policy = OmegaConf.structured(policy_schema(policy.get("name", "custom")))
    return OmegaConf.to_object(OmegaConf.merge(typed, container))


def check_policy_keys(name: str, keys) -> None:
    """An option the named policy does not have fails with one line naming the policy and its options."""
    options = policy_options(name)
    unknown = sorted(k for k in keys if k not in options)
    if unknown:
        owners = [n for n in POLICY_SCHEMAS if unknown[0] in policy_options(n)]
        hint = f" (an option of {', '.join(f'policy.name={o}' for o in owners)})" if owners else ""
        extra = "; a plug-in's own options go in policy.kwargs" if name == "custom" else ""
        raise ValueError(f"policy.name={name} has no option {unknown[0]!r}{hint}; its options: {options}{extra}")


def policy_schema_nodes() -> dict[str, type]:
    """ConfigStore names of the policy schemas: each conf/policy/*.yaml names its own in its defaults."""
    return {f"schema_{name}": schema for name, schema in POLICY_SCHEMAS.items()}


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=Config)
    for name, schema in policy_schema_nodes().items():
        store.store(group="policy", name=name, node=schema)


register_configs()
