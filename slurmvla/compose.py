"""The training application's configuration: where its YAML lives, and how overrides become a ``Config``.

The schemas themselves are in ``slurmvla.config``; this module registers them in Hydra's
ConfigStore (on import), checks override keys against them, and composes, resolves and validates.
Every composition goes one route, :class:`HydraApp`: a start-up's (``python -m slurmvla.train``, its flags
included: :meth:`HydraApp.start`) and a program's (profile, plan, inspect, the tests: :func:`compose`).
"""

from __future__ import annotations

import copy
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
from slurmvla.errors import boundary, one_line
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
        if "=" in item and not key.lstrip("+~").split("@")[0].strip():  # Hydra's own words for it name nothing, or
            # it fails inside Hydra (an assert: "+=${x}")
            raise ValueError(f"the override {item!r} names no key: give key=value (+key=value adds a key, ~key "
                             "removes one)")
        if key.lstrip("+~") in groups and "@" not in key:
            _check_group_option(key.lstrip("+~"), item)
            continue
        if "=" not in item or key.startswith(("hydra", "+", "~")) or "@" in key:
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


def _check_group_option(group: str, item: str) -> None:
    """``item`` (``group=option``, ``+group=option``, ``~group``) names a file of conf/<group>/ (Hydra would
    silently skip an optional group's missing option: ``experiment=demoo`` would train the defaults). A value that
    names no file (a number, null, a list holding one) and the removal of a group every run needs are refused the
    same way, with the options: Hydra's composition would fail over them without naming the group (``engine=1e5``,
    ``experiment=null``) or with a TypeError (``data=[1,2]``), an AttributeError (``~checkpoint``
    ``~checkpoint.every_steps``). Sweeps, Hydra's functions and what Hydra cannot parse (it says why) pass."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        override = OverridesParser.create().parse_overrides([item])[0]
    except HydraException:
        return
    if override.is_sweep_override():
        return
    options = group_options(group)
    listed = f"; choose one of {options}" if options else ""
    needed = group in required_groups()
    if override.is_delete():
        if needed:
            raise ValueError(f"{item}: every run needs an option of {group}{listed}")
        return
    value = override.value()
    if isinstance(value, dict):  # settings merged into the group's node: checked as keys by the composition
        return
    if value == [] and needed:
        raise ValueError(f"{item} chooses no option of {group}, which every run needs{listed}")
    listed_many = isinstance(value, list)  # each item a file's name: Hydra takes no interpolation there
    for option in value if listed_many else [value]:
        if isinstance(option, str) and (not options or option in options
                                        or not listed_many and not re.fullmatch(r"[\w.\-/]+", option)):
            continue
        shown = item.split("=", 1)[1] if not listed_many else "null" if option is None else str(option)
        provider = POLICIES.provided_by(str(option)) if group == "policy" else ""  # a plug-in's policy, not installed
        unset = f" (~{group} runs without one)" if option is None and not needed else ""
        raise ValueError(f"{group}={shown} is not an option of {group}{listed}{provider}{unset}")


def required_groups() -> set[str]:
    """The config groups conf/config.yaml's defaults list chooses an option of for every run (not ``optional``)."""
    defaults = OmegaConf.load(config_dir() / "config.yaml").get("defaults") or []
    return {name.split("@")[0].strip() for entry in defaults if isinstance(entry, DictConfig) for name in entry
            if not name.startswith(("optional ", "override "))}


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
    check_override_keys(overrides, config_groups())
    with HydraApp() as hydra:
        try:
            return to_config(hydra.compose(overrides))
        except ValueError:
            hydra.name_the_policy_keys(overrides)
            raise


def _explained(composition: typing.Callable[[], Any]) -> Any:
    """``composition()``, a mistake of the user's in it (Hydra's or OmegaConf's report over several lines) raised as
    one ValueError: an option its policy lacks said as a policy error (:func:`check_policy_keys`), the others by
    :func:`explain_config_error`, anything else of Hydra's (sweep syntax outside a multirun) as its lines joined."""
    from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
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
        raise ValueError(explain_config_error(e) or one_line(str(e))) from None
    except HydraException as e:
        raise ValueError(one_line(str(e))) from None


def _usage(message: str) -> typing.NoReturn:
    raise ValueError(message)


class HydraApp:
    """conf/ as one Hydra application, and the one route of every composition: :func:`compose` (the programs, the
    tests) and a start-up (:meth:`start`: a run, a multirun, ``--dry-run``, ``--cfg``, ``--help``) compose through
    it, once each (tests/test_config.py counts them), a user's mistake as one ValueError (:func:`_explained`).

    Hydra's public API where it serves: ``initialize_config_dir`` sets the application up (the search path
    ``@hydra.main`` builds on conf/; ``name`` is ``hydra.job.name``, the run's log file), ``run_job`` runs a job,
    ``Plugins`` makes the config's sweeper. This class is the one place slurmvla uses Hydra's private API
    (``hydra._internal``, pinned by ``hydra-core<1.4``), for what the public one lacks:

    - a composition for a multirun: ``hydra.compose`` composes a run's config only (it calls the application's
      ``compose_config`` with the run mode fixed), and ``@hydra.main``, the public way to a multirun, composes every
      run and multirun twice (Hydra 1.3 reads ``hydra.mode`` with a silent composition of its own first);
    - the ``HydraContext`` that ``run_job`` and a sweeper take holds Hydra's ``Callbacks`` (the config's
      ``hydra.callbacks``), a private class;
    - ``@hydra.main``'s command line (its parser) and the output of its flags (``--cfg``, ``--help``,
      ``--hydra-help``, ``--info``, ``--shell-completion``), which ``@hydra.main`` gives only with its twice-composing
      run.
    """

    def __init__(self, name: str = "slurmvla"):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        register_configs()
        self._initialized = initialize_config_dir(config_dir=str(config_dir()), job_name=name, version_base=None)
        self.app = GlobalHydra.instance().hydra

    def __enter__(self) -> HydraApp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._initialized.__exit__(*exc)  # Hydra as it was before (none, or an enclosing application)

    def compose(self, overrides: list[str], multirun: bool = False, log: bool = False) -> DictConfig:
        """conf/config.yaml with these overrides, Hydra's node kept (``hydra.*``); ``multirun``: the sweep's config
        (its sweep overrides left to its sweeper); ``log``: Hydra's own logging configured from it."""
        from hydra.types import RunMode

        mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        return _explained(lambda: self.app.compose_config("config", list(overrides), run_mode=mode,
                                                          with_log_configuration=log))

    def name_the_policy_keys(self, overrides: list[str], multirun: bool = False) -> None:
        """After a failed composition: a ``policy.*`` override the chosen policy lacks is named with that policy's
        options, the policy told by a probe (one more composition, without those overrides: on this failure path
        only) instead of Hydra's "Could not override". A config file's option its policy lacks is said so by
        :func:`_explained` itself."""
        own = [o for o in overrides if "=" in o and o.split("=", 1)[0].startswith("policy.")]
        if not own:
            return
        try:
            chosen = self.compose([o for o in overrides if o not in own], multirun=multirun).policy.name
        except ValueError:  # the others are wrong too: the first composition's error says so
            return
        check_policy_keys(chosen, [o.split("=", 1)[0].split(".")[1] for o in own])

    def start(self, args: list[str], task: typing.Callable[[DictConfig], Any],
              dry_run: typing.Callable[[DictConfig, list[str]], None] | None = None) -> Any:
        """A start-up from its command line, as ``@hydra.main`` takes it (its flags; ``--dry-run`` too when given
        ``dry_run``): the keys checked without composing, the config composed once, then ``task`` run in its run
        directory (``.hydra/``, logging, callbacks), or swept by the config's sweeper and launcher (``-m``, or a config
        asking for ``hydra.mode=MULTIRUN``), or the config printed (``--cfg``, ``--help``) or described (``--dry-run``:
        ``dry_run(cfg, overrides)``). A mistake before anything runs is one line, exit 2. What a run returns (its
        exception, raised again)."""
        from hydra.types import RunMode

        with boundary():
            parser, flags = self._parse(args, dry_run is not None)
            overrides = list(flags.overrides)
            if flags.shell_completion:  # its key=value are the completion's (install=bash), not overrides
                return _explained(lambda: self.app.shell_completion(config_name="config", overrides=overrides))
            check_override_keys(overrides, config_groups())
            try:
                if flags.help:
                    return _explained(lambda: self.app.app_help(config_name="config", args_parser=parser, args=flags))
                if flags.hydra_help:
                    return _explained(lambda: self.app.hydra_help(config_name="config", args_parser=parser, args=flags))
                if flags.cfg:
                    return _explained(lambda: self.app.show_cfg(config_name="config", overrides=overrides,
                                                                cfg_type=flags.cfg, package=flags.package,
                                                                resolve=flags.resolve))
                if flags.info:
                    return _explained(lambda: self.app.show_info(flags.info, config_name="config", overrides=overrides))
                # -m: a multirun, as @hydra.main makes it (hydra.mode=MULTIRUN, which each job's config keeps).
                mode = ["hydra.mode=MULTIRUN"] if flags.multirun else []
                cfg = self.compose(overrides + mode, multirun=flags.multirun, log=not flags.dry_run)
            except ValueError:
                self.name_the_policy_keys(overrides, flags.multirun)
                raise
            if flags.dry_run:
                return dry_run(cfg, overrides)
        if cfg.hydra.mode == RunMode.MULTIRUN:  # -m, or the config asks for one (its sweep parameters, say)
            return self._sweep(task, cfg)
        cfg.hydra.mode = RunMode.RUN
        return self._run(task, cfg)

    def _parse(self, args: list[str], dry_run: bool) -> tuple[typing.Any, typing.Any]:
        """``@hydra.main``'s parser (and ``--dry-run``) and its reading of ``args``; a mistake in them as one line:
        an unknown flag, a flag slurmvla's conf/ leaves no use for, several commands, or a sweep without ``-m``."""
        from hydra._internal.utils import get_args_parser

        parser = get_args_parser()
        if dry_run:
            parser.add_argument("--dry-run", action="store_true",
                                help="Print what would run or be submitted (the command, the sbatch script), run nothing")
        options = [s for action in parser._actions for s in action.option_strings]
        for arg in args:
            if arg.startswith("-") and arg.split("=", 1)[0] not in options:
                raise ValueError(f"unknown option {arg!r}; the options are {', '.join(options)} (overrides are key=value)")
        parser.error = _usage  # argparse's own mistakes (a missing value, a bad choice): one line, not its usage block
        flags = parser.parse_args(args)
        flags.dry_run = getattr(flags, "dry_run", False)
        for name in ("config_path", "config_name", "config_dir", "experimental_rerun"):
            if getattr(flags, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} is not supported: the configs are slurmvla's conf/ "
                                 "(a new option is a file in its group there)")
        if flags.resolve and not (flags.cfg or flags.help):
            raise ValueError("--resolve goes with --cfg or --help")
        if flags.run + flags.multirun + bool(flags.cfg) + flags.shell_completion + bool(flags.info) > 1:
            raise ValueError("give one of --run, --multirun, --cfg, --info and --shell-completion")
        if not flags.multirun:
            self._refuse_sweeps(flags.overrides)
        return parser, flags

    @staticmethod
    def _refuse_sweeps(overrides: list[str]) -> None:
        """Several values for a key without ``-m``: one line saying both ways out."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException

        try:
            parsed = OverridesParser.create().parse_overrides(overrides)
        except HydraException:
            return  # the composition says what is wrong with it
        sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
        if sweeps:
            raise ValueError(f"{sweeps[0]} gives several values: add -m (--multirun) to run one job per value, or give "
                             "one value (a comma inside a value: quote it, key='a,b')")

    def _context(self, cfg: DictConfig, loader: Any = None) -> Any:
        from hydra._internal.callbacks import Callbacks
        from hydra.types import HydraContext

        return HydraContext(config_loader=loader or self.app.config_loader, callbacks=Callbacks(cfg))

    def _run(self, task: typing.Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
        """``task`` on the composed ``cfg`` in its run directory, as Hydra 1.3's ``Hydra.run`` runs it."""
        from hydra.core.utils import run_job

        context = self._context(cfg)
        context.callbacks.on_run_start(config=cfg, config_name="config")
        ret = run_job(hydra_context=context, task_function=task, config=cfg, job_dir_key="hydra.run.dir",
                      job_subdir_key=None, configure_logging=True)
        context.callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
        return ret.return_value

    def _sweep(self, task: typing.Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
        """The sweep of the composed multirun ``cfg`` by its sweeper and launcher, as Hydra 1.3's ``Hydra.multirun``
        runs it, each job's config composed once in the process that runs it (:class:`_EachJobOnce`)."""
        from hydra.core.plugins import Plugins

        context = self._context(cfg, _EachJobOnce(self.app.config_loader))
        context.callbacks.on_multirun_start(config=cfg, config_name="config")
        sweeper = Plugins.instance().instantiate_sweeper(config=cfg, hydra_context=context, task_function=task)
        returns = sweeper.sweep(arguments=OmegaConf.to_container(cfg.hydra.overrides.task, resolve=False))
        context.callbacks.on_multirun_end(config=cfg, config_name="config")
        return returns


class _EachJobOnce:
    """A sweep's config loader: Hydra's, but a job's config is composed once in a process. A sweeper composes each
    job of a batch before it launches any (Hydra's ``Sweeper.validate_batch_is_legal``: a mistake in the last job is
    found before the first runs); a launcher that runs the jobs in this process (Hydra's basic one) takes that
    composition instead of composing again. One that runs them elsewhere (submitit: each job in its own process)
    composes there, as Hydra does: the compositions do not travel with the loader."""

    def __init__(self, loader: Any):
        self.loader, self.composed = loader, {}

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> DictConfig:
        key = (id(master_config), tuple(sweep_overrides))
        if key in self.composed:
            return self.composed.pop(key)
        cfg = self.loader.load_sweep_config(master_config, sweep_overrides)
        self.composed[key] = copy.deepcopy(cfg)  # the launcher's, as it would compose it (it changes its own)
        return cfg

    def __getattr__(self, name: str) -> Any:  # the rest is Hydra's loader
        if name in ("loader", "composed"):
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __getstate__(self) -> dict[str, Any]:
        return {"loader": self.loader, "composed": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def to_config(cfg: DictConfig) -> Config:
    """Resolve a composed DictConfig into the typed dataclasses, running every validation rule."""
    if "hydra" in cfg:  # Hydra's own node (a composition's, HydraApp.compose) is not part of the schema
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:  # an interpolation that does not resolve (${oc.env:UNSET})
        raise ValueError(f"{getattr(e, 'full_key', '') or 'the config'}: {one_line(str(getattr(e, 'msg', e)))}") from None
    refuse_nan(container)
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


def refuse_nan(value: Any, key: str = "") -> None:
    """No setting is NaN (``optim.lr=nan``): every range check passes it (NaN compares false), and a run would train
    on it. A ValueError names the key."""
    if isinstance(value, float) and value != value:
        raise ValueError(f"{key}=nan is not valid; it must be a number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        refuse_nan(v, f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}" if key else str(k))


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
