"""Faults injected for real: a corrupted checkpoint, a full disk during a save, two runs on one run
directory, a rank stopped inside a collective. Each checks the promised outcome and that nothing is
lost (the resumed run ends with the weights of an uninterrupted one)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from slurmvla.checkpoint import CheckpointManager, list_checkpoints, resolve_checkpoint, verify
from slurmvla.launch import SlurmJob
from slurmvla.launch.runlock import LOCK_FILE, RunDirInUse, RunLock
from slurmvla.trainer import Trainer

from .conftest import REPO, rel_l2

pytestmark = pytest.mark.faults

BASE = ["data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
        "trainer.global_batch_size=8", "trainer.log_every_steps=2", "policy=tiny"]


def cli(args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmvla.train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


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


@pytest.mark.parametrize("async_save", [True, False])
def test_disk_filling_during_a_save_is_an_error_naming_the_path_and_leaves_no_partial_checkpoint(
        sample_root, tmp_path, small_fs, async_save):
    """Less room than one checkpoint: the write itself hits ENOSPC (in the background writer or not)."""
    where = small_fs(1024)
    run = tmp_path / "run"
    res = cli([f"data.root={sample_root}", *BASE, "trainer.max_steps=2", "checkpoint.every_steps=2",
               f"checkpoint.async_save={str(async_save).lower()}", f"hydra.run.dir={run}"])
    assert res.returncode == 1, res.stderr[-3000:]
    error = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert f"no space left on device under {where}" in error[0] and "there is no earlier checkpoint" in error[0]
    assert "it needs at least" in error[0]
    assert list(where.iterdir()) == [] and not (run / "FINISHED").exists()


def test_keep_k_pruning_never_removes_the_last_good_checkpoint_when_a_save_fails(tmp_path):
    """A save that fails after others succeeded leaves the newest complete one in place."""
    class Failing:
        name, precision = "single", "fp32"
        env = None  # not read on the failure path

        def save(self, directory):
            raise OSError(28, "No space left on device", str(directory / "model.safetensors"))

    manager = CheckpointManager(tmp_path, keep=1)
    good = tmp_path / "checkpoints" / "step_00000002"
    good.mkdir(parents=True)
    (good / "meta.json").write_text(json.dumps({"step": 2, "files": {}}))
    with pytest.raises(RuntimeError, match="no space left on device.*step_00000002 is complete"):
        manager.save(4, Failing(), {}, {})
    assert list_checkpoints(tmp_path / "checkpoints") == [good]
    assert not list((tmp_path / "checkpoints").glob(".step_*"))


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
    run ends with the weights of an uninterrupted one."""
    run = tmp_path / "run"
    over = ["policy=small", "trainer.global_batch_size=2", "checkpoint.every_steps=1", "checkpoint.async_save=true"]
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
    reference = Trainer(make_cfg(*over, "trainer.max_steps=2"), tmp_path / "reference")
    try:
        reference.fit()
        assert rel_l2(weights, reference.engine.model_state_dict()) < 1e-6
    finally:
        reference.close()
