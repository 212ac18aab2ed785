"""Checkpoints: atomic, checksummed, newest-k kept, found again automatically on restart.

Layout under the run directory::

    checkpoints/step_00000100/   model.safetensors  optimizer.pt  trainer_state.pt  rank_*.pt  meta.json
    checkpoints/step_00000200/   ...

A checkpoint is written into a hidden ``.step_XXXXXXXX.tmp`` folder and renamed into place only
after every file is flushed, so a folder named ``step_*`` is complete by construction; a crash mid-
write leaves a temp folder that is ignored and cleaned up. ``meta.json`` is written last and holds
the size and SHA-256 of every other file: a file truncated or changed after the rename is found at
load, the checkpoint is moved aside (``.step_XXXXXXXX.corrupt``, kept for inspection) and the run
resumes from the previous complete one. Loading uses safetensors and ``torch.load(weights_only=True)``:
a checkpoint is data and never runs pickled code.

``meta.json`` records the checkpoint format's version (``format``; slurmvla/formats.py): an older one is
migrated when read (:func:`read_meta`), a newer or unknown one is refused in one line naming both versions,
never taken for a damaged checkpoint and moved aside.

Failures are rank-uniform: every rank reports whether its part was written (one small gather), so
a full disk on one rank is an error on all of them, never a hang at a barrier. Pruning runs only
after a rename, so the newest complete checkpoint is never deleted.

Saving in the background (``checkpoint.async_save``, on the engines whose registry entry says
``background_save``): the save call copies the state to host memory and returns; the files are
written while training goes on, and the checkpoint is committed (checksummed, ``meta.json`` written,
renamed, older ones pruned) by rank 0 once every part is on disk.

How is the engine's declared strategy (``StateIO.checkpointing``, slurmvla/engine/base.py):

- Replicated engines (single, ddp: :class:`SnapshotThenWrite`): rank 0's thread writes everything,
  checksums it and commits.
- Sharded engines (FSDP, ZeRO: :class:`WriteInBackground`): every rank's thread waits for its own
  part (DCP's ``async_save`` for FSDP, DeepSpeed's files serialized in memory for ZeRO), checksums its
  share of the files, and sends the checksums (or its error) to rank 0 in one gather on the engine's
  checkpoint group, a gloo group that only checkpoint threads use. That gather is how rank 0 learns
  that every rank's part is written: it commits from its thread as soon as it has them all, and
  removes the partial folder if any rank failed. Every thread reaches the gather, also after an
  error, so no rank waits for one that gave up.

The next save, the end of ``fit``, a preemption save and ``close`` wait for it (``wait()``: a
collective every rank calls at the same point, on the training's group, from the training thread),
and an error in any rank's thread is raised on every rank at that point. Only one save is in flight.

``meta.json`` records ``save_seconds``: the wall time from the start of the save's own work (after a
previous background save it waited for) to its commit. ``last_save_seconds`` is that of the last
commit (on rank 0 at the commit, on every rank after the next ``wait()``), ``last_stall_seconds`` the
time the last save call blocked the training thread (waiting for a previous save included).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from slurmvla.collectives import gather_objects
from slurmvla.engine.base import (
    BackgroundSave,
    CheckpointStrategy,
    SnapshotThenWrite,
    StateIO,
    Synchronous,
    WriteInBackground,
)
from slurmvla.engine.ema import EMA_FILE
from slurmvla.errors import Failure
from slurmvla.formats import CHECKPOINT, FormatError
from slurmvla.parameters import has_adapters
from slurmvla.registry import ENGINES

log = logging.getLogger("slurmvla")

TRAINER_FILE = "trainer_state.pt"
RANK_FILE = "rank_{rank:05d}.pt"
META_FILE = "meta.json"
# meta.json of a checkpoint without its frozen base (LoRA): what rebuilds the base (slurmvla.policy.lora.base_record).
LORA_BASE = "lora_base"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_MB = 1 << 20
SYNCHRONOUS = Synchronous()


class CheckpointError(Failure):
    """A checkpoint could not be written or read; the message names the path and what to do."""


class Stateful(Protocol):
    """A checkpoint's small part: a dict ``torch.save`` writes, and the way back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# -- files and checksums -------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    buf = bytearray(4 * _MB)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _data_files(directory: Path) -> list[str]:
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file() and f.name != META_FILE)


def _describe(directory: Path, names: list[str], flush: bool = False) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of each file (``flush``: fsync it first, for the files this rank wrote)."""
    described = {}
    for n in names:
        if flush:
            with open(directory / n, "rb") as fh:
                os.fsync(fh.fileno())
        described[n] = {"bytes": (directory / n).stat().st_size, "sha256": file_sha256(directory / n)}
    return described


def _share(names: list[str], rank: int, world: int) -> list[str]:
    """This rank's slice of a sorted file list: the ranks hash a checkpoint's files between them."""
    return names[rank::world]


def _problems(directory: Path, listed: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    found = []
    for name in names:
        path, want = directory / name, listed[name]
        try:
            if not path.is_file():
                found.append(f"{path}: missing")
            elif path.stat().st_size != want["bytes"]:
                found.append(f"{path}: {path.stat().st_size} bytes, {want['bytes']} written (truncated or changed)")
            elif file_sha256(path) != want["sha256"]:
                found.append(f"{path}: SHA-256 differs from the one written in {META_FILE} (corrupted)")
        except OSError as e:  # never raised on one rank only: the others would wait for it
            found.append(f"{path}: unreadable ({e.strerror or e})")
    return found


def read_meta(directory: str | Path) -> dict[str, Any]:
    """A checkpoint folder's ``meta.json``, migrated to this release's checkpoint format; a
    :class:`slurmvla.formats.FormatError` (naming the file and both versions) for a format this release
    cannot read: written by a newer one, or unknown."""
    path = Path(directory) / META_FILE
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a checkpoint's {META_FILE} (a JSON object)")
    return CHECKPOINT.migrate(meta, CHECKPOINT.version(meta.get("format"), path), path)


def verify(directory: str | Path, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with a checkpoint folder (empty when it is intact). Checkpoints written before
    checksums existed (format 1) are taken as they are. With ``world`` > 1 each rank reads its share
    of the files and every rank gets the whole answer (a collective); the defaults read all, alone.
    A format this release cannot read is no damage: a FormatError (never moved aside as corrupted)."""
    directory = Path(directory)
    try:
        meta = read_meta(directory)
    except FormatError:
        raise
    except (OSError, ValueError) as e:
        return [f"{directory / META_FILE}: unreadable ({e})"]
    listed = meta.get("files")
    if listed is None:
        return []
    mine = _problems(directory, listed, _share(sorted(listed), rank, world))
    return [p for part in (gather_objects(mine) if world > 1 else [mine]) for p in part]


def checkpoint_bytes(directory: Path) -> int:
    try:
        files = json.loads((directory / META_FILE).read_text()).get("files") or {}
    except (OSError, ValueError):
        return 0
    return sum(f["bytes"] for f in files.values())


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- finding checkpoints -------------------------------------------------------------------------


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints/`` folder), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or the newest complete one in a run directory; verified against its
    checksums (a ValueError names the damaged file, and the previous checkpoint when there is one)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        found, root = path, path.parent
    else:
        candidates = [c for root in (path / "checkpoints", path) for c in list_checkpoints(root)[-1:]]
        if not candidates:
            raise ValueError(f"{str(path)!r} is neither a checkpoint folder (with {META_FILE}) nor a run directory "
                             "holding one")
        found, root = candidates[0], candidates[0].parent
    problems = verify(found)
    if problems:
        earlier = [c for c in list_checkpoints(root) if c.name < found.name and not verify(c)]
        hint = f"; the previous complete checkpoint is {earlier[-1]}" if earlier else "; there is no earlier one"
        raise ValueError(f"checkpoint {found} is corrupted: {'; '.join(problems[:3])}{hint}")
    return found


# -- the manager ---------------------------------------------------------------------------------


class CheckpointManager:
    """A run's checkpoints of what it is given once: ``engine`` (its state I/O: weights and optimizer state, in
    its own files, written by the strategy it declares), ``state`` (written by rank 0 as ``trainer_state.pt``), ``rank_state`` (every rank's own,
    ``rank_XXXXX.pt``) and ``ema`` (a :class:`slurmvla.engine.ema.MovingAverage`, ``ema.safetensors``)."""

    def __init__(self, run_dir: Path, keep: int, engine: StateIO, state: Stateful, rank_state: Stateful, ema: Any = None,
                 rank: int = 0, world_size: int = 1, async_save: bool = False):
        self.engine, self.state, self.rank_state, self.ema = engine, state, rank_state, ema
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep
        self.rank, self.world_size = rank, world_size
        self.is_main = rank == 0
        self.async_save = async_save
        # Wall time of the last committed save (meta.json's save_seconds), and how long the last save
        # call blocked the training thread; None before the first.
        self.last_save_seconds: float | None = None
        self.last_stall_seconds: float | None = None
        self._pending: threading.Thread | None = None
        self._pending_error: str | None = None
        self._committed_seconds: float | None = None  # rank 0: set by a background commit, read by wait()
        self._background_used = False  # some save went to the background (the same on every rank)
        self._said_sync = False
        # Whether this run's saves go to the background: async_save until the first save or load, then
        # whether the engine can.
        self.background = async_save
        # Steps whose checkpoints pruning keeps beyond the newest ``keep`` (asked at each prune, on rank 0):
        # checkpoints an evaluation still reads (slurmvla.launch.eval_array).
        self.protected: Callable[[], set[int]] = set

    @property
    def pending(self) -> bool:
        """A background save is still being written (on this rank)."""
        return self._pending is not None

    def latest(self) -> Path | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def latest_intact(self) -> Path | None:
        """The newest checkpoint whose files match their checksums (a collective). A damaged one is
        moved aside (``.step_XXXXXXXX.corrupt``), said, and the one before it is tried."""
        for candidate in reversed(list_checkpoints(self.root)):
            problems = verify(candidate, self.rank, self.world_size)
            if not problems:
                return candidate
            aside = candidate.with_name(f".{candidate.name}.corrupt")
            if self.is_main:
                log.error("checkpoint %s is corrupted (%s); moved aside to %s, trying the one before it",
                          candidate, "; ".join(problems[:3]), aside)
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(candidate, aside)
            _barrier()
        return None

    # -- saving -----------------------------------------------------------------------------------

    def strategy(self) -> CheckpointStrategy:
        """How this run's saves are written: the engine's declared strategy under ``checkpoint.async_save`` where
        its registry entry says ``background_save``, else :class:`Synchronous` (said once when ``async_save``
        asked otherwise)."""
        strategy = self._strategy(self.engine)
        self.background = strategy.background
        if strategy.background or not self.async_save or self._said_sync:
            return strategy
        self._said_sync = True
        if self.is_main:
            log.warning("checkpoint.async_save=true, but engine=%s cannot save in the background: its checkpoints "
                        "are written synchronously (training waits for each)", self.engine.name)
        return strategy

    def _strategy(self, engine: StateIO) -> CheckpointStrategy:
        if not self.async_save:
            return SYNCHRONOUS
        entry = ENGINES.get(engine.name) if engine.name in ENGINES else None
        if entry is None or not entry.background_save:
            return SYNCHRONOUS
        return engine.checkpointing

    def save(self, step: int) -> Path:
        """Every rank calls this. Returns the final path (complete on return, or once ``wait()`` returns
        when in background)."""
        called = time.perf_counter()
        # The small files' contents, taken now: every rank's own state, and rank 0's of the rest.
        small = {RANK_FILE.format(rank=self.rank): self.rank_state.state_dict()}
        if self.is_main:
            small[TRAINER_FILE] = self.state.state_dict()
        self.wait()
        started = time.perf_counter()
        final = self.root / f"step_{step:08d}"
        # The same name on every rank (each writes its shards into it); never a complete checkpoint.
        tmp = self.root / f".step_{step:08d}.tmp"
        engine, ema, strategy = self.engine, self.ema, self.strategy()

        def prepare() -> None:
            if self.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                self._check_space(step)
                tmp.mkdir()

        self._on_every_rank(step, tmp, prepare)
        if isinstance(strategy, WriteInBackground):
            self._save_sharded(step, tmp, final, small, started, strategy)
            self.last_stall_seconds = time.perf_counter() - called
            return final
        replicated = isinstance(strategy, SnapshotThenWrite)
        writer: list[Callable[[Path], None]] = []

        def write_parts() -> None:
            if replicated:
                writer.append(strategy.snapshot())  # the large files are written later, by rank 0's thread
            else:
                engine.save(tmp)
            if ema is not None:
                write_ema = self._ema_writer(ema)
                if replicated:
                    writer.append(write_ema)
                else:
                    write_ema(tmp)
            for name, state in small.items():
                torch.save(state, tmp / name)

        self._on_every_rank(step, tmp, write_parts)
        meta = _meta(step, engine)
        if replicated:
            self._background_used = True
            if self.is_main:
                self._start(self._write_in_background, step, tmp, final, lambda d: [w(d) for w in writer], meta,
                            started)
            self.last_stall_seconds = time.perf_counter() - called
            return final
        # Every rank hashes its share of the files; rank 0 writes meta.json and renames.
        shares = self._on_every_rank(
            step, tmp, lambda: _describe(tmp, _share(_data_files(tmp), self.rank, self.world_size)))
        files = {name: entry for share in shares for name, entry in share.items()}
        seconds = self._on_every_rank(
            step, tmp, lambda: self._commit(tmp, final, meta, files, started) if self.is_main else None)[0]
        self.last_save_seconds = seconds
        self.last_stall_seconds = time.perf_counter() - called
        return final

    def _save_sharded(self, step: int, tmp: Path, final: Path, small: dict[str, Any], started: float,
                      strategy: WriteInBackground) -> None:
        """Every rank's part in the background. The small files first (a failure there is raised on every
        rank before anything is in flight), then the engine's background write, then every rank's thread."""
        write_ema: list[Callable[[Path], None]] = []

        def small_parts() -> None:
            if self.ema is not None:
                write_ema.append(self._ema_writer(self.ema))  # gathered now (a collective), written by rank 0's thread
            for name, state in small.items():
                torch.save(state, tmp / name)

        self._on_every_rank(step, tmp, small_parts)
        part: list[BackgroundSave] = []
        self._on_every_rank(step, tmp, lambda: part.append(strategy.start(tmp)))
        self._background_used = True
        self._start(self._write_part_in_background, step, tmp, final, part[0], write_ema,
                    _meta(step, self.engine), started)

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        self._pending_error = None
        self._pending = threading.Thread(target=target, args=args, name="slurmvla-checkpoint", daemon=True)
        self._pending.start()

    def _ema_writer(self, ema: Any) -> Callable[[Path], None]:
        averaged = ema.state_dict()  # a collective where the engine shards: every rank, now
        if not self.is_main:
            return lambda directory: None
        return lambda directory: save_file({k: v.contiguous() for k, v in averaged.items()}, str(directory / EMA_FILE))

    def wait(self) -> None:
        """Until a background save has been committed (a collective: every rank calls it at the same
        point). Its error, if any, is raised on every rank; ``last_save_seconds`` is rank 0's on every rank."""
        if not (self.async_save or self._background_used):
            return  # nothing is ever written in the background: no gather needed
        outcomes = gather_objects((self.join(), self._committed_seconds))
        self._committed_seconds = None
        if outcomes[0][1] is not None:
            self.last_save_seconds = outcomes[0][1]
        errors = [e for e, _ in outcomes if e]
        if errors:
            raise CheckpointError(errors[0])

    def join(self) -> str | None:
        """This rank only: let a background save finish; returns its error, if any (no collective,
        so it is safe after a failure elsewhere)."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        error, self._pending_error = self._pending_error, None
        return error

    def _write_in_background(self, step: int, tmp: Path, final: Path, writer: Callable[[Path], None],
                             meta: dict[str, Any], started: float) -> None:
        """Rank 0's thread for a replicated engine: it writes every large file itself."""
        try:
            writer(tmp)
            self._committed_seconds = self._commit(tmp, final, meta, _describe(tmp, _data_files(tmp)), started)
            log.info("saved checkpoint %s (written in the background)", final)
        except Exception as e:
            self._pending_error = self._failure(step, tmp, e)
        if self._pending_error:
            shutil.rmtree(tmp, ignore_errors=True)

    def _write_part_in_background(self, step: int, tmp: Path, final: Path, part: BackgroundSave,
                                  write_ema: list[Callable[[Path], None]], meta: dict[str, Any],
                                  started: float) -> None:
        """Every rank's thread for a sharded engine: wait for this rank's part, checksum this rank's
        files, send them to rank 0 (always: an error is sent instead), and on rank 0 commit."""
        error, files, written = None, {}, []
        try:
            for write in write_ema:
                write(tmp)
        except Exception as e:
            error = self._failure(step, tmp, e)
        try:
            # Always waited for, also after an error: the engine's own collectives (DCP's) must be over
            # before this thread uses the group.
            written = part.finish()
        except BaseException as e:  # noqa: BLE001 (a thread's failure is reported, never lost)
            error = error or self._failure(step, tmp, e)
        if not error:
            try:
                own = [*written, RANK_FILE.format(rank=self.rank)]
                if self.is_main:
                    own += [TRAINER_FILE] + ([EMA_FILE] if write_ema else [])
                files = _describe(tmp, own, flush=True)
            except Exception as e:
                error = self._failure(step, tmp, e)
        everyone: list[Any] | None = [(error, files)]
        if self.world_size > 1:
            everyone = [None] * self.world_size if self.is_main else None
            try:
                dist.gather_object((error, files), everyone, dst=0, group=part.group)
            except Exception as e:
                error = error or self._failure(step, tmp, e)
                everyone = None
        if self.is_main:
            if not error and everyone is None:
                error = f"checkpoint step {step} not saved: the other ranks' checksums did not arrive; {self._previous()}"
            failed = [(r, e) for r, (e, _) in enumerate(everyone or []) if e]
            if not error and failed:
                rank, first = failed[0]
                error = f"rank {rank}: {first}"
            if not error:
                try:
                    described = {name: entry for _, share in everyone for name, entry in share.items()}
                    # Anything no rank claimed (a file the engine wrote synchronously) is checksummed here.
                    described.update(_describe(tmp, [n for n in _data_files(tmp) if n not in described]))
                    self._committed_seconds = self._commit(tmp, final, meta, described, started)
                    log.info("saved checkpoint %s (written in the background)", final)
                except Exception as e:
                    error = self._failure(step, tmp, e)
            if error:
                shutil.rmtree(tmp, ignore_errors=True)
        self._pending_error = error

    def _commit(self, tmp: Path, final: Path, meta: dict[str, Any], files: dict[str, dict[str, Any]],
                started: float) -> float:
        """Rank 0: write meta.json (last), flush, rename into place, prune. Returns ``save_seconds``."""
        seconds = time.perf_counter() - started
        meta = {**meta, "save_seconds": seconds, "files": files}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (e.g. a final save right after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.last_save_seconds = seconds
        self._prune()
        return seconds

    def _on_every_rank(self, step: int, tmp: Path, part: Callable[[], Any]) -> list[Any]:
        """Run this rank's part of a save phase; then every rank gets every rank's result and learns
        whether every part succeeded (this one gather is also the barrier between phases). On a
        failure the partial folder is removed and every rank raises the same CheckpointError."""
        result, error = None, None
        try:
            result = part()
        except CheckpointError as e:
            error = str(e)
        except Exception as e:
            error = self._failure(step, tmp, e)
        outcomes = gather_objects((error, result))
        errors = [(r, e) for r, (e, _) in enumerate(outcomes) if e]
        if errors:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            rank, first = errors[0]
            raise CheckpointError(first if self.world_size == 1 else f"rank {rank}: {first}")
        return [r for _, r in outcomes]

    def _previous(self) -> str:
        latest = self.latest()
        if latest is None:
            return "there is no earlier checkpoint"
        return f"the previous checkpoint {latest} is complete and a restart resumes from it"

    def _check_space(self, step: int) -> None:
        """Refuse before writing when the filesystem has less room than the last checkpoint took."""
        latest = self.latest()
        needed = checkpoint_bytes(latest) if latest else 0
        free = shutil.disk_usage(self.root).free
        if needed and free < needed:
            raise CheckpointError(
                f"checkpoint step {step} not saved: {self.root} has {free / _MB:.1f} MB free and a checkpoint "
                f"needs about {needed / _MB:.1f} MB (the size of {latest.name}); {self._previous()}. "
                "Free space there or set hydra.run.dir to a larger filesystem")

    def _failure(self, step: int, tmp: Path, e: Exception) -> str:
        """The one-line reason a write failed. Writers do not all raise ENOSPC as such (torch.save
        reports a short write as a RuntimeError): a filesystem left with under 1 MB is taken as full."""
        free = shutil.disk_usage(self.root).free if self.root.is_dir() else 0
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or free < _MB:
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.is_dir() else 0
            latest = self.latest()
            needed = max(checkpoint_bytes(latest) if latest else 0, written)
            return (f"checkpoint step {step} not saved: no space left on device under {self.root} "
                    f"(writing {getattr(e, 'filename', None) or tmp}); it needs at least {needed / _MB:.1f} MB and "
                    f"{free / _MB:.1f} MB are free; {self._previous()}. Free space there or set hydra.run.dir to a "
                    "larger filesystem")
        if isinstance(e, OSError):
            return f"checkpoint step {step} not saved: {e.strerror or e} ({e.filename or tmp}); {self._previous()}"
        # Not the filesystem: a bug, said on every rank; the traceback goes to this rank's log.
        log.exception("writing checkpoint step %d failed", step)
        return f"checkpoint step {step} not saved: {type(e).__name__}: {e}; {self._previous()}"

    def _prune(self) -> None:
        kept = self.protected()
        for old in list_checkpoints(self.root)[: -self.keep]:
            if int(_STEP_DIR.match(old.name).group(1)) not in kept:
                shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob(".step_*.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)

    def prune(self) -> None:
        """Rank 0, no save in flight: drop the checkpoints past the newest ``keep`` that nothing protects any more."""
        self._prune()

    # -- loading ----------------------------------------------------------------------------------

    def load(self, path: Path | None = None) -> Path | None:
        """Restore everything from ``path``, or from the newest intact checkpoint (a collective:
        :meth:`latest_intact`). Returns the checkpoint loaded; None when there is none."""
        path = path or self.latest_intact()
        if path is None:
            return None
        engine, ema = self.engine, self.ema
        self.strategy()  # known from now on (``background``), and said if async_save cannot be had
        meta = read_meta(path)
        if meta["engine"] != engine.name:
            raise ValueError(
                f"checkpoint {path} was written by engine={meta['engine']!r}, this run uses engine={engine.name!r}; "
                "resume with the same engine, or export it (python -m slurmvla.export) and start from the weights"
            )
        if meta["world_size"] != engine.env.world_size and not ENGINES.get(engine.name).resumes_at_any_world_size:
            raise ValueError(
                f"checkpoint {path} was written at world size {meta['world_size']}, this run has "
                f"{engine.env.world_size}; engine={engine.name!r} resumes at the same world size only"
            )
        if LORA_BASE in meta:
            from slurmvla.policy.lora import check_base, pretrained_path

            check_base(meta[LORA_BASE], pretrained_path(engine.module), f"checkpoint {path}")
        if ema is not None and (path / EMA_FILE).is_file():
            ema.load_state_dict(load_file(str(path / EMA_FILE)))  # first: it passes through the weights
        engine.load(path)
        if ema is not None and not (path / EMA_FILE).is_file():
            ema.reset()
            log.warning("checkpoint %s holds no moving average (written without trainer.ema_decay): it starts "
                        "from the resumed weights", path)
        self.state.load_state_dict(torch.load(path / TRAINER_FILE, map_location="cpu", weights_only=True))
        rank_file = path / RANK_FILE.format(rank=self.rank)
        # A rank that did not exist when the checkpoint was written (resumed on more ranks) keeps its
        # fresh RNG streams; the training noise itself comes from the data and does not depend on them.
        if rank_file.is_file():
            self.rank_state.load_state_dict(torch.load(rank_file, map_location="cpu", weights_only=True))
        return path


def load_model_file(checkpoint: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """The full fp32 policy state of a checkpoint, whatever engine wrote it, in one process
    (``ema``: the moving average of its weights instead)."""
    if ema:
        if not (checkpoint / EMA_FILE).is_file():
            raise ValueError(f"checkpoint {checkpoint} holds no moving average ({EMA_FILE}): its run had no "
                             "trainer.ema_decay; use its trained weights (serve.weights=auto or trained; export "
                             "without --ema)")
        return load_file(str(checkpoint / EMA_FILE))
    return ENGINES.get(read_meta(checkpoint)["engine"]).load_full_state(checkpoint)


def _meta(step: int, engine: StateIO) -> dict[str, Any]:
    meta = {"step": step, "engine": engine.name, "precision": engine.precision, "world_size": engine.env.world_size,
            "format": CHECKPOINT.current}
    policy = engine.module
    if policy is not None and has_adapters(policy):
        from slurmvla.policy.lora import base_record

        # A LoRA checkpoint leaves the frozen base out: what rebuilds it (the seed of its random part, the
        # pretrained files it was loaded from).
        meta[LORA_BASE] = base_record(policy)
    return meta


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
