"""Registries: one table per kind of pluggable component, and what each entry can do.

Config validation, the builders and the tools read these tables; nothing else lists the names.
Adding an engine or a schedule is its own file (or function) plus one entry here; a policy is one folder
of ``slurmvla/policy/`` that declares its own entries (:func:`policy_folders`). An
entry names its implementation as ``"module:attribute"`` and imports it only when used, so
validating a config never imports torch's distributed stack or DeepSpeed; a policy's entry names its
options' schema the same way (``PolicyEntry.schema``), so it needs no other table. The fixed choice lists (data
modes, resize modes, simulated embodiments, execution modes, ...) are no registry: each is in the schema module of
the package that owns it (``slurmvla/config/data.py``, ...).

This module is at the bottom of the import graph: it imports no other slurmvla module, but for the policy
folders' torch-free ``config`` modules, by name, when the policy table is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any, Generic, TypeVar


def import_target(target: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Entry:
    name: str
    # "package.module:attribute", imported by load().
    target: str

    def load(self) -> Any:
        return import_target(self.target)


@dataclass(frozen=True)
class EngineEntry(Entry):
    # Keyword arguments the engine class is built with (the variant: mesh shape, ZeRO stage, ...).
    options: Mapping[str, Any] = field(default_factory=dict)
    # False: one process only (a larger world is refused at start-up).
    multi_process: bool = True
    # Torch activation checkpointing is refused where it is known to corrupt gradients.
    activation_checkpointing: bool = True
    # Whether a checkpoint written at one world size resumes at another.
    resumes_at_any_world_size: bool = True
    # Writes checkpoints in the background under checkpoint.async_save, as the engine's declared strategy does
    # (StateIO.checkpointing, SnapshotThenWrite or WriteInBackground: slurmvla/engine/base.py; the two agree for
    # every registered engine, tests/engine/test_state_io.py); False: it saves synchronously, and says so once
    # when async_save asks otherwise.
    background_save: bool = False
    # "module:function" reading the full fp32 model state of a checkpoint folder in one process.
    full_state_loader: str = "slurmvla.engine.single:load_safetensors_model"
    # An optional package the engine needs, and the extra that installs it.
    requires: str | None = None
    # Said under the profiler's phase table (where the engine's phases do not mean what they say).
    profile_note: str | None = None
    # Takes a policy built with its parameters on the meta device and materialises it on its device
    # (a sharding engine: only each rank's part; slurmvla/engine/materialize.py), for policies that can
    # initialise parameters one by one. DeepSpeed builds its own partitions from a whole model.
    deferred_init: bool = False
    # Every rank holds the whole model between steps (only optimizer state, if anything, is sharded):
    # in-training closed-loop episodes (trainer.rollout_every_steps) run on each rank's copy.
    whole_model: bool = True
    # "module:function" giving the bytes each GPU holds (python -m slurmvla.plan): called as
    # f(engine_cfg, precision, tensors, world, gpus_per_node, **options) -> States (slurmvla/engine/memory.py),
    # written beside the engine; None: the planner refuses to plan the engine.
    memory_rule: str | None = None

    def load_full_state(self, checkpoint: Any) -> Any:
        return import_target(self.full_state_loader)(checkpoint)

    def model_states(self, cfg: Any, precision: str, tensors: Any, world: int, gpus_per_node: int) -> Any:
        """The engine's memory rule for this configuration on ``world`` ranks, ``gpus_per_node`` a node."""
        if self.memory_rule is None:
            raise ValueError(f"engine={self.name!r}: the planner has no memory rules for it (its registry entry "
                             "names no memory_rule)")
        return import_target(self.memory_rule)(cfg, precision, tensors, world, gpus_per_node, **self.options)


@dataclass(frozen=True)
class SchedulerEntry(Entry):
    """``target``: ``f(cfg: SchedulerConfig, max_steps, group_names) -> [factor(step) per group]``."""


@dataclass(frozen=True)
class PolicyEntry(Entry):
    """``target``: an ``nn.Module`` class built as ``cls(policy_cfg, stats, **policy.kwargs)``; empty:
    the class is named by the config's ``policy.target`` (a user's own policy).

    ``schema``: ``"module:Class"`` of the policy's options, a dataclass deriving from
    ``slurmvla.config.policy.PolicyConfig`` whose ``name`` defaults to the entry's; the config layer imports it
    by this name to validate ``policy.*`` and registers it in Hydra's ConfigStore (``policy=<name>``
    selects it at its defaults where conf/policy/ has no file of that name). Its module imports no torch,
    so validating a config never imports the model."""

    schema: str = "slurmvla.config.policy:PolicyConfig"

    def load_schema(self) -> Any:
        return import_target(self.schema)


E = TypeVar("E", bound=Entry)


class Registry(Generic[E]):
    """Name -> entry, in registration order. Iterating yields the names.

    ``discover``: a function returning entries declared elsewhere (the policies' folders), called once, on
    the table's first use, so that importing this module imports nothing else."""

    def __init__(self, key: str, discover: Callable[[], Iterable[E]] | None = None,
                 elsewhere: Mapping[str, str] | None = None):
        self.key = key  # the config key that selects an entry, for error messages
        self._table: dict[str, E] = {}
        self._discover = discover
        # Names that a package not installed here provides -> that package and its install command.
        self.elsewhere = dict(elsewhere or {})

    @property
    def _entries(self) -> dict[str, E]:
        if self._discover is not None:
            discover, self._discover = self._discover, None
            for entry in discover():
                self.add(entry)
        return self._table

    def add(self, entry: E) -> E:
        if entry.name in self._entries:
            raise ValueError(f"{self.key}: {entry.name!r} is registered twice")
        self._table[entry.name] = entry
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self, **capabilities: Any) -> tuple[str, ...]:
        """The names whose entries have every given capability value, e.g. ``activation_checkpointing=True``."""
        return tuple(n for n, e in self._entries.items() if all(getattr(e, k) == v for k, v in capabilities.items()))

    def get(self, name: str) -> E:
        """The entry, or a ValueError naming the value and the valid choices."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"{self.key}={name!r} is not valid; choose one of {list(self._entries)}"
                             f"{self.provided_by(name)}")
        return entry

    def provided_by(self, name: str) -> str:
        """``"; <name> is provided by <package>: <install command>"`` for a name a package that is not installed
        provides (``elsewhere``), else ``""``: the end of an error that refuses the name."""
        return f"; {name} is provided by {self.elsewhere[name]}" if name in self.elsewhere else ""

    def check(self, name: str) -> None:
        self.get(name)


# -- engines -------------------------------------------------------------------------------------

ENGINES: Registry[EngineEntry] = Registry("engine.name")
ENGINES.add(EngineEntry("single", "slurmvla.engine.single:SingleEngine", multi_process=False, background_save=True,
                        deferred_init=True, memory_rule="slurmvla.engine.single:model_states"))
ENGINES.add(EngineEntry("ddp", "slurmvla.engine.ddp:DDPEngine", background_save=True, deferred_init=True,
                        memory_rule="slurmvla.engine.ddp:model_states"))
for _name, _options in (("fsdp_full", {"hybrid": False, "reshard_after_forward": True}),
                        ("fsdp_grad_op", {"hybrid": False, "reshard_after_forward": False}),
                        ("hsdp", {"hybrid": True, "reshard_after_forward": True})):
    ENGINES.add(EngineEntry(_name, "slurmvla.engine.fsdp:FSDPEngine", MappingProxyType(_options),
                            full_state_loader="slurmvla.engine.fsdp:load_dcp_model", deferred_init=True,
                            background_save=True, whole_model=False, memory_rule="slurmvla.engine.fsdp:model_states"))
for _stage in (1, 2, 3):
    ENGINES.add(EngineEntry(
        f"zero{_stage}", "slurmvla.engine.zero:DeepSpeedEngine", MappingProxyType({"stage": _stage}),
        activation_checkpointing=_stage != 3, resumes_at_any_world_size=False, background_save=True, whole_model=_stage != 3,
        full_state_loader="slurmvla.engine.zero:load_zero_model", requires="deepspeed",
        memory_rule="slurmvla.engine.zero:model_states",
        profile_note="under DeepSpeed the gradient reduction and part of the optimizer work run inside backward; "
                     "compare phase totals across engines only as a whole step"))

# -- policies ------------------------------------------------------------------------------------

# A built-in policy is one folder of slurmvla/policy/ whose config.py (its options, no torch) declares what
# policy.name selects: ENTRIES, a tuple of PolicyEntry. Nothing is listed here.
POLICY_PACKAGE = "slurmvla.policy"
# The name of the tuple of entries a policy or simulator folder's config.py declares.
ENTRIES = "ENTRIES"
# An installed distribution adds policy folders through this entry-point group: its pyproject.toml's
# [project.entry-points."slurmvla.policies"] names a package whose sub-folders are policy folders, read as
# slurmvla/policy/'s are (examples/metaworld_study).
POLICY_PLUGINS = "slurmvla.policies"
# The policies of this repository's own plug-ins, for the error that refuses one where its plug-in is not installed.
_STUDY = "the plug-in slurmvla-metaworld-study (pip install -e examples/metaworld_study)"
PLUGIN_POLICIES = {name: _STUDY for name in ("keypoints_crop", "keypoints_flow_crop", "keypoints_flow_labelled",
                                             "keypoints_flow_aux", "keypoints_flow_pixel_aux")}


def plugin_packages(group: str) -> list[ModuleType]:
    """The packages that installed distributions name under the entry-point group ``group`` (in a distribution's
    pyproject.toml: ``[project.entry-points."<group>"] <name> = "<package>"``), imported, by entry-point name. An
    entry that does not import, or names no package (a folder), is a ValueError naming its distribution."""
    from importlib.metadata import entry_points

    packages = []
    for point in sorted(entry_points(group=group), key=lambda p: p.name):
        dist = f"the installed distribution {point.dist.name}" if point.dist is not None else "an installed distribution"
        where = f"{dist}'s entry point {point.name} = {point.value!r} (group {group!r})"
        try:
            package = point.load()
        except Exception as e:  # noqa: BLE001 - whatever the plug-in raises, said as one line naming it
            raise ValueError(f"{where} does not import ({type(e).__name__}: {e}); reinstall it or pip uninstall "
                             f"{point.dist.name if point.dist is not None else 'it'}") from None
        if not isinstance(package, ModuleType) or not hasattr(package, "__path__"):
            raise ValueError(f"{where} names {package!r}, not a package: it must name a package (a folder) whose "
                             "sub-folders are read")
        packages.append(package)
    return packages


def declared_in_folders(package: str, plugins: str | None, kind: type[E], what: str) -> list[E]:
    """The ``ENTRIES`` every folder declares in its ``config`` module (a folder with an ``__init__.py`` and a
    ``config.py``): the folders on ``package``'s path (sorted by name), then those of every package the ``plugins``
    entry-point group names (:func:`plugin_packages`). ``what`` names such a folder in the error for a bad one."""
    entries: list[E] = []
    packages = [package, *(p.__name__ for p in plugin_packages(plugins))] if plugins else [package]
    for name in packages:
        for directory in importlib.import_module(name).__path__:
            for folder in sorted(Path(directory).iterdir()):
                if not ((folder / "__init__.py").is_file() and (folder / "config.py").is_file()):
                    continue
                declared = getattr(importlib.import_module(f"{name}.{folder.name}.config"), ENTRIES, None)
                if not (isinstance(declared, tuple) and declared and all(isinstance(e, kind) for e in declared)):
                    raise ValueError(f"{folder / 'config.py'}: {what}'s config.py declares {ENTRIES} = "
                                     f"({kind.__name__}(name, 'module:attribute', ...), ...); got {declared!r}")
                entries += declared
    return entries


def policy_folders(package: str = POLICY_PACKAGE, plugins: str | None = POLICY_PLUGINS) -> list[PolicyEntry]:
    """The entries of every policy folder on ``package``'s path (sorted by folder name), then of every package the
    ``plugins`` entry-point group names (:func:`plugin_packages`), then ``custom`` (the class ``policy.target``
    names). Reads each folder's ``config`` module alone: no model, no torch."""
    return [*declared_in_folders(package, plugins, PolicyEntry, "a policy folder"), PolicyEntry("custom", "")]


POLICIES: Registry[PolicyEntry] = Registry("policy.name", discover=policy_folders, elsewhere=PLUGIN_POLICIES)

# -- learning-rate schedules ---------------------------------------------------------------------

SCHEDULERS: Registry[SchedulerEntry] = Registry("scheduler.name")
for _name in ("cosine", "constant", "warmup_constant", "frozen_backbone"):
    SCHEDULERS.add(SchedulerEntry(_name, f"slurmvla.optim:{_name}_schedule"))

# -- simulators ----------------------------------------------------------------------------------

# A simulator is one folder of slurmvla/sim/ whose config.py (no MuJoCo, no torch) declares what rollout.env and
# `python -m slurmvla.sim.record --env` select: ENTRIES, a tuple of SimulatorEntry. Nothing is listed here.
SIM_PACKAGE = "slurmvla.sim"
# An installed distribution adds simulator folders through this entry-point group, as policies do (POLICY_PLUGINS).
SIM_PLUGINS = "slurmvla.simulators"


@dataclass(frozen=True)
class SimulatorEntry(Entry):
    """``target``: ``"module:function"`` building the environment, ``f(task, height, width, max_steps)`` -> a
    :class:`slurmvla.sim.base.Environment`. ``demonstrations``: ``"module:Class"`` of its scripted demonstrations
    (:class:`slurmvla.sim.base.Demonstrations`), which the one recorder writes."""

    demonstrations: str = ""
    # The simulator in words, for messages: "the pick task".
    description: str = ""
    # The tasks rollout.task may name, null (task_default) among them unless task_required; None: any task the
    # simulator's own check (task_check) accepts, checked when the environment is built.
    tasks: tuple[str, ...] | None = ()
    task_required: bool = False
    # What rollout.task is, for messages ("a Meta-World v3 task, e.g. assembly-v3"), and what null means ("one cube").
    task_hint: str = ""
    task_default: str = ""
    # "module:function" raising a ValueError that names a task the simulator lacks: f(task, key).
    task_check: str | None = None
    # "module:function" expanding rollout.task into the tasks an environment runs one at a time, f(task, key) ->
    # [task, ...] (a suite: Meta-World's MT50, where rollout.task names a group or null for all fifty); None: one
    # task, rollout.task itself.
    suite: str | None = None
    # "module:attribute": the suite's groups (name -> tasks), which summaries and the table report apart.
    groups: str | None = None
    # The recorder's defaults: demonstrations, and the frames' height and width.
    demo_episodes: int = 100
    demo_height: int = 180
    demo_width: int = 320

    def load_demonstrations(self) -> Any:
        return import_target(self.demonstrations)

    def task_problem(self, task: str | None, env_key: str, task_key: str) -> str | None:
        """What is wrong with ``task`` for this simulator, in one line (``env_key``, ``task_key``: how the caller
        names the choices, e.g. ``rollout.env=pick`` and ``rollout.task``), or None."""
        if not task:
            return f"{env_key} needs {task_key} ({self.task_hint})" if self.task_required else None
        if self.suite:
            try:
                self.tasks_of(task, task_key)
            except ValueError as e:
                return str(e)
        if self.tasks is not None and task not in self.tasks:
            default = f" or null ({self.task_default})" if not self.task_required else ""
            return (f"{task_key}={task!r} is not a variant of {self.description} ({env_key}); choose one of "
                    f"{list(self.tasks)}{default}")
        return None

    def tasks_of(self, task: str | None, task_key: str = "rollout.task") -> list[str | None]:
        """The tasks ``task`` runs, one environment each: the suite's expansion, else ``[task]``."""
        return list(import_target(self.suite)(task, task_key)) if self.suite else [task]

    def group_table(self) -> dict[str, list[str]]:
        """The suite's groups (name -> tasks); empty without a suite."""
        return dict(import_target(self.groups)) if self.groups else {}

    def check_task(self, task: str | None, task_key: str) -> None:
        """The simulator's own check of ``task`` (importing the simulator), where it has one."""
        if self.task_check is not None and task:
            import_target(self.task_check)(task, task_key)


def simulator_folders(package: str = SIM_PACKAGE, plugins: str | None = SIM_PLUGINS) -> list[SimulatorEntry]:
    """The entries of every simulator folder on ``package``'s path, then of every package the ``plugins``
    entry-point group names. Reads each folder's ``config`` module alone: no simulator, no MuJoCo."""
    return declared_in_folders(package, plugins, SimulatorEntry, "a simulator folder")


SIMULATORS: Registry[SimulatorEntry] = Registry("rollout.env", discover=simulator_folders)
