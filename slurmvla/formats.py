"""The format versions of what slurmvla writes and reads back, and the migrations between them.

Three things outlive the release that wrote them, and each records the version of its layout:

- a **checkpoint** (any engine's: single / DDP safetensors, FSDP's DCP folder, DeepSpeed ZeRO's files): the
  ``format`` field of its ``meta.json`` (slurmvla/checkpoint.py). 1: no checksums; 2: ``meta.json`` lists every
  file with its size and SHA-256;
- an **exported policy** (``python -m slurmvla.export``: one .safetensors file): the ``slurmvla_format`` entry of
  its metadata (not ``format``: safetensors files carry ``format: pt`` by convention). 1: none recorded; 2: the
  entry, and the config in its metadata names every policy class at its home after the policy move (below);
- a **run directory**: the ``format`` field of ``RUN/format.json``. 1: no such file; 2: the file, and the run's
  ``config.resolved.yaml`` names every policy class at its home after the policy move.

What a release reads: every version from 1 (nothing recorded: what the release before versions wrote) to its own.
An older one is migrated on load (:meth:`Format.migrate`, one step per version); a newer or unknown one is refused
with a :class:`FormatError` naming the file, its version and the versions this release reads (one line at a
program's boundary, exit 2), never read as if it were current. Each format's steps are listed here and nowhere
else: a release that changes a layout raises its ``current`` and adds the step that brings the previous one up.

The policy move: the keypoint policies and the baselines left ``slurmvla.sim`` for ``slurmvla.policy``, and the
Meta-World study's policies went to its plug-in (examples/metaworld_study). A run directory or exported file
written before names them at their old homes (``policy.name: custom``, ``policy.target:
slurmvla.sim.policies.KeypointPolicy``); :func:`moved_target` gives the new one, and a saved config of format 1 is
rewritten with it when read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("slurmvla")

EXPORT_KEY = "slurmvla_format"  # the exported file's metadata entry
RUN_FILE = "format.json"  # in a run directory


class FormatError(ValueError):
    """A checkpoint, exported file or run directory this release cannot read: written by a newer release, or a
    version it does not know. The message names the file, its version and the versions this release reads."""


def release() -> str:
    """This installation's version of slurmvla, for the refusal."""
    from importlib import metadata

    try:
        return metadata.version("slurmvla")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Format:
    """One kind of file's format: ``what`` it is (in messages), its ``current`` version, and ``steps``: for each
    older version ``v``, the function that brings what was read at ``v`` to ``v + 1`` (``f(record, where)``)."""

    what: str
    current: int
    steps: Mapping[int, Callable[[dict[str, Any], str], dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert sorted(self.steps) == list(range(1, self.current)), f"{self.what}: a step for every older version"

    def reads(self) -> str:
        return f"{self.what} formats 1 to {self.current}" if self.current > 1 else f"{self.what} format 1"

    def version(self, recorded: Any, where: str | Path) -> int:
        """The version ``recorded`` in ``where`` (None: nothing recorded, version 1), when this release reads it;
        else a :class:`FormatError` naming both."""
        if recorded is None:
            return 1
        found = recorded
        if isinstance(found, str) and found.strip().isdigit():
            found = int(found)
        if not isinstance(found, int) or isinstance(found, bool) or found < 1:
            raise FormatError(f"{where}: {self.what} format {recorded!r} is not one slurmvla knows (this release, "
                              f"{release()}, reads {self.reads()}); written by another program, or edited?")
        if found > self.current:
            raise FormatError(f"{where}: {self.what} format {found} is newer than this release of slurmvla "
                              f"({release()}) can read (it reads {self.reads()}); upgrade slurmvla to the release "
                              "that wrote it or a later one")
        return found

    def migrate(self, record: dict[str, Any], version: int, where: str | Path) -> dict[str, Any]:
        """``record`` as read at ``version``, brought to :attr:`current` one step at a time."""
        for v in range(version, self.current):
            record = self.steps[v](record, str(where))
        return record


# -- the policy move ---------------------------------------------------------------------------------------------

# Old module -> new module, or old module -> {class: new module} where its classes went to different homes.
_BASELINES = ("chunk_mse", "MeanChunkPolicy", "ZeroPolicy", "ReplayPolicy")
MOVED_MODULES: Mapping[str, str | Mapping[str, str]] = {
    "slurmvla.sim.policies": {
        **{name: "slurmvla.policy.baselines" for name in _BASELINES},
        "*": "slurmvla.policy.keypoints.model",  # KeypointPolicy, KeypointFlowPolicy and their parts
    },
    "slurmvla.sim.hand_crop": "slurmvla_metaworld_study.hand_crop.model",
    "slurmvla.sim.labelled_keypoints": "slurmvla_metaworld_study.labelled_keypoints.model",
}


def moved_target(target: str) -> str | None:
    """Where a class the policy move took elsewhere lives now (``package.module.Class`` or
    ``package.module:Class``, written back the same way); None for any other target."""
    separator = ":" if ":" in target else "."
    module, _, name = target.rpartition(separator)
    home = MOVED_MODULES.get(module)
    if home is None or not name:
        return None
    if not isinstance(home, str):
        home = home.get(name, home["*"])
    return f"{home}{separator}{name}"


def _policy_targets_moved(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A saved config of format 1: a ``policy.target`` the policy move took elsewhere, at its new home."""
    policy = config.get("policy")
    target = policy.get("target") if isinstance(policy, dict) else None
    new = moved_target(target) if isinstance(target, str) else None
    if new is not None:
        log.info("%s: policy.target=%s moved to %s in this release (read as the latter)", where, target, new)
        config = {**config, "policy": {**policy, "target": new}}
    return config


# -- the formats -------------------------------------------------------------------------------------------------

# A checkpoint's meta.json. 1 -> 2 added the checksums; a checkpoint without them is taken as it is (verify).
CHECKPOINT = Format("checkpoint", 2, {1: lambda meta, where: meta})
# An exported file's saved config (its metadata's config_yaml).
EXPORT = Format("exported policy", 2, {1: _policy_targets_moved})
# A run directory's saved config (config.resolved.yaml).
RUN_DIR = Format("run directory", 2, {1: _policy_targets_moved})


def saved_config(text: str, fmt: Format, version: int, where: str | Path) -> str:
    """A saved config's YAML (a run directory's ``config.resolved.yaml``, an exported file's ``config_yaml``) of
    ``fmt`` at ``version``, as this release reads it. Text that is no YAML mapping is returned as it is, for the
    reader to refuse naming ``where``."""
    if version == fmt.current:
        return text
    from omegaconf import DictConfig, OmegaConf

    try:
        saved = OmegaConf.create(text)
    except Exception:  # noqa: BLE001 - the reader says what is wrong with it
        return text
    if not isinstance(saved, DictConfig):
        return text
    config = OmegaConf.to_container(saved, resolve=False)
    migrated = fmt.migrate(config, version, where)
    return text if migrated == config else OmegaConf.to_yaml(migrated)


def run_dir_version(run_dir: str | Path) -> int:
    """A run directory's format version (1 where it records none, or does not exist yet); a
    :class:`FormatError` for one this release cannot read."""
    path = Path(run_dir) / RUN_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 1
    except OSError as e:
        raise FormatError(f"{path}: unreadable ({e.strerror or e}); this release ({release()}) reads "
                          f"{RUN_DIR.reads()}") from None
    try:
        recorded = json.loads(text)["format"]
    except (ValueError, TypeError, KeyError):
        raise FormatError(f"{path}: no run directory format in it ({text[:80]!r}); this release ({release()}) reads "
                          f"{RUN_DIR.reads()} (written by another program, or edited?)") from None
    return RUN_DIR.version(recorded, path)


def write_run_format(run_dir: str | Path) -> Path:
    """Record that ``run_dir`` is written in this release's run directory format (atomically)."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps({"format": RUN_DIR.current, "written_by": f"slurmvla {release()}"}) + "\n")
    os.replace(tmp, path)
    return path
