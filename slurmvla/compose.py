"""The training application's configuration: where its YAML lives, and how overrides become a ``Config``.

The schemas themselves are in ``slurmvla.config``; this module registers them in Hydra's
ConfigStore (on import), checks override keys against them, and composes, resolves and validates.
Every entry point (train, profile, inspect, the tests) composes through :func:`compose`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurmvla.config import Config
from slurmvla.config.policy import policy_options, policy_schema
from slurmvla.errors import one_line
from slurmvla.registry import POLICIES

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
        if "=" not in item or key.startswith(("hydra", "+", "~")) or "@" in key:
            continue
        if key in groups:
            _check_group_option(key, item.split("=", 1)[1])
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
                raise ValueError(f"unknown config key {key!r}: {where} has no {part!r}"
                                 f"{did_you_mean(part, names, '.'.join(walked))}; valid keys there: {sorted(names)}")
            walked.append(part)
            # The field's declared type: a nested schema is descended into, anything else ends the walk.
            node = typing.get_type_hints(node)[part]
        value = item.split("=", 1)[1]
        if len(walked) == len(key.split(".")) and dataclasses.is_dataclass(node) and not value.lstrip().startswith("{"):
            raise ValueError(group_message(key, node, value))


def did_you_mean(name: str, names, parent: str = "") -> str:
    """``" (did you mean parent.x?)"`` for the names closest to a mistyped ``name`` (difflib's), or ``""``."""
    close = difflib.get_close_matches(name, sorted(names), n=3)
    if not close:
        return ""
    return " (did you mean " + " or ".join(f"{parent}.{c}" if parent else c for c in close) + "?)"


def _check_group_option(group: str, option: str) -> None:
    """``group=option`` names a file of conf/<group>/ (Hydra would silently skip an optional group's missing
    option: ``experiment=demoo`` would train the defaults). Sweeps and Hydra's functions pass."""
    if option == "null" or not re.fullmatch(r"[\w.\-/]+", option):
        return
    options = group_options(group)
    if options and option not in options:
        provider = POLICIES.provided_by(option) if group == "policy" else ""  # a plug-in's policy, not installed
        raise ValueError(f"{group}={option} is not an option of {group}; choose one of {options}{provider}")


def _value(value: Any) -> str:
    """A value as an override would write it: null for None, strings quoted."""
    return "null" if value is None else repr(value)


def group_message(key: str, schema: type, value: Any) -> str:
    """``key`` names a group of settings (a nested schema) but was given one value: the line that says so,
    lists its settings and guesses the one meant (a path-like value: its path / root; else its name / mode)."""
    names = [f.name for f in dataclasses.fields(schema)]
    shown = ", ".join(f"{key}.{n}" for n in names[:8]) + (", ..." if len(names) > 8 else "")
    text = "null" if value is None else str(value)
    pathlike = "/" in text or text.startswith(("~", ".")) or Path(text).suffix.lower() in (".json", ".yaml", ".txt")
    wanted = [n for n in names if n in ("path", "root") or n.endswith(("_path", "_dir", "_file"))] if pathlike else []
    meant = next(iter(wanted + [n for n in ("name", "mode", "path") if n in names] + names))
    return f"{key} is a group of settings ({shown}), not one value; did you mean {key}.{meant}={text}?"


def _expected(tp: Any) -> str:
    """What a value of the declared type ``tp`` looks like, in words."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return f"{_expected(args[0])} or null"
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return "a list, e.g. [a, b]"
    if origin is dict or tp is dict:
        return "a mapping, e.g. {key: value}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _declared_type(schema: Any, key: Any) -> Any:
    if isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return typing.get_type_hints(schema).get(str(key))
    return None


def explain_config_error(error: BaseException) -> str | None:
    """One line for a user's configuration mistake that Hydra or OmegaConf reports over several (an unknown
    group option, a value of the wrong type, a plain value for a group of settings, an unknown key);
    None when ``error`` is none of those."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, ValidationError

    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, name = str(error.missing_cfg_file).rpartition("/")
        group = group.replace("/", ".")
        return f"{group}={name} is not an option of {group}; choose one of {sorted(error.options)}"
    if isinstance(error, OverrideParseException):
        return f"cannot parse the override {error.override!r}: {one_line(error.message)}"
    cause = error if isinstance(error, OmegaConfBaseException) else (error.__cause__ or error.__context__)
    if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "full_key", None):
        return None
    key, schema = str(cause.full_key), cause.object_type
    if isinstance(cause, ConfigKeyError) and dataclasses.is_dataclass(schema):
        parent, _, last = key.rpartition(".")
        names = sorted(f.name for f in dataclasses.fields(schema))
        return (f"unknown config key {key!r}: {parent or 'the top level'} has no {last!r}"
                f"{did_you_mean(last, names, parent)}; valid keys there: {names}")
    if isinstance(cause, ValidationError):
        declared = _declared_type(schema, cause.key)
        if declared is not None and dataclasses.is_dataclass(declared):
            return group_message(key, declared, cause.value)
        if declared is not None:
            return f"{key}={_value(cause.value)} is not valid; it must be {_expected(declared)}"
    outer = one_line(str(error)) if error is not cause else ""
    if outer and not outer.startswith("Error merging override"):  # Hydra's own words say more (e.g. use +key=)
        return outer
    return f"{key}: {one_line(str(cause.msg))}"


def config_dir() -> Path:
    """conf/ inside an installed wheel, else the repository's top-level conf/ (editable install)."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


def group_options(group: str) -> list[str]:
    """The options of a config group: its files in conf/<group>/, and for ``policy`` every registered policy too
    (one without a file of its own is its schema's node: :func:`register_configs`)."""
    options = sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))
    return sorted({*options, *POLICIES}) if group == "policy" else options


def config_groups() -> list[str]:
    return sorted(p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def compose(overrides: list[str]) -> Config:
    """The typed config a run with these overrides would get (keys checked first, every rule run)."""
    from hydra import initialize_config_dir

    check_overrides(overrides, probe=False)
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            return to_config(_one_line(lambda: _hydra_compose(overrides)))
    except ValueError:
        _name_the_policy_keys(overrides)
        raise


def _one_line(composition: typing.Callable[[], DictConfig]) -> DictConfig:
    """``composition()``; any error of Hydra's it raises that is not explained already, as one line."""
    from hydra.errors import HydraException

    try:
        return composition()
    except HydraException as e:  # e.g. sweep syntax outside a multirun: Hydra's lines, as one
        raise ValueError(one_line(str(e))) from None


def _name_the_policy_keys(overrides: list[str]) -> None:
    """After a failed composition: a policy.* override the chosen policy lacks is named with that policy's options
    by the probe (one more composition, so only when the first failed) instead of Hydra's "Could not override". A
    config file's option its policy lacks is translated by _hydra_compose itself."""
    if any(o.split("=", 1)[0].startswith("policy.") for o in overrides):
        check_overrides(overrides, whole=False)


def check_overrides(overrides: list[str], probe: bool = True, whole: bool = True) -> None:
    """Every key checked before Hydra runs: misspelled keys, and ``policy.*`` options (given here or set by a
    config file) against the schema of the policy the other overrides choose (one composition without
    them tells which). A value of the wrong type, an unknown group option or a plain value for a group of
    settings fails here too, as one line (:func:`explain_config_error`); ``whole``: the ``policy.*`` values
    as well (one more composition, only when there are any; :func:`compose` composes them itself)."""
    from hydra import initialize_config_dir

    check_override_keys(overrides, config_groups())
    if not probe:
        return
    register_configs()
    own = [o for o in overrides if "=" in o and o.split("=", 1)[0].startswith("policy.")]
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        try:
            chosen = _hydra_compose([o for o in overrides if o not in own]).policy.name
        except ValueError:
            raise
        except Exception:  # sweep syntax (-m policy=a,b) and the like: Hydra reports it per job
            return
        check_policy_keys(chosen, [o.split("=", 1)[0].split(".")[1] for o in own])
        if own and whole:
            try:
                _hydra_compose(overrides)
            except ValueError:
                raise
            except Exception:
                return


def _hydra_compose(overrides: list[str]) -> DictConfig:
    """Hydra's composition; a config file setting an option its policy lacks is said as a policy error."""
    from hydra import compose as hydra_compose

    return _explained(lambda: hydra_compose("config", overrides=overrides))


def _explained(composition: typing.Callable[[], DictConfig]) -> DictConfig:
    """``composition()``, a user's mistake in it raised as one ValueError (an option its policy lacks said as a
    policy error); anything else as it was raised."""
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from omegaconf.errors import ConfigKeyError

    try:
        return composition()
    except OverrideParseException as e:
        raise ValueError(explain_config_error(e)) from None
    except ConfigCompositionException as e:
        cause = e.__cause__ or e.__context__
        key = str(getattr(cause, "full_key", "") or "")
        schema = getattr(cause, "object_type", None)
        name = next((n for n in POLICIES if policy_schema(n) is schema), None) if key.startswith("policy.") else None
        if isinstance(cause, ConfigKeyError) and name is not None:
            check_policy_keys(name, [key.split(".")[1]])
        message = explain_config_error(e)
        if message:
            raise ValueError(message) from None
        raise


class HydraRun:
    """``@hydra.main``'s run of ``task`` (the run directory, ``.hydra/``, logging and callbacks, as Hydra 1.3's
    ``Hydra.run`` makes them) from one composition. ``@hydra.main`` composes twice, Hydra reading ``hydra.mode``
    with a silent composition of its own before the run's; a command line of overrides alone (no flag: ``-m``,
    ``--cfg`` and the like go through ``@hydra.main``) needs neither that nor a check composition before it. The
    keys are checked first (no composition); a mistake the composition finds is one ValueError, as in
    :func:`compose`. ``multirun``: the composed config asks for a multirun itself (``hydra.mode``), which this
    does not run (the caller hands it to ``@hydra.main``)."""

    def __init__(self, task: typing.Callable[[DictConfig], Any], overrides: list[str]):
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import (
            create_automatic_config_search_path,
            detect_calling_file_or_module_from_task_function,
            detect_task_name,
        )
        from hydra.core.global_hydra import GlobalHydra
        from hydra.types import RunMode

        check_overrides(overrides, probe=False)
        register_configs()
        self.task = task
        calling_file, calling_module = detect_calling_file_or_module_from_task_function(task)
        search_path = create_automatic_config_search_path(calling_file, calling_module, str(config_dir()))
        self.app = Hydra.create_main_hydra2(task_name=detect_task_name(calling_file, calling_module),
                                           config_search_path=search_path)
        try:
            self.cfg = _one_line(lambda: _explained(lambda: self.app.compose_config(
                "config", overrides=list(overrides), run_mode=RunMode.RUN, with_log_configuration=True)))
        except ValueError:
            GlobalHydra.instance().clear()  # the probe composes on a Hydra of its own
            _name_the_policy_keys(overrides)
            raise
        except BaseException:
            GlobalHydra.instance().clear()
            raise
        self.multirun = self.cfg.hydra.mode == RunMode.MULTIRUN
        if self.multirun:
            GlobalHydra.instance().clear()
        elif self.cfg.hydra.mode is None:
            self.cfg.hydra.mode = RunMode.RUN

    def run(self) -> Any:
        """Run the task in its run directory; its return value (its exception, raised again)."""
        from hydra._internal.callbacks import Callbacks
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.utils import run_job
        from hydra.types import HydraContext

        try:
            callbacks = Callbacks(self.cfg)
            callbacks.on_run_start(config=self.cfg, config_name="config")
            ret = run_job(hydra_context=HydraContext(config_loader=self.app.config_loader, callbacks=callbacks),
                          task_function=self.task, config=self.cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                          configure_logging=True)
            callbacks.on_run_end(config=self.cfg, config_name="config", job_return=ret)
            return ret.return_value
        finally:
            GlobalHydra.instance().clear()


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed dataclasses, running every validation rule."""
    # Hydra's own node, when present, is not part of the schema.
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve (${oc.env:UNSET})
        raise ValueError(f"{getattr(e, 'full_key', '') or 'the config'}: {one_line(str(getattr(e, 'msg', e)))}") from None
    container.pop("hydra", None)
    typed = OmegaConf.structured(Config)
    # The policy node takes the schema of the policy it names (a saved config re-validates the same way).
    policy = container.get("policy") or {}
    if not isinstance(policy, dict):
        raise ValueError(group_message("policy", policy_schema("custom"), policy))
    check_policy_keys(policy.get("name", "custom"), policy)
    typed.policy = OmegaConf.structured(policy_schema(policy.get("name", "custom")))
    try:
        return OmegaConf.to_object(OmegaConf.merge(typed, container))
    except OmegaConfBaseException as e:  # a saved config of another version: an unknown key, a wrong type
        raise ValueError(explain_config_error(e) or one_line(str(e))) from None


def check_policy_keys(name: str, keys) -> None:
    """An option the named policy does not have fails with one line naming the policy and its options."""
    options = policy_options(name)
    unknown = sorted(k for k in keys if k not in options)
    if unknown:
        owners = [n for n in POLICIES if unknown[0] in policy_options(n)]
        hint = f" (an option of {', '.join(f'policy.name={o}' for o in owners)})" if owners else ""
        extra = "; a plug-in's own options go in policy.kwargs" if name == "custom" else ""
        meant = "" if owners else did_you_mean(unknown[0], options, "policy")
        raise ValueError(f"policy.name={name} has no option {unknown[0]!r}{hint}{meant}; its options: {options}{extra}")


# ConfigStore names already stored -> the registry's schema string they were stored from.
_stored: dict[str, str] = {}


def register_configs() -> None:
    """``Config`` and each registered policy's schema in Hydra's ConfigStore: ``policy/schema_<name>``, which
    each conf/policy/*.yaml names first in its defaults, and, for a policy that has no file of its own name
    there, ``policy/<name>`` itself, so that ``policy=<name>`` selects it at its schema's defaults (a policy
    added in one module needs no YAML). Run on import and before each composition: a policy registered
    later is stored then; one already stored is not stored again."""
    store = ConfigStore.instance()
    if SCHEMA_NAME not in _stored:
        store.store(name=SCHEMA_NAME, node=Config)
        _stored[SCHEMA_NAME] = ""
    files = None
    for name in POLICIES:
        entry = POLICIES.get(name)
        if _stored.get(name) == entry.schema:
            continue
        files = {p.stem for p in (config_dir() / "policy").glob("*.yaml")} if files is None else files
        schema = entry.load_schema()
        store.store(group="policy", name=f"schema_{name}", node=schema)
        if name not in files:
            node = OmegaConf.structured(schema)
            node.name = name
            store.store(group="policy", name=name, node=node)
        _stored[name] = entry.schema


register_configs()
