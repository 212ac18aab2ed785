"""Faults injected for real: a corrupted checkpoint, a full disk during a save, two runs on one run
directory, a rank stopped inside a collective. Each checks the promised outcome and that nothing is
lost (the resumed run ends with the weights of an uninterrupted one)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from safetensors.torch import load_file

from slurmvla.checkpoint import META_FILE, CheckpointManager, list_checkpoints, resolve_checkpoint, verify
from slurmvla.formats import CHECKPOINT
from slurmvla.launch import SlurmJob
from slurmvla.launch.runlock import LOCK_FILE, RunDirInUse, RunLock
from slurmvla.registry import ENGINES
from slurmvla.trainer import Trainer
from tests.conftest import REPO, rel_l2, run_until

pytestmark = pytest.mark.faults

BASE = ["data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
        "trainer.global_batch_size=8", "trainer.log_every_steps=2", "policy=tiny"]


def cli(args: list[str], timeout: int = 300, env: dict | None = None, nproc: int = 0) -> subprocess.CompletedProcess:
    """``python -m slurmvla.train ARGS``, or under torchrun with ``nproc`` ranks (launchers/train.sh's torchrun)."""
    launcher = [] if nproc == 0 else ["-m", "slurmvla.launch.torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run([sys.executable, *launcher, "-m", "slurmvla.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def train(make_cfg, run_dir: Path, *overrides: str) -> Trainer:
    trainer = Trainer(make_cfg("policy=tiny", *overrides), run_dir)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer


def final_weights(run_dir: Path) -> dict:
    return load_file(str(list_checkpoints(run_dir / "checkpoints")[-1] / "model.safetensors"))


@pytest.fixture
def uninterrupted(make_cfg, tmp_path):
    """The weights of a 6-step run that nothing interrupted (the reference every fault is held to)."""
    train(make_cfg, tmp_path / "reference", "trainer.max_steps=6", "checkpoint.every_steps=2")
    return final_weights(tmp_path / "reference")


# -- a corrupted checkpoint ----------------------------------------------------------------------


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


@pytest.mark.slow
@pytest.mark.parametrize("damage, file", [(_flip_byte, "model.safetensors"), (_truncate, "optimizer.pt")])
def test_corrupted_checkpoint_is_found_refused_by_export_and_skipped_on_resume(make_cfg, sample_root, tmp_path,
                                                                                 uninterrupted, damage, file, caplog):
    run = tmp_path / "run"
    train(make_cfg, run, "trainer.max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep=3")
    damaged = run / "checkpoints" / "step_00000004"
    damage(damaged / file)
    assert verify(damaged) and str(damaged / file) in verify(damaged)[0]
    assert verify(run / "checkpoints" / "step_00000002") == []
    with pytest.raises(ValueError, match=f"step_00000004/{file}.*previous complete checkpoint is .*step_00000002"):
        resolve_checkpoint(run)
    res = subprocess.run([sys.executable, "-m", "slurmvla.export", str(damaged), str(tmp_path / "out.safetensors")],
                         capture_output=True, text=True, cwd=REPO)
    assert res.returncode != 0 and "is corrupted" in res.stderr and file in res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out.safetensors").exists()
    # The run resumes from step 2 (saying so), keeps the damaged one aside, and ends where an
    # uninterrupted run ends.
    trainer = train(make_cfg, run, "trainer.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep=3")
    assert trainer.resumed_from.name == "step_00000002"
    assert (run / "checkpoints" / ".step_00000004.corrupt" / file).is_file()
    assert f"checkpoint {damaged} is corrupted" in caplog.text
    assert rel_l2(final_weights(run), uninterrupted) < 1e-6


# -- a full disk ---------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """mount(size_kb) -> a tmpfs of that size at tmp_path/run/checkpoints; unmounted at the end."""
    mounted: list[Path] = []

    def mount(size_kb: int) -> Path:
        where = tmp_path / "run" / "checkpoints"
        where.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {res.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _grow(where: Path, size_kb: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_kb}k", str(where)], check=True)


@pytest.mark.slow
def test_full_disk_before_a_save_keeps_the_last_checkpoint_and_the_restart_resumes_from_it(
        sample_root, tmp_path, small_fs, uninterrupted):
    """Room for one checkpoint and a half: the second save is refused before it writes, by name."""
    where = small_fs(4096)  # a tiny-policy checkpoint is ~2.5 MB
    run = tmp_path / "run"
    args = [f"data.root={sample_root}", *BASE, "trainer.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep=2",
            f"hydra.run.dir={run}"]
    res = cli(args)
    assert res.returncode == 1, res.stderr[-3000:]
    error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"{where} has" in error[0] and "MB free and a checkpoint needs about" in error[0]
    assert "step_00000002 is complete and a restart resumes from it" in error[0]
    assert [p.name for p in list_checkpoints(where)] == ["step_00000002"] and not list(where.glob(".step_*"))
    assert verify(where / "step_00000002") == []
    _grow(where, 16384)
    res = cli(args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in (run / "train.log").read_text()
    assert rel_l2(final_weights(run), uninterrupted) < 1e-6


@pytest.mark.parametrize("engine, async_save", [("single", True), ("single", False),
                                                 pytest.param("fsdp_full", True, marks=pytest.mark.multiproc)])
def test_disk_filling_during_a_save_is_an_error_naming_the_path_and_leaves_no_partial_checkpoint(
        sample_root, tmp_path, small_fs, engine, async_save):
    """Less room than one checkpoint: the write itself hits ENOSPC (in the background writer or not; under
    fsdp_full at world size 2 in DCP's background writes of both ranks' shards)."""
    where = small_fs(1024)
    run = tmp_path / "run"
    nproc = 0 if engine == "single" else 2
    res = cli([f"data.root={sample_root}", *BASE, "trainer.max_steps=2", "checkpoint.every_steps=2", f"engine={engine}",
               f"checkpoint.async_save={str(async_save).lower()}", f"hydra.run.dir={run}"], nproc=nproc)
    assert res.returncode == 1, res.stderr[-3000:]
    # One message, the same on every rank (two ranks' lines can interleave on the shared stderr: found by
    # the message, not by line), and no rank's traceback (a worker's is printed as "[rankN]: Traceback";
    # torchrun itself reports the failed workers with a traceback of its own).
    error = re.findall(r"error: checkpoint step .*? larger filesystem", res.stderr)
    assert len(error) == max(nproc, 1) and len(set(error)) == 1, res.stderr[-3000:]
    worker_tracebacks = [line for line in res.stderr.splitlines() if "Traceback" in line
                         and (nproc == 0 or line.startswith("[rank"))]
    assert not worker_tracebacks, res.stderr[-3000:]
    if nproc:  # a failure that is no stop for a requeue keeps torchrun's report of the failed ranks
        assert "ChildFailedError" in res.stderr and "exitcode  : 1" in res.stderr, res.stderr[-3000:]
        assert "for requeue" not in res.stderr
    assert f"no space left on device under {where}" in error[0] and "there is no earlier checkpoint" in error[0]
    assert "it needs at least" in error[0]
    assert list(where.iterdir()) == [] and not (run / "FINISHED").exists()


class _Held:
    """A checkpoint's small state, empty."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_keep_k_pruning_never_removes_the_last_good_checkpoint_when_a_save_fails(tmp_path):
    """A save that fails after others succeeded leaves the newest complete one in place."""
    class Failing:
        name, precision = "single", "fp32"
        env = None  # not read on the failure path

        def save(self, directory):
            raise OSError(28, "No space left on device", str(directory / "model.safetensors"))

    manager = CheckpointManager(tmp_path, keep=1, engine=Failing(), state=_Held(), rank_state=_Held())
    good = tmp_path / "checkpoints" / "step_00000002"
    good.mkdir(parents=True)
    (good / "meta.json").write_text(json.dumps({"step": 2, "files": {}}))
    with pytest.raises(RuntimeError, match="no space left on device.*step_00000002 is complete"):
        manager.save(4)
    assert list_checkpoints(tmp_path / "checkpoints") == [good]
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


def test_an_engine_that_cannot_save_in_the_background_says_so_once_and_times_its_saves(tmp_path, caplog):
    """checkpoint.async_save=true on an engine without a background save: synchronous, said once; every
    save's wall time is in meta.json and on the manager."""
    class Plain:  # no registry entry (so no background strategy read): the state I/O's save alone
        name, precision = "plain", "fp32"
        env = SimpleNamespace(world_size=1)
        module = None

        def save(self, directory):
            (directory / "weights.bin").write_bytes(b"weights")

    manager = CheckpointManager(tmp_path, keep=2, engine=Plain(), state=_Held(), rank_state=_Held(), async_save=True)
    for step in (1, 2):
        manager.save(step)
    assert caplog.text.count("engine=plain cannot save in the background") == 1 and not manager.background
    meta = json.loads((tmp_path / "checkpoints" / "step_00000002" / META_FILE).read_text())
    assert meta["save_seconds"] == manager.last_save_seconds >= 0
    assert manager.last_stall_seconds >= manager.last_save_seconds


# -- two runs on one run directory ---------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_on_a_live_run_directory_refuses_naming_the_first(sample_root, tmp_path):
    run = tmp_path / "run"
    args = [f"data.root={sample_root}", *BASE, "checkpoint.every_steps=0", f"hydra.run.dir={run}"]
    first = subprocess.Popen([sys.executable, "-m", "slurmvla.train", *args, "trainer.max_steps=100000"], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and first.poll() is None, "the first run did not start"
            time.sleep(0.2)
        # Alive, holding the lock, and not training while the second run starts (a stopped process is alive).
        os.kill(first.pid, signal.SIGSTOP)
        res = cli([*args, "trainer.max_steps=4"])
        assert res.returncode == 2, res.stderr[-3000:]
        error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "Traceback" not in res.stderr
        assert f"is in use by another run (host {socket.gethostname()}, pid {first.pid}" in error[0]
        assert first.poll() is None, "the refused run must not disturb the first"
    finally:
        first.kill()
        first.wait()
    # The first run died without releasing the lock: the next run takes it over, and says so.
    res = cli([*args, "trainer.max_steps=4"])
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout + res.stderr
    assert f"took over the lock on {run} left by host {socket.gethostname()}, pid {first.pid}" in said
    assert f"pid {first.pid} is no longer running on this host" in said
    assert not (run / LOCK_FILE).exists(), "a finished run releases its lock"


def _foreign_lock(run: Path, job_id: str | None, age_s: float) -> None:
    run.mkdir(parents=True, exist_ok=True)
    holder = {"host": "elsewhere-node7", "pid": 4242, "job_id": job_id, "started": time.time() - age_s}
    (run / LOCK_FILE).write_text(json.dumps(holder))
    os.utime(run / LOCK_FILE, (time.time() - age_s, time.time() - age_s))


def test_run_lock_judges_a_holder_on_another_host(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no squeue: only the heartbeat can tell
    run = tmp_path / "run"
    _foreign_lock(run, "777", age_s=5)
    with pytest.raises(RunDirInUse, match=r"host elsewhere-node7, pid 4242, SLURM job 777.*scancel 777"):
        RunLock(run, SlurmJob(job_id="900")).acquire()
    # Its requeued self (the same job id) takes it over at once.
    lock = RunLock(run, SlurmJob(job_id="777", restart_count=1))
    assert "the same SLURM job 777, requeued" in lock.acquire()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (run / LOCK_FILE).exists()
    # A lock nobody has touched for longer than the heartbeat allows is stale.
    _foreign_lock(run, "777", age_s=3600)
    lock = RunLock(run, SlurmJob(job_id="900"))
    assert "not touched for" in lock.acquire()
    lock.release()


# -- a rank stopped inside a collective ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stopped_rank_fails_the_job_within_the_timeout_naming_that_rank(sample_root, tmp_path):
    timeout_s = 10
    run, out = tmp_path / "run", tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "slurmvla.train",
           f"data.root={sample_root}", *BASE, "engine=ddp", f"engine.timeout_s={timeout_s}", "trainer.max_steps=100000",
           "checkpoint.every_steps=0", f"hydra.run.dir={run}"]
    with open(out, "w") as sink:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    victim = None
    try:
        deadline = time.monotonic() + 180
        while victim is None or not (run / "metrics.jsonl").exists():
            assert time.monotonic() < deadline and job.poll() is None, out.read_text()[-3000:]
            for p in psutil.Process(job.pid).children(recursive=True):
                try:
                    if p.environ().get("RANK") == "1" and "slurmvla.train" in " ".join(p.cmdline()):
                        victim = p
                except psutil.Error:
                    pass
            time.sleep(0.2)
        victim.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        t_error = None
        while job.poll() is None:
            if t_error is None and "error: a collective failed" in out.read_text():
                t_error = time.monotonic() - t_stop
                # Rank 0 has said it and is ending the job; torchrun would wait 30 s for the stopped rank to
                # answer its SIGTERM before killing it (its own grace, nothing of ours): the node is gone.
                try:
                    victim.kill()
                except psutil.Error:
                    pass
            assert time.monotonic() - t_stop < timeout_s + 120, "the job did not end after a rank stopped"
            time.sleep(0.2)
        t_end = time.monotonic() - t_stop
        log = out.read_text()
        t_error = t_error if t_error is not None else t_end
    finally:
        if victim is not None:
            try:
                victim.kill()
            except psutil.Error:
                pass
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0
    error = [line for line in log.splitlines() if "error: a collective failed" in line]
    assert error, log[-3000:]
    assert f"rank 1 (host {socket.gethostname()}, pid {victim.pid}) last seen" in error[0], error[0]
    assert t_error < timeout_s + 20, (t_error, log[-3000:])
    print(f"SIGSTOP rank 1: error naming it after {t_error:.1f}s (engine.timeout_s={timeout_s}), job ended after "
          f"{t_end:.1f}s")


# -- a kill while a background save is being written ---------------------------------------------


@pytest.mark.slow
def test_a_kill_during_a_background_save_leaves_the_previous_checkpoint_to_resume_from(make_cfg, sample_root,
                                                                                        tmp_path):
    """policy=small writes ~600 MB per checkpoint: SIGKILL the run while the background writer is
    inside step 2's temp folder. Step 1 stays the newest complete checkpoint, intact, and the resumed
    run ends with the weights of an uninterrupted one. At 64 x 64 images (16 patches a camera, not 196) the
    weights are as many and the steps a tenth of the work: the checkpoint's size is what the test needs."""
    run = tmp_path / "run"
    over = ["policy=small", "policy.image_size=64", "trainer.global_batch_size=2", "checkpoint.every_steps=1",
            "checkpoint.async_save=true"]
    base = [b for b in BASE if not b.startswith("policy=")]
    cmd = [sys.executable, "-m", "slurmvla.train", f"data.root={sample_root}", *base, *over, "trainer.max_steps=3",
           f"hydra.run.dir={run}"]
    job = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    partial = run / "checkpoints" / ".step_00000002.tmp" / "model.safetensors"
    try:
        deadline = time.monotonic() + 300
        while not partial.exists():
            assert time.monotonic() < deadline and job.poll() is None, "no background write to interrupt"
            time.sleep(0.01)
        job.kill()
    finally:
        job.kill()
        job.wait()
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000001"]
    assert verify(run / "checkpoints" / "step_00000001") == []
    resumed = Trainer(make_cfg(*over, "trainer.max_steps=2"), run)
    try:
        assert resumed.resumed_from.name == "step_00000001"
        resumed.fit()
        weights = resumed.engine.model_state_dict()
    finally:
        resumed.close()
    # The uninterrupted reference writes only its final checkpoint (600 MB each; saving changes no weight).
    reference = Trainer(make_cfg(*over, "trainer.max_steps=2", "checkpoint.every_steps=0"), tmp_path / "reference")
    try:
        reference.fit()
        assert rel_l2(weights, reference.engine.model_state_dict()) < 1e-6
    finally:
        reference.close()


# -- a kill while a sharded engine's background save is being committed --------------------------

DRIVER = Path(__file__).with_name("dist_driver.py")
SHARDED = ["fsdp_full", pytest.param("zero2", marks=pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                                     reason="needs the [deepspeed] extra"))]


def drive(out: Path, job: int, base: list[str], runs: list[dict], timeout: int = 300) -> subprocess.CompletedProcess:
    """One torchrun job of tests/dist_driver.py at world size 2 (its exit code is not checked here)."""
    spec = out / f"spec{job}.json"
    spec.write_text(json.dumps({"out": str(out), "base": base, "runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(DRIVER), str(spec)]
    code, log = run_until(cmd, timeout, f"torchrun job {job}")
    return subprocess.CompletedProcess(cmd, code, log)


@pytest.fixture(scope="module")
def killed_background_saves(sample_root, tmp_path_factory) -> tuple[Path, dict]:
    """Per sharded engine at world size 2: 3 steps, a background save after each; the whole job
    (torchrun and both ranks) SIGKILLed the moment rank 0 is about to commit step 3, every byte of it
    written; then the same run again. A kill ends its job, so engine i's restart shares a job with
    engine i+1's kill. fsdp_full's newest checkpoint also gets a damaged shard before its restart."""
    engines = [e for e in ("fsdp_full", "zero2") if e != "zero2" or importlib.util.find_spec("deepspeed")]
    out = tmp_path_factory.mktemp("background")
    base = [f"data.root={sample_root}", "data.loader=map", *BASE, "trainer.max_steps=3", "checkpoint.every_steps=1",
            "checkpoint.keep=2", "checkpoint.async_save=true", "trainer.ema_decay=0.9"]
    found: dict[str, dict] = {}
    for job in range(len(engines) + 1):
        runs = []
        if job > 0:
            engine = engines[job - 1]
            runs.append({"name": engine, "dir": str(out / engine), "overrides": [f"engine={engine}"]})
        if job < len(engines):
            engine = engines[job]
            runs.append({"name": f"{engine}_killed", "dir": str(out / engine), "overrides": [f"engine={engine}"],
                         "kill_before_commit": 3})
        res = drive(out, job, base, runs)
        assert res.returncode == (0 if job == len(engines) else -signal.SIGKILL), res.stdout[-5000:]
        if job < len(engines):
            checkpoints = out / engine / "checkpoints"
            uncommitted = checkpoints / ".step_00000003.tmp"
            found[engine] = {"after_kill": [p.name for p in list_checkpoints(checkpoints)],
                             "problems": [verify(p) for p in list_checkpoints(checkpoints)],
                             "uncommitted": sorted(str(f.relative_to(uncommitted)) for f in uncommitted.rglob("*"))}
            # What the uninterrupted run held at step 3 (the restart removes the folder).
            shutil.copytree(uncommitted, out / f"{engine}.step3")
            if engine == "fsdp_full":
                _flip_byte(checkpoints / "step_00000002" / "dcp" / "__1_0.distcp")
    return out, found


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("engine", SHARDED)
def test_a_kill_before_a_sharded_background_save_commits_leaves_the_previous_one_to_resume_bitwise(
        killed_background_saves, engine):
    out, found = killed_background_saves
    state = found[engine]
    # Steps 1 and 2 were committed from the background while training went on; step 3 was fully written
    # by both ranks but never renamed, so it is no checkpoint.
    assert state["after_kill"] == ["step_00000001", "step_00000002"] and state["problems"] == [[], []]
    assert META_FILE not in state["uncommitted"] and "rank_00001.pt" in state["uncommitted"]
    assert any(f.startswith(("dcp/__1_", "deepspeed/state/zero_pp_rank_1")) for f in state["uncommitted"])
    checkpoints = out / engine / "checkpoints"
    report = json.loads((out / f"{engine}.json").read_text())
    # fsdp_full's step 2 had a damaged shard: moved aside, and the restart went back to step 1.
    expected = "step_00000001" if engine == "fsdp_full" else "step_00000002"
    assert report["resumed_from"].endswith(expected) and report["step"] == 3
    assert (checkpoints / ".step_00000002.corrupt").is_dir() == (engine == "fsdp_full")
    # The restart ends with the weights and moving average the uninterrupted run had at step 3, bitwise.
    reference = ENGINES.get(engine).load_full_state(out / f"{engine}.step3")
    resumed = load_file(str(out / f"{engine}.safetensors"))
    assert reference.keys() == resumed.keys() and all(torch.equal(reference[k], resumed[k]) for k in reference)
    ema, resumed_ema = load_file(str(out / f"{engine}.step3" / "ema.safetensors")), load_file(
        str(out / f"{engine}.ema.safetensors"))
    assert all(torch.equal(ema[k], resumed_ema[k]) for k in ema)
    final = checkpoints / "step_00000003"
    meta = json.loads((final / META_FILE).read_text())
    assert verify(final) == [] and meta["save_seconds"] > 0
    assert meta["format"] == CHECKPOINT.current  # the engine's own layout (DCP, ZeRO) under a versioned meta.json
