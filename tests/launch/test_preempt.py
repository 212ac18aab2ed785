"""Stop signals (slurmvla.launch.preempt, slurmvla.launch.grace) and the trainer's stop in every phase,
in one process. The multi-process stop is in test_distributed.py; real preemptions by a
higher-priority job on the SLURM test cluster are in tests/slurm/test_slurm.py."""

from __future__ import annotations

import logging
import os
import signal
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.launch.grace import shortfalls
from slurmvla.launch.preempt import PreemptionFlag, ignore_stop_signals, stop_signals
from slurmvla.trainer import Trainer


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_sigterm_and_usr2_set_the_flag_and_a_later_flag_takes_over_an_earlier_one(restore_signals):
    before = signal.getsignal(signal.SIGTERM)
    early = PreemptionFlag()
    early.install()
    os.kill(os.getpid(), signal.SIGTERM)  # e.g. during the entry point's imports
    assert early.is_set() and early.signal_name == "SIGTERM"
    late = PreemptionFlag()
    late.install()
    assert late.is_set() and late.signal_name == "SIGTERM" and late.received_at == early.received_at
    # What it hands back on uninstall is what was there before the first flag, not the first flag.
    late.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
    fresh = PreemptionFlag()
    fresh.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert fresh.signal_name == "SIGUSR2"


def test_stop_signals_follow_submitit_and_the_environment():
    assert stop_signals({}) == ("SIGTERM", "SIGUSR2")
    assert stop_signals({"SUBMITIT_PREEMPT_SIGNAL": "USR1", "SLURMVLA_STOP_SIGNALS": "sigxcpu, TERM"}) == \
        ("SIGTERM", "SIGUSR2", "SIGUSR1", "SIGXCPU")
    with pytest.raises(ValueError, match="'USR9'.*not a signal"):
        stop_signals({"SLURMVLA_STOP_SIGNALS": "USR9"})


@pytest.fixture
def submitit_handlers(restore_signals):
    """Handlers of the shape of submitit's SignalHandler installed (bypass for TERM, requeue for USR2), as its
    job runner installs them before the trainer's; returns the list of the calls they get."""
    calls = []

    class Submitit:
        def bypass(self, signum, frame):
            calls.append(("bypass", signum))

        def checkpoint_and_try_requeue(self, signum, frame):
            calls.append(("requeue", signum))

    handler = Submitit()
    signal.signal(signal.SIGTERM, handler.bypass)
    signal.signal(signal.SIGUSR2, handler.checkpoint_and_try_requeue)
    return calls


def test_hand_over_gives_sigterm_to_submitits_requeue_handler_not_its_bypass(submitit_handlers):
    calls = submitit_handlers
    flag = PreemptionFlag()
    flag.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert calls == []  # ours caught it; submitit's bypass did not run
    flag.hand_over()
    assert calls == [("requeue", signal.SIGTERM)]


def test_a_rank_without_its_own_signal_adopts_the_earliest_and_hands_it_over_once(submitit_handlers):
    """SLURM signals every task, but rank 0 may agree to stop before its own signal arrives: it takes
    the earliest rank's signal and age, and hands that signal to submitit's requeue handler (which
    requeues from rank 0) instead of exiting without a requeue; its own signal, arriving late during
    the exit, must not reach the handler a second time."""
    calls = submitit_handlers
    flag = PreemptionFlag()
    flag.install()
    assert flag.report() is None
    flag.adopt([None, ("SIGUSR2", 0.25), ("SIGUSR2", 4.0), None])
    assert flag.is_set() and flag.elsewhere and flag.signal_name == "SIGUSR2"
    assert 4.0 <= flag.report()[1] < 5.0  # the earliest signal's age, counted on from here
    flag.ignore_further()  # slurmvla.train's order: ignore, close the trainer (uninstall), hand over
    flag.uninstall()
    os.kill(os.getpid(), signal.SIGUSR2)  # its own, late: neither submitit's handler nor the default action
    assert calls == []
    flag.hand_over()
    assert calls == [("requeue", signal.SIGUSR2)]
    os.kill(os.getpid(), signal.SIGUSR2)
    os.kill(os.getpid(), signal.SIGTERM)  # SLURM's second SIGTERM: would kill the exit by default
    assert calls == [("requeue", signal.SIGUSR2)]

    own = PreemptionFlag()
    own.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    own.adopt([("SIGTERM", 9.0)])  # a rank with its own signal keeps it
    assert own.signal_name == "SIGUSR2" and not own.elsewhere and own.report()[1] < 1.0


def test_a_data_worker_outlives_the_stop_signals(restore_signals):
    """SLURM signals every process of a step; torch's workers die of any SIGTERM (and of USR2 by
    default), which would fail the step before its checkpoint."""
    from torch.utils.data import DataLoader

    loader = DataLoader(range(64), batch_size=1, num_workers=1, worker_init_fn=ignore_stop_signals)
    it = iter(loader)
    assert next(it).item() == 0
    worker = it._workers[0]
    os.kill(worker.pid, signal.SIGTERM)
    os.kill(worker.pid, signal.SIGUSR2)
    assert [next(it).item() for _ in range(40)] == list(range(1, 41)) and worker.is_alive()
    del it


def test_grace_warnings_name_the_budget_and_the_setting(tmp_path, monkeypatch):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho '   PriorityTier=1 OverSubscribe=NO\n   GraceTime=30 Hidden=NO\n"
                        "   OverTimeLimit=NONE PreemptMode=REQUEUE'\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    env = {"SLURM_JOB_PARTITION": "debug", "SLURMVLA_SIGNAL_DELAY_S": "120"}
    assert shortfalls(20.0, 1.0, 5, background=False, environ=env) == []  # 25 s fits both
    late = shortfalls(40.0, 1.0, 5, background=False, environ=env)
    assert len(late) == 1 and "partition debug's preemption GraceTime (30 s" in late[0] and "45 s" in late[0]
    both = shortfalls(70.0, 0.0, 5, background=True, environ=env)  # a save in flight + the stop's save
    assert len(both) == 2 and "--signal=USR2@SECONDS" in both[0] and "140 s" in both[0]
    scontrol.write_text("#!/bin/sh\necho 'GraceTime=0 PreemptMode=OFF'\n")
    assert shortfalls(500.0, 1.0, 5, background=False, environ={"SLURM_JOB_PARTITION": "debug"}) == []


class _SignalDuringValidation:
    """The validation loader, sending this process SIGTERM before its third batch."""

    def __init__(self, loader):
        self.loader, self.dataset = loader, loader.dataset

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch


def test_sigterm_during_validation_abandons_it_checkpoints_and_resumes_bitwise(make_cfg, tmp_path, caplog,
                                                                                 restore_signals):
    over = ("trainer.max_steps=6", "checkpoint.every_steps=0", "data.val_fraction=0.25",
            "trainer.signal_check_every_steps=5")
    # Validation changes nothing in training: the uninterrupted reference skips it.
    straight = Trainer(make_cfg(*over), tmp_path / "straight")
    straight.fit()
    straight.close()

    run = tmp_path / "stopped"
    over = (*over, "trainer.val_every_steps=3")
    first = Trainer(make_cfg(*over), run)
    first.val_loader = _SignalDuringValidation(first.val_loader)
    with caplog.at_level(logging.INFO, logger="slurmvla"):
        first.fit()
    first.close()
    assert first.stopped_for_requeue and first.step == 3
    assert "validation at step 3 abandoned for the stop signal" in caplog.text
    assert "stopped at step 3" in caplog.text and "after SIGTERM: checkpoint" in caplog.text
    assert [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_00000003"]
    assert not (run / "FINISHED").exists()

    second = Trainer(make_cfg(*over), run)
    second.fit()
    second.close()
    assert second.resumed_from.name == "step_00000003" and (run / "FINISHED").read_text().strip() == "6"
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_00000006" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_00000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_signal_during_start_up_stops_before_the_first_step_and_saves_nothing(make_cfg, tmp_path, restore_signals):
    early = PreemptionFlag()
    early.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    trainer = Trainer(make_cfg("trainer.max_steps=4"), tmp_path / "run")
    trainer.fit()
    trainer.close()
    assert trainer.stopped_for_requeue and trainer.step == 0
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_process_that_fails_with_live_data_workers_still_exits(tmp_path):
    """Workers that ignore SIGTERM would hang the exit of a process whose exception keeps its loader
    alive (multiprocessing's exit SIGTERMs daemonic children and waits): slurmvla.data.loader ends them."""
    import subprocess
    import sys

    script = tmp_path / "fail.py"
    script.write_text(
        "from torch.utils.data import DataLoader\n"
        "import slurmvla.data.loader\n"
        "from slurmvla.launch.preempt import ignore_stop_signals\n"
        "it = iter(DataLoader(range(1000), batch_size=1, num_workers=2, worker_init_fn=ignore_stop_signals))\n"
        "next(it)\n"
        "raise RuntimeError('a bug mid-run')\n")
    repo = str(Path(__file__).resolve().parents[2])
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": repo})
    assert res.returncode == 1 and res.stderr.strip().endswith("RuntimeError: a bug mid-run"), res.stderr[-2000:]
