"""Meta-World's MT50 as LeRobot defines it (``rollout.env=mt50``): the fifty v3 tasks, their difficulty groups
(easy 28, medium 11, hard 6, very hard 5) and the instruction each task is asked with, read from ``mt50.json``
beside this module (the data of LeRobot 0.6.1's ``envs/metaworld_config.json``). Two tasks share one instruction
(push-v3 and push-back-v3: "Push the puck to a goal"), so a dataset of all fifty holds 49 task strings, as
``lerobot/metaworld_mt50`` does, and only the image tells those two apart.

``rollout.task`` (and the recorder's ``--task``) names what runs: null (all fifty), a group (``easy``, ``medium``,
``hard``, ``very_hard``), a task (``reach-v3``) or a comma-separated list of tasks; :func:`suite` expands it.
Imports neither Meta-World nor MuJoCo.
"""

from __future__ import annotations

import json
from pathlib import Path

_DATA = json.loads((Path(__file__).with_name("mt50.json")).read_text())
# Group -> its tasks, in LeRobot's order (the table's columns follow it).
GROUPS: dict[str, list[str]] = _DATA["groups"]
# Task -> the instruction it is asked with (and recorded under).
INSTRUCTIONS: dict[str, str] = _DATA["instructions"]
# Task -> LeRobot's task id (the ``task_id`` column of lerobot/metaworld_mt50).
TASK_IDS: dict[str, int] = _DATA["task_ids"]
# Every task, group by group.
TASKS: list[str] = [t for group in GROUPS.values() for t in group]


def suite(task: str | None, key: str = "rollout.task") -> list[str]:
    """The tasks ``task`` names (null: all fifty; a group; a task; a comma-separated list of tasks), each once,
    in the order named; a ValueError naming ``key``, the value and the choices otherwise."""
    if task is None or task in ("", "mt50"):
        return list(TASKS)
    if task in GROUPS:
        return list(GROUPS[task])
    names = [t.strip() for t in str(task).split(",") if t.strip()]
    unknown = [t for t in names if t not in INSTRUCTIONS]
    if unknown or not names:
        raise ValueError(f"{key}={task!r} is not an MT50 task or group; choose null (all fifty), a group of "
                         f"{list(GROUPS)}, or tasks (comma-separated) of {sorted(INSTRUCTIONS)}")
    return list(dict.fromkeys(names))


def check(task: str | None, key: str = "rollout.task") -> str | None:
    """``task`` if :func:`suite` accepts it (the registry's task check)."""
    suite(task, key)
    return task


def group_of(task: str) -> str:
    """The difficulty group ``task`` belongs to."""
    return next(group for group, tasks in GROUPS.items() if task in tasks)


def task_strings(tasks: list[str]) -> list[str]:
    """The datasets' task strings of ``tasks``: their instructions, each once, in order."""
    return list(dict.fromkeys(INSTRUCTIONS[t] for t in tasks))
