"""The periodic closed loop off the training job: one SLURM job array per evaluated checkpoint
(``rollout_array.enabled``; the options are :class:`slurmvla.config.rollout_array.RolloutArrayConfig`).

At an evaluation step S (``trainer.rollout_every_steps``) the trainer records the step in the run's state file
(:data:`STATE_FILE`) *before* it saves checkpoint S, so checkpoint rotation (``checkpoint.keep``) skips it from the
start (:meth:`EvalArrays.pinned`); once the checkpoint is committed it submits::

    sbatch --parsable --array=0-(N-1) --requeue --open-mode=append --output=STEP_DIR/slurm-%A_%a.out ... \\
        --wrap "exec PYTHON -m slurmvla.eval_array element RUN/checkpoints/step_S --shards N --out STEP_DIR"

Element I (``SLURM_ARRAY_TASK_ID``) runs ``python -m slurmvla.rollout CHECKPOINT --shard I/N`` into a scratch folder
and renames its summary into ``STEP_DIR/rollout_shardIofN.json`` (atomic: a shard file is whole or absent); an
element whose shard is already there does nothing (a requeued or rerun element is idempotent). The element that
finds every shard present merges them (``python -m slurmvla.rollout --merge``) into ``STEP_DIR/rollout.json``, the
file ``python -m slurmvla.table`` reads, as it reads the in-job evaluation's.

The trainer gathers at its log steps and, at the end of training, waits up to ``rollout_array.wait_s``: a step whose
``rollout.json`` is there is logged (``rollout/*`` at step S, however far training has gone) and its checkpoint is
released to rotation. An element that left the queue (``squeue``) without its shard, seen so at two queue checks
``poll_s`` apart (a shard written on another node may show late on a network filesystem) and, where the cluster keeps
accounting, recorded as ended there (``sacct``), failed for good: when no
element of the array is left in the queue the step is *incomplete*: ``rollout/missing_shards`` is logged at step S, no
success rate (never an average over fewer episodes), one error line names the array job, each missing element, its
state (``sacct``, where there is accounting) and log, and ``STEP_DIR/missing.json`` says how to rerun it; the
checkpoint stays until the step is complete (``python -m slurmvla.eval_array gather RUN_DIR [--resubmit]``).
Preemption or ``scontrol requeue`` of an element is SLURM's own requeue (``--requeue``): it runs again.

The state lives in the run directory, so a requeued training job picks its pending evaluations up where it left
them; entries past the checkpoint a run resumes from are dropped (their metrics records are, too).

Foundation (layer 0): no torch, nothing above; the rollout and the merge run as the programs they are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurmvla.errors import Failure

log = logging.getLogger("slurmvla")

# In the run directory: the pending and finished evaluation arrays, by step.
STATE_FILE = "rollout_arrays.json"
# In a step's folder: the merged summary (python -m slurmvla.rollout's name), and the report of a step that stayed
# incomplete.
MERGED, MISSING = "rollout.json", "missing.json"
# A checkpoint is committed once its meta.json is in place (slurmvla.checkpoint writes it last, then renames).
COMMITTED = "meta.json"
# Statuses: pinned (the checkpoint is kept) while to_submit, submitted or incomplete.
TO_SUBMIT, SUBMITTED, DONE, INCOMPLETE = "to_submit", "submitted", "done", "incomplete"
PINNING = (TO_SUBMIT, SUBMITTED, INCOMPLETE)
# Variables of the training job that must not reach an element: its own job's SLURM_* (sbatch and the element's
# own job set theirs), torchrun's rank variables, the GPUs it was given. SLURM_CONF names the cluster: kept.
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES",
                   "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "OMPI_MCA_orte_precondition_transports")


# sacct states of an element that has not ended (its accounting record lags the queue), and how many looks at an
# array whose missing elements are gone from the queue wait for that record.
_NOT_ENDED = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "RESIZING", "SUSPENDED", "REQUEUE")
_MAX_LOOKS = 5


class SubmitError(Failure):
    """sbatch refused or could not be run; the message is its one line."""


def shard_name(index: int, count: int) -> str:
    """The summary ``python -m slurmvla.rollout --shard I/N`` writes."""
    return f"rollout_shard{index}of{count}.json"


@dataclass
class ArraySettings:
    """What a submission needs of ``rollout_array.*`` (duck-typed from the config: this layer reads no schema)."""

    shards: int = 4
    partition: str | None = None
    time: str = "01:00:00"
    cpus_per_task: int = 4
    gpus_per_task: int = 0
    sbatch_args: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)
    python: str | None = None
    wait_s: float = 3600.0
    poll_s: float = 30.0

    @classmethod
    def of(cls, cfg: Any) -> ArraySettings:
        values = {k: getattr(cfg, k) for k in cls.__dataclass_fields__}
        return cls(**{**values, "sbatch_args": list(values["sbatch_args"]), "overrides": list(values["overrides"])})


def element_command(python: str, checkpoint: Path, out: Path, shards: int, overrides: Iterable[str]) -> str:
    """The shell line each element runs (sbatch --wrap): its index is the element's SLURM_ARRAY_TASK_ID."""
    words = [python, "-m", "slurmvla.eval_array", "element", str(checkpoint), "--shards", str(shards), "--out",
             str(out), *overrides]
    return "exec " + " ".join(shlex.quote(w) for w in words)


def indices_spec(indices: Iterable[int]) -> str:
    """sbatch --array's list: 0-3 for a whole array, 1,3 for some of its elements."""
    found = sorted(set(indices))
    if found and found == list(range(found[0], found[-1] + 1)) and len(found) > 1:
        return f"{found[0]}-{found[-1]}"
    return ",".join(map(str, found))


def sbatch_command(settings: ArraySettings, checkpoint: Path, out: Path, job_name: str,
                   indices: Iterable[int] | None = None, test_only: bool = False) -> list[str]:
    """The sbatch command line of one evaluation array (``indices``: some elements only, e.g. a resubmission);
    ``test_only``: sbatch --test-only, which checks partition, time and resources and submits nothing."""
    python = settings.python or sys.executable
    cmd = ["sbatch", "--test-only" if test_only else "--parsable",
           f"--array={indices_spec(range(settings.shards) if indices is None else indices)}",
           "--requeue", "--open-mode=append", f"--job-name={job_name}", f"--output={out}/slurm-%A_%a.out",
           f"--time={settings.time}", f"--cpus-per-task={settings.cpus_per_task}", "--ntasks=1"]
    if settings.partition:
        cmd.append(f"--partition={settings.partition}")
    if settings.gpus_per_task:
        cmd.append(f"--gpus-per-task={settings.gpus_per_task}")
    cmd += [*settings.sbatch_args, "--wrap", element_command(python, checkpoint, out, settings.shards,
                                                             settings.overrides)]
    return cmd


def submit_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment sbatch exports to the elements: the training's, without its job's SLURM_* (SLURM_CONF kept),
    torchrun's rank variables and the GPUs it was given."""
    return {k: v for k, v in environ.items()
            if not (k.startswith("SLURM_") and k != "SLURM_CONF") and k not in _RANK_VARIABLES
            and not k.startswith("TORCHELASTIC_")}


def _sbatch(cmd: list[str], environ: dict[str, str] | None = None, timeout: float = 60.0) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env=submit_environment(dict(os.environ if environ is None else environ)))
    except FileNotFoundError:
        raise SubmitError("sbatch is not on PATH: rollout_array.enabled=true submits the evaluations as SLURM job "
                          "arrays from the training job; run it where sbatch is, or rollout_array.enabled=false") from None
    except subprocess.TimeoutExpired:
        raise SubmitError(f"sbatch did not answer within {timeout:.0f} s") from None
    text = (res.stderr or "").strip()
    if res.returncode != 0:
        lines = [line for line in text.splitlines() if line.strip()]
        raise SubmitError(lines[-1] if lines else f"sbatch exited {res.returncode}")
    return (res.stdout or "").strip() + ("\n" + text if text else "")


def check_submission(settings: ArraySettings, run_dir: Path, job_name: str) -> str | None:
    """Why an evaluation array could not be submitted from here (no sbatch, a partition or time the cluster
    refuses: ``sbatch --test-only``), or None."""
    probe = Path(run_dir) / "checkpoints" / "step_00000000"
    try:
        _sbatch(sbatch_command(settings, probe, Path(run_dir) / "rollout", job_name, test_only=True))
    except SubmitError as e:
        return (f"rollout_array.enabled=true: sbatch refuses the evaluation array ({e}); check rollout_array.partition="
                f"{settings.partition}, rollout_array.time={settings.time}, rollout_array.cpus_per_task="
                f"{settings.cpus_per_task}, rollout_array.gpus_per_task={settings.gpus_per_task} and "
                f"rollout_array.sbatch_args={settings.sbatch_args}")
    return None


def submit(cmd: list[str], environ: dict[str, str] | None = None) -> str:
    """The array's job id."""
    out = _sbatch(cmd, environ)
    job = out.splitlines()[0].split(";")[0].strip() if out else ""
    if not job.isdigit():
        raise SubmitError(f"sbatch printed no job id: {out[:200]!r}")
    return job


def queued_elements(job: str) -> dict[int, str] | None:
    """Elements of array ``job`` still in the queue (pending, running, requeued, completing) -> state; {} when none
    is (or the controller no longer knows the job); None when squeue cannot be asked."""
    try:
        # %K: the element's array index (%a would be the account).
        res = subprocess.run(["squeue", "-h", "-r", "-j", job, "-o", "%K|%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return {} if "Invalid job id" in res.stderr else None
    found = {}
    for line in res.stdout.splitlines():
        index, _, state = line.strip().partition("|")
        for i in _indices(index):  # one index; or pending elements not yet split (e.g. [0-3]), -r normally expands
            found[i] = state
    return found


def _indices(text: str) -> list[int]:
    """Array indices as SLURM writes them: 3, [1-3], [0,2,5-6%2] (the %N is a limit on running elements)."""
    found = []
    for part in text.strip().strip("[]").split("%")[0].split(","):
        a, _, b = part.partition("-")
        if a.isdigit() and (not b or b.isdigit()):
            found += range(int(a), int(b or a) + 1)
    return found


def cancel(job: str) -> None:
    """scancel ``job`` (best effort: a job already gone, or no SLURM here, is no error)."""
    try:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def element_states(job: str) -> dict[int, str]:
    """Each element's accounting state and exit code (``sacct``), where the cluster keeps accounting; {} otherwise."""
    try:
        res = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "JobID,State,ExitCode"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in res.stdout.splitlines():
        parts = line.split("|")
        # JOB_I, or JOB_[I-K] for elements cancelled before they were split from the pending array.
        m = re.fullmatch(rf"{job}_(\S+)", parts[0].strip()) if len(parts) == 3 else None
        for i in _indices(m.group(1)) if m else []:
            found[i] = f"{parts[1].strip()} {parts[2].strip()}"
    return found


def merge_with_program(paths: list[Path], out: Path, python: str | None = None) -> None:
    """``python -m slurmvla.rollout --merge`` (the closed loop's own merge), run as the program it is."""
    res = subprocess.run([python or sys.executable, "-m", "slurmvla.rollout", "--merge", *map(str, paths), "--out",
                          str(out)], capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        lines = [line for line in (res.stderr or res.stdout).splitlines() if line.strip()]
        raise ValueError(f"merging {len(paths)} shards into {out} failed: {lines[-1] if lines else res.returncode}")


def write_json(path: Path, data: Any) -> None:
    """Whole or not at all: written under a private name, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def merge_complete(out: Path, shards: int, merge: Callable[[list[Path], Path], None] | None = None) -> bool:
    """Merge ``out``'s shards into ``out/rollout.json`` when every one is there and it is not; True when it is there
    (afterwards). Two elements finishing together both merge the same files: each renames a whole file over it."""
    merged = out / MERGED
    if merged.is_file():
        return True
    paths = [out / shard_name(i, shards) for i in range(shards)]
    if not all(p.is_file() for p in paths):
        return False
    tmp = out / f".{MERGED}.{socket.gethostname()}.{os.getpid()}.tmp"
    (merge or merge_with_program)(paths, tmp)
    os.replace(tmp, merged)
    return True


def run_element(checkpoint: Path, out: Path, index: int, shards: int, overrides: list[str],
                python: str | None = None, merge: Callable[[list[Path], Path], None] | None = None) -> str:
    """One element: shard ``index`` of ``shards`` of the closed loop of ``checkpoint`` into ``out``. Returns what it
    did (``skipped``: the shard was already there; ``ran``). Idempotent: a killed run leaves only its scratch folder,
    which the next run replaces; the shard's summary is renamed into place last. Then the merge, if it is complete."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / shard_name(index, shards)
    did = "skipped"
    if not final.is_file():
        scratch = out / f".shard{index}of{shards}.tmp"
        shutil.rmtree(scratch, ignore_errors=True)
        cmd = [python or sys.executable, "-m", "slurmvla.rollout", str(checkpoint), *overrides,
               "--shard", f"{index}/{shards}", "--out", str(scratch)]
        log.info("element %d/%d: %s", index, shards, " ".join(shlex.quote(c) for c in cmd))
        res = subprocess.run(cmd)
        if res.returncode != 0:
            raise Failure(f"element {index}/{shards}: python -m slurmvla.rollout exited {res.returncode} (its output "
                          "is above); no shard written")
        written = scratch / shard_name(index, shards)
        for f in scratch.iterdir():  # the videos first, the summary last: its name is the commit
            if f != written:
                os.replace(f, out / f.name)
        os.replace(written, final)
        shutil.rmtree(scratch, ignore_errors=True)
        did = "ran"
    merge_complete(out, shards, (lambda p, o: merge_with_program(p, o, python)) if merge is None else merge)
    return did


def _now() -> float:
    return time.time()


class EvalArrays:
    """A run's evaluation arrays: planned, submitted, gathered. Rank 0 of the trainer (or ``python -m
    slurmvla.eval_array gather``) owns one; ``log_metrics(step, metrics)`` records a gathered step (the logger's
    ``log_at``: at step S, whatever step training is at)."""

    def __init__(self, run_dir: Path, settings: ArraySettings, job_name: str,
                 log_metrics: Callable[[int, dict[str, float]], None], out_root: Path | None = None,
                 merge: Callable[[list[Path], Path], None] | None = None,
                 queue: Callable[[str], dict[int, str] | None] = queued_elements,
                 states: Callable[[str], dict[int, str]] = element_states,
                 submitter: Callable[[list[str]], str] = submit, clock: Callable[[], float] = _now):
        self.run_dir = Path(run_dir).resolve()
        self.settings = settings
        self.job_name = job_name
        self.log_metrics = log_metrics
        self.out_root = Path(out_root).resolve() if out_root else self.run_dir / "rollout"
        self.merge = merge or (lambda paths, out: merge_with_program(paths, out, settings.python))
        self.queue, self.states, self.submitter, self.clock = queue, states, submitter, clock
        self.path = self.run_dir / STATE_FILE
        self.entries: dict[int, dict[str, Any]] = self._read()
        self._asked: dict[int, float] = {}  # step -> when the queue was last asked about it
        self._gone: dict[int, set[int]] = {}  # step -> elements seen out of the queue without a shard, last check
        self._looks: dict[int, int] = {}  # step -> looks at which its missing elements were confirmed gone
        self._refused: dict[int, float] = {}  # step -> when sbatch last refused its array (tried again after poll_s)

    # -- the state file ---------------------------------------------------------------------------

    def _read(self) -> dict[int, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: not a state file of evaluation arrays ({e}); move it aside to start "
                             "over (its arrays' results stay in their step folders)") from None
        return {int(k): v for k, v in data.get("steps", {}).items()}

    def _write(self) -> None:
        write_json(self.path, {"steps": {str(k): v for k, v in sorted(self.entries.items())}})

    def step_dir(self, step: int) -> Path:
        return self.out_root / f"step_{step:08d}"

    def pinned(self) -> set[int]:
        """Steps whose checkpoint rotation must keep: an evaluation to submit, running, or incomplete."""
        return {s for s, e in list(self.entries.items()) if e["status"] in PINNING}  # a copy: a saving thread asks

    def pending(self) -> list[dict[str, Any]]:
        return [e for _, e in sorted(self.entries.items()) if e["status"] in (TO_SUBMIT, SUBMITTED)]

    def resumed_at(self, step: int) -> None:
        """A run resumed from checkpoint ``step``: evaluations of later steps belong to a lineage that is gone."""
        later = [s for s in self.entries if s > step]
        for s in later:
            entry = self.entries.pop(s)
            if entry.get("job") and entry["status"] == SUBMITTED:
                cancel(entry["job"])  # its checkpoint is no longer the run's: its results would be another run's
            log.warning("evaluation of step %d (%s%s) dropped: the run resumed from step %d", s, entry["status"],
                        f", array job {entry['job']} cancelled" if entry.get("job") and entry["status"] == SUBMITTED
                        else "", step)
        lost = [s for s, e in self.entries.items()
                if e["status"] == TO_SUBMIT and not (Path(e["checkpoint"]) / COMMITTED).is_file()]
        for s in lost:
            log.warning("evaluation of step %d dropped: its checkpoint %s was never completed", s,
                        self.entries.pop(s)["checkpoint"])
        if later or lost:
            self._write()

    # -- planning and submitting ------------------------------------------------------------------

    def plan(self, step: int, checkpoint: Path) -> None:
        """Step ``step`` is to be evaluated from ``checkpoint`` (before that checkpoint is saved: pinned from then)."""
        out = self.step_dir(step)
        if out.exists():  # an earlier lineage's evaluation of this step (a run resumed from before it): kept aside
            aside = out.with_name(f".{out.name}.superseded.{int(self.clock())}")
            os.replace(out, aside)
            log.warning("step %d: %s held an earlier evaluation of this step; moved aside to %s", step, out, aside)
        self.entries[step] = {"step": step, "checkpoint": str(Path(checkpoint).resolve()), "out": str(out),
                              "shards": self.settings.shards, "status": TO_SUBMIT, "job": None, "jobs": []}
        self._write()

    def _submit(self, entry: dict[str, Any], indices: list[int] | None = None) -> bool:
        checkpoint, out = Path(entry["checkpoint"]), Path(entry["out"])
        if not (checkpoint / COMMITTED).is_file():
            return False  # still being written in the background: the next poll submits it
        if self.clock() - self._refused.get(entry["step"], float("-inf")) < self.settings.poll_s:
            return False
        out.mkdir(parents=True, exist_ok=True)
        settings = dataclasses.replace(self.settings, shards=entry["shards"])  # as planned (a resubmission too)
        cmd = sbatch_command(settings, checkpoint, out, f"{self.job_name}-eval-{entry['step']}", indices)
        try:
            job = self.submitter(cmd)
        except SubmitError as e:
            self._refused[entry["step"]] = self.clock()
            log.error("step %d: the evaluation array was not submitted (%s); tried again in %g s: %s", entry["step"],
                      e, self.settings.poll_s, " ".join(shlex.quote(c) for c in cmd))
            return False
        entry.update(status=SUBMITTED, job=job, jobs=[*entry.get("jobs", []), job], submitted=self.clock())
        self._write()
        self._gone.pop(entry["step"], None)  # a new array: its elements are looked at afresh
        self._looks.pop(entry["step"], None)
        which = "elements " + indices_spec(indices) if indices is not None else f"{entry['shards']} elements"
        log.info("step %d: evaluation array job %s submitted (%s, %s; logs %s/slurm-%s_*.out)", entry["step"], job,
                 which, checkpoint, out, job)
        return True

    def resubmit(self, step: int) -> str | None:
        """Submit an incomplete step's missing elements again, as a new array of those indices; their job id."""
        entry = self.entries[step]
        missing = self._missing(entry)
        if entry["status"] != INCOMPLETE or not missing:
            return None
        if self._submit(entry, missing):
            return entry["job"]
        return None

    # -- gathering --------------------------------------------------------------------------------

    def _missing(self, entry: dict[str, Any]) -> list[int]:
        out = Path(entry["out"])
        return [i for i in range(entry["shards"]) if not (out / shard_name(i, entry["shards"])).is_file()]

    def poll(self, ask_queue: bool = True) -> list[int]:
        """Submit what is ready, gather what is complete, and (``ask_queue``, at most every ``poll_s`` per array)
        find elements that failed for good. Returns the steps finished now (done or incomplete)."""
        finished = []
        for entry in [e for _, e in sorted(self.entries.items())]:
            if entry["status"] == TO_SUBMIT:
                self._submit(entry)
            elif entry["status"] in (SUBMITTED, INCOMPLETE) and self._gather(entry, ask_queue):
                finished.append(entry["step"])
        return finished

    def _gather(self, entry: dict[str, Any], ask_queue: bool) -> bool:
        step, out, shards = entry["step"], Path(entry["out"]), entry["shards"]
        try:
            complete = merge_complete(out, shards, self.merge)
        except (OSError, ValueError) as e:
            log.error("step %d: %s", step, e)
            complete = False
        if complete:
            return self._done(entry)
        if entry["status"] != SUBMITTED or not ask_queue:
            return False
        now = self.clock()
        if now - self._asked.get(step, float("-inf")) < self.settings.poll_s:
            return False
        self._asked[step] = now
        queued = self.queue(entry["job"])
        if queued is None:
            return False  # the controller cannot be asked now: nothing is decided
        gone = {i for i in self._missing(entry) if i not in queued}  # listed after asking: a shard written meanwhile counts
        confirmed = gone & self._gone.get(step, set())
        self._gone[step] = gone
        if queued or not gone or confirmed != gone:
            self._looks[step] = 0
            return False
        # Gone at two looks. Where the cluster keeps accounting, its record of each missing element's end is waited
        # for too (slurmdbd writes it a moment after the controller lets go; a few looks at most).
        self._looks[step] = self._looks.get(step, 0) + 1
        states = self.states(entry["job"])
        ended = all(i in states and not states[i].startswith(_NOT_ENDED) for i in gone)
        if states and not ended and self._looks[step] < _MAX_LOOKS:
            return False
        return self._incomplete(entry, sorted(gone), states)

    def _done(self, entry: dict[str, Any]) -> bool:
        step, out = entry["step"], Path(entry["out"])
        summary = json.loads((out / MERGED).read_text())
        metrics = {k: float(v) for k, v in summary.items() if k.startswith("rollout/")}
        metrics["rollout/missing_shards"] = 0.0
        self.log_metrics(step, metrics)
        entry.update(status=DONE, missing=[])
        self._write()
        (out / MISSING).unlink(missing_ok=True)
        log.info("step %d: rollout/success_rate %.3f (95%% CI %.3f-%.3f) over %d episodes, evaluated off the job by "
                 "array job %s (%d elements): %s", step, metrics["rollout/success_rate"],
                 metrics["rollout/success_ci95_low"], metrics["rollout/success_ci95_high"],
                 metrics["rollout/episodes"], entry["job"], entry["shards"], out / MERGED)
        return True

    def _incomplete(self, entry: dict[str, Any], missing: list[int], states: dict[int, str]) -> bool:
        step, out, job, shards = entry["step"], Path(entry["out"]), entry["job"], entry["shards"]
        python = self.settings.python or sys.executable
        reruns = [element_command(python, Path(entry["checkpoint"]), out, shards, self.settings.overrides)
                  .removeprefix("exec ") + f" --index {i}" for i in missing]
        elements = [f"{job}_{i} ({states.get(i, 'no longer queued')}; log {out}/slurm-{job}_{i}.out)" for i in missing]
        write_json(out / MISSING, {"step": step, "job": job, "shards": shards, "missing": missing,
                                   "states": {str(i): states.get(i) for i in missing}, "rerun": reruns,
                                   "then": f"python -m slurmvla.eval_array gather {self.run_dir}"})
        self.log_metrics(step, {"rollout/missing_shards": float(len(missing)), "rollout/shards": float(shards)})
        entry.update(status=INCOMPLETE, missing=missing)
        self._write()
        log.error("step %d: evaluation array job %s is incomplete: %d of %d elements wrote no shard: %s; rollout/* "
                  "of step %d is not logged (no average over fewer episodes); checkpoint %s is kept: rerun them "
                  "(python -m slurmvla.eval_array gather %s --resubmit, or the commands in %s)", step, job,
                  len(missing), shards, ", ".join(elements), step, entry["checkpoint"], self.run_dir, out / MISSING)
        return True

    def wait(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False, tick_s: float = 1.0) -> list[dict]:
        """Until no evaluation is pending (or ``timeout_s``, or ``should_stop``); returns those still pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            pending = self.pending()
            if not pending or should_stop() or time.monotonic() >= deadline:
                return pending
            time.sleep(tick_s)

    def describe(self, entries: list[dict]) -> str:
        """The pending evaluations, one phrase each (for the log when the trainer stops waiting)."""
        parts = []
        for e in entries:
            if e["status"] == TO_SUBMIT:
                parts.append(f"step {e['step']} (not submitted yet)")
                continue
            queued = self.queue(e["job"]) or {}
            states = ", ".join(f"{e['job']}_{i} {s}" for i, s in sorted(queued.items()))
            parts.append(f"step {e['step']} (array job {e['job']}: {len(self._missing(e))} of {e['shards']} shards "
                         f"missing{'; ' + states if states else ''})")
        return "; ".join(parts)
