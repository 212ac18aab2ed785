"""Evaluation off the training job as SLURM job arrays (slurmvla.launch.eval_array, python -m slurmvla.eval_array),
without a cluster: the sbatch line, the state file, the pinning of checkpoints, the gathering of complete and of
incomplete evaluations, the logger's earlier-step records, the option errors; and the trainer's side with stand-in
sbatch / squeue / sacct commands on PATH. The real array, killed and requeued on the SLURM test cluster:
tests/slurm/test_slurm.py::test_checkpoint_evaluation_as_a_job_array_survives_a_requeued_element."""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slurmvla.compose import compose
from slurmvla.launch.eval_array import (
    DONE,
    INCOMPLETE,
    MISSING,
    STATE_FILE,
    SUBMITTED,
    TO_SUBMIT,
    ArraySettings,
    EvalArrays,
    element_command,
    indices_spec,
    run_element,
    sbatch_command,
    shard_name,
    submit_environment,
)

REPO = Path(__file__).resolve().parents[2]


def _summary(seeds: list[int], successes: list[bool], step: int = 20) -> dict:
    """A shard's rollout summary as python -m slurmvla.rollout writes it (what the merge reads)."""
    from slurmvla.inference.closed_loop import summarize

    episodes = [{"seed": s, "success": ok, "return": 10.0 + s % 7, "length": 30 + s % 5, "requests": 8}
                for s, ok in zip(seeds, successes)]
    return {**summarize(episodes, 1.5), "source": "ckpt", "step": step, "max_steps": 100, "execution": "sync",
            "delay": 0, "shard": "?", "host": "node1"}


def _merge(paths: list[Path], out: Path) -> None:
    from slurmvla.rollout import merge

    merge(paths, out)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _arrays(run: Path, logged: list, queue=lambda job: {}, submitted: list | None = None, clock=None,
            states=lambda job: {1: "FAILED 1:0"}, **settings) -> EvalArrays:
    def submitter(cmd):
        if submitted is not None:
            submitted.append(cmd)
        return "777"

    return EvalArrays(run, ArraySettings(**{"shards": 2, "poll_s": 10.0, **settings}), "demo",
                      lambda step, m: logged.append((step, m)), merge=_merge, queue=queue,
                      states=states, submitter=submitter, clock=clock or Clock())


def _checkpoint(run: Path, step: int) -> Path:
    path = run / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "meta.json").write_text("{}")
    return path


def test_the_sbatch_line_of_an_evaluation_array(tmp_path):
    settings = ArraySettings(shards=3, partition="cpu", time="0-02:00:00", cpus_per_task=6, gpus_per_task=1,
                             sbatch_args=["--mem=16G", "--account=robotics"], overrides=["serve.device=cuda"],
                             python="/opt/env/bin/python")
    ckpt, out = tmp_path / "my run" / "checkpoints" / "step_00000020", tmp_path / "my run" / "rollout" / "step_00000020"
    cmd = sbatch_command(settings, ckpt, out, "demo-eval-20")
    element = (f"exec /opt/env/bin/python -m slurmvla.eval_array element {shlex.quote(str(ckpt))} --shards 3 --out "
               f"{shlex.quote(str(out))} serve.device=cuda")
    assert cmd == ["sbatch", "--parsable", "--array=0-2", "--requeue", "--open-mode=append", "--job-name=demo-eval-20",
                   f"--output={out}/slurm-%A_%a.out", "--time=0-02:00:00", "--cpus-per-task=6", "--ntasks=1",
                   "--partition=cpu", "--gpus-per-task=1", "--mem=16G", "--account=robotics", "--wrap", element]
    # The wrap is one shell line: the path with a space stays one word.
    assert shlex.split(element)[5] == str(ckpt)
    # A resubmission names the missing elements; --test-only checks and submits nothing.
    assert "--array=0,2" in sbatch_command(settings, ckpt, out, "x", [2, 0])
    assert indices_spec([2, 1]) == "1-2" and indices_spec([0, 2]) == "0,2" and indices_spec([1]) == "1"
    assert sbatch_command(ArraySettings(shards=2), ckpt, out, "x", test_only=True)[:3] == \
        ["sbatch", "--test-only", "--array=0-1"]
    default = sbatch_command(ArraySettings(shards=2), ckpt, out, "x")
    assert not any(a.startswith(("--partition", "--gpus")) for a in default)
    assert element_command(sys.executable, ckpt, out, 2, []).startswith(f"exec {shlex.quote(sys.executable)} -m ")


def test_the_elements_get_the_training_environment_without_its_job_and_ranks():
    env = {"PATH": "/bin", "SLURM_CONF": "/etc/slurm.conf", "SLURM_JOB_ID": "5", "SLURM_NTASKS": "2", "RANK": "0",
           "WORLD_SIZE": "2", "MASTER_ADDR": "node1", "CUDA_VISIBLE_DEVICES": "0,1", "TORCHELASTIC_RUN_ID": "x",
           "SBATCH_ACCOUNT": "robotics", "OMP_NUM_THREADS": "1"}
    assert submit_environment(env) == {"PATH": "/bin", "SLURM_CONF": "/etc/slurm.conf", "SBATCH_ACCOUNT": "robotics",
                                       "OMP_NUM_THREADS": "1"}


def test_a_planned_evaluation_pins_its_checkpoint_is_submitted_once_committed_and_survives_a_restart(tmp_path):
    from slurmvla.checkpoint import CheckpointManager

    run, logged, submitted = tmp_path / "run", [], []
    arrays = _arrays(run, logged, submitted=submitted)
    ckpt = run / "checkpoints" / "step_00000020"
    arrays.plan(20, ckpt)  # before the save: pinned already
    assert arrays.pinned() == {20} and arrays.entries[20]["status"] == TO_SUBMIT
    arrays.poll()
    assert submitted == [], "submitted before the checkpoint was committed"
    _checkpoint(run, 20)
    arrays.poll()
    assert len(submitted) == 1 and "--array=0-1" in submitted[0] and str(ckpt.resolve()) in submitted[0][-1]
    state = json.loads((run / STATE_FILE).read_text())
    assert state["steps"]["20"]["status"] == SUBMITTED and state["steps"]["20"]["job"] == "777"
    # Rotation keeps it past checkpoint.keep=1 while its evaluation runs; the others go.
    for step in (30, 40):
        _checkpoint(run, step)
    manager = CheckpointManager(run, 1, None, None, None)
    manager.protected = arrays.pinned
    manager.prune()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000020", "step_00000040"]
    # A requeued run reads the state back; evaluations past the checkpoint it resumes from are dropped.
    again = _arrays(run, logged)
    again.plan(50, run / "checkpoints" / "step_00000050")
    again.resumed_at(40)
    assert set(again.entries) == {20} and again.entries[20]["job"] == "777"
    assert set(_arrays(run, logged).entries) == {20}
    # Planned again (a lineage that reached step 20 anew), the step's folder of the earlier evaluation goes aside:
    # none of its shards counts for the new one.
    (arrays.step_dir(20) / shard_name(0, 2)).write_text("{}")
    again.plan(20, ckpt)
    assert not arrays.step_dir(20).exists() and len(list(arrays.out_root.glob(".step_00000020.superseded.*"))) == 1


def test_a_complete_evaluation_is_merged_and_logged_at_its_step_and_its_checkpoint_released(tmp_path):
    run, logged = tmp_path / "run", []
    arrays = _arrays(run, logged)
    arrays.plan(20, _checkpoint(run, 20))
    arrays.poll()
    out = arrays.step_dir(20)
    (out / shard_name(0, 2)).write_text(json.dumps(_summary([100, 102], [True, False])))
    assert arrays.poll() == [] and logged == []
    (out / shard_name(1, 2)).write_text(json.dumps(_summary([101], [True])))
    assert arrays.poll() == [20]
    # The reference: the summary of all three episodes, computed here.
    reference = _summary([100, 102, 101], [True, False, True])
    [(step, metrics)] = logged
    assert step == 20 and metrics["rollout/missing_shards"] == 0
    for key in ("rollout/success_rate", "rollout/episodes", "rollout/successes", "rollout/mean_return",
                "rollout/mean_length", "rollout/success_ci95_low", "rollout/success_ci95_high"):
        assert metrics[key] == pytest.approx(reference[key]), key
    assert metrics["rollout/success_rate"] == pytest.approx(2 / 3)
    merged = json.loads((out / "rollout.json").read_text())
    assert merged["step"] == 20 and merged["shards"] == 2
    assert arrays.entries[20]["status"] == DONE and arrays.pinned() == set()
    assert arrays.poll() == [] and len(logged) == 1, "logged twice"


def test_an_element_that_failed_for_good_is_reported_missing_never_averaged_over(tmp_path, caplog):
    run, logged, clock = tmp_path / "run", [], Clock()
    queue, accounting = {"777": {1: "RUNNING"}}, {"777": {1: "RUNNING 0:0"}}
    arrays = _arrays(run, logged, queue=lambda job: dict(queue[job]), clock=clock,
                     states=lambda job: dict(accounting[job]))
    arrays.plan(20, _checkpoint(run, 20))
    arrays.poll()
    out = arrays.step_dir(20)
    (out / shard_name(0, 2)).write_text(json.dumps(_summary([100, 102], [True, True])))
    clock.t += 100
    assert arrays.poll() == []  # element 1 still running (or requeued): nothing decided
    queue["777"] = {}  # it left the queue without its shard
    clock.t += 100
    assert arrays.poll() == [], "decided at the first look (a shard may show late on a network filesystem)"
    clock.t += 5
    assert arrays.poll() == [], "the queue asked again before poll_s"
    clock.t += 10
    assert arrays.poll() == [], "decided before the accounting recorded the element's end"
    accounting["777"] = {1: "FAILED 1:0"}
    clock.t += 10
    with caplog.at_level(logging.ERROR, logger="slurmvla"):
        assert arrays.poll() == [20]
    assert logged == [(20, {"rollout/missing_shards": 1.0, "rollout/shards": 2.0})]
    assert "array job 777 is incomplete" in caplog.text and "777_1 (FAILED 1:0; log" in caplog.text
    assert "slurm-777_1.out" in caplog.text and not (out / "rollout.json").exists()
    report = json.loads((out / MISSING).read_text())
    assert report["missing"] == [1] and "--index 1" in report["rerun"][0]
    assert arrays.entries[20]["status"] == INCOMPLETE and arrays.pinned() == {20}, "its checkpoint must stay"
    # Rerun by hand (the command in missing.json): the next gather completes it.
    (out / shard_name(1, 2)).write_text(json.dumps(_summary([101], [False])))
    assert arrays.poll() == [20] and logged[-1][1]["rollout/episodes"] == 3 and arrays.pinned() == set()
    assert not (out / MISSING).exists()


def test_an_incomplete_evaluation_is_resubmitted_as_an_array_of_its_missing_elements(tmp_path):
    run, logged, submitted, clock = tmp_path / "run", [], [], Clock()
    arrays = _arrays(run, logged, submitted=submitted, clock=clock, shards=3)
    arrays.plan(20, _checkpoint(run, 20))
    arrays.poll()
    (arrays.step_dir(20) / shard_name(1, 3)).write_text(json.dumps(_summary([101], [True])))
    for _ in range(6):  # accounting knows nothing of elements 0 and 2: decided after a few looks
        clock.t += 100
        arrays.poll()
    assert arrays.entries[20]["status"] == INCOMPLETE and arrays.entries[20]["missing"] == [0, 2]
    assert arrays.resubmit(20) == "777"
    assert "--array=0,2" in submitted[-1] and arrays.entries[20]["status"] == SUBMITTED


def test_an_element_is_idempotent_and_the_last_one_merges(tmp_path):
    """run_element with a stand-in for python -m slurmvla.rollout (a script writing the shard the real one would):
    a shard already there is not run again, a killed run's scratch is replaced, the complete set is merged."""
    fake = tmp_path / "fake_rollout.py"
    calls, summary = tmp_path / "calls", tmp_path / "summary.json"
    summary.write_text(json.dumps(_summary([100], [True])))
    fake.write_text(f"""import json, sys
from pathlib import Path
args = sys.argv[1:]
i, n = map(int, args[args.index("--shard") + 1].split("/"))
out = Path(args[args.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open({str(calls)!r}, "a") as f:
    f.write(f"{{i}}\\n")
(out / f"episode_{{i}}.mp4").write_bytes(b"v")
(out / f"rollout_shard{{i}}of{{n}}.json").write_text(Path({str(summary)!r}).read_text())
""")
    # The element runs "PYTHON -m slurmvla.rollout ...": a PYTHON that runs the stand-in instead.
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {fake} \"$@\"\n")
    python.chmod(0o755)
    out = tmp_path / "step"
    (out / ".shard0of2.tmp").mkdir(parents=True)
    (out / ".shard0of2.tmp" / "half.json").write_text("{")  # a killed run's leftovers
    assert run_element(tmp_path / "ckpt", out, 0, 2, [], python=str(python), merge=_merge) == "ran"
    assert not (out / "rollout.json").exists() and not (out / ".shard0of2.tmp").exists()
    assert (out / "episode_0.mp4").is_file() and not (out / "half.json").exists()
    assert run_element(tmp_path / "ckpt", out, 0, 2, [], python=str(python), merge=_merge) == "skipped"
    assert run_element(tmp_path / "ckpt", out, 1, 2, [], python=str(python), merge=_merge) == "ran"
    assert json.loads((out / "rollout.json").read_text())["rollout/episodes"] == 2
    assert calls.read_text().split() == ["0", "1"]


def test_an_earlier_steps_metrics_land_at_that_step_in_the_file_and_on_wandbs_own_axis(tmp_path):
    from slurmvla.config import WandbConfig
    from slurmvla.logger import MetricLogger

    class Run:
        def __init__(self):
            self.rows, self.defined = [], []

        def define_metric(self, name, step_metric=None):
            self.defined.append((name, step_metric))

        def log(self, row, step=None, commit=None):
            self.rows.append((step, dict(row)) if commit is None else ("commit", dict(row)))

        def finish(self):
            pass

    logger = MetricLogger(tmp_path, WandbConfig(mode="disabled"), "x", {}, enabled=True)
    logger.start(0)
    logger._wandb = run = Run()
    logger.log(30, {"loss": 1.0})
    logger.log_at(20, {"rollout/success_rate": 0.5})
    logger.log_at(10, {"rollout/success_rate": 0.25})
    logger.log(40, {"loss": 0.5})
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("rollout/success_rate")) for r in records] == [(30, None), (20, 0.5), (10, 0.25),
                                                                             (40, None)]
    assert ("rollout/*", "rollout/step") in run.defined
    # wandb's steps only go up: the earlier step rides the next training row; at close the open row is committed and
    # the rest go out one row each (checked against wandb 0.31's offline run file: rows 40 and 41, nothing dropped).
    assert run.rows == [(30, {"loss": 1.0}), (40, {"loss": 0.5, "rollout/success_rate": 0.5, "rollout/step": 20}),
                        ("commit", {}), (None, {"rollout/success_rate": 0.25, "rollout/step": 10})]
    # A program adding to a finished run keeps every record (start(None)); a resume drops those past it.
    again = MetricLogger(tmp_path, WandbConfig(mode="disabled"), "x", {}, enabled=True)
    again.start(None)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("override, message", [
    ("rollout_array.time=1h", "rollout_array.time='1h' is not a SLURM time; write it as one of ['MM', 'MM:SS', "
                              "'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS']"),
    ("rollout_array.shards=0", "rollout_array.shards=0 is not valid; it must be > 0"),
    ("rollout_array.sbatch_args=['--array=0-9']", "'--array=0-9': set rollout_array.shards instead"),
    ("rollout_array.sbatch_args=['--output=x']", "'--output=x' is the array's own"),
    ("rollout_array.sbatch_args=['mem=4G']", "'mem=4G' is not one sbatch option"),
    ("rollout_array.partition=' '", "rollout_array.partition=' ' is not a partition name"),
])
def test_a_bad_option_is_one_line_naming_the_value_and_the_choices(override, message):
    with pytest.raises(ValueError) as e:
        compose(["trainer.rollout_every_steps=10", "rollout_array.enabled=true", override])
    assert message in str(e.value), str(e.value)


def test_the_array_needs_evaluation_steps_and_lets_a_sharded_engine_evaluate(tmp_path):
    with pytest.raises(ValueError, match="rollout_array.enabled=true evaluates the checkpoints of "
                                         "trainer.rollout_every_steps, which is 0"):
        compose(["rollout_array.enabled=true"])
    with pytest.raises(ValueError, match="evaluate each checkpoint off the job"):
        compose(["engine=fsdp_full", "trainer.rollout_every_steps=10"])
    assert compose(["engine=fsdp_full", "trainer.rollout_every_steps=10", "rollout_array.enabled=true"]).rollout_array.enabled
    res = subprocess.run([sys.executable, "-m", "slurmvla.train", "trainer.rollout_every_steps=10",
                          "rollout_array.enabled=true", "rollout_array.time=1h", f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 2 and "rollout_array.time='1h' is not a SLURM time" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _stand_ins(bin_dir: Path) -> Path:
    """sbatch / squeue / sacct stand-ins on PATH: sbatch records its arguments (one per line, a blank line after each
    call) and answers job ids 101, 102, ...; squeue has nothing queued; sacct knows nothing."""
    bin_dir.mkdir()
    calls = bin_dir / "sbatch.calls"
    (bin_dir / "sbatch").write_text(f"""#!/bin/sh
printf '%s\\n' "$@" >> {calls}; echo >> {calls}
case "$*" in *--test-only*) echo "sbatch: Job 1 to start at 2026-01-01T00:00:00 using 1 processors on nodes node1" >&2; exit 0;; esac
n=$(cat {bin_dir}/counter 2>/dev/null || echo 100); n=$((n + 1)); echo $n > {bin_dir}/counter; echo $n
""")
    for name in ("squeue", "sacct"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return calls


def test_the_trainer_submits_each_evaluation_trains_on_and_its_results_land_at_that_step(make_cfg, tmp_path,
                                                                                        monkeypatch, caplog):
    from slurmvla.eval_array import main as eval_array_main
    from slurmvla.trainer import Trainer

    calls = _stand_ins(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    cfg = make_cfg("trainer.max_steps=4", "trainer.rollout_every_steps=2", "trainer.log_every_steps=1",
                   "checkpoint.every_steps=1", "checkpoint.keep=1", "rollout_array.enabled=true",
                   "rollout_array.shards=2", "rollout_array.wait_s=0", "rollout_array.poll_s=0.1",
                   "rollout_array.partition=cpu")
    trainer = Trainer(cfg, run)
    with caplog.at_level(logging.WARNING, logger="slurmvla"):
        trainer.fit()
    trainer.close()
    submissions = [c.split("\n") for c in calls.read_text().strip("\n").split("\n\n")]
    assert [c[0] for c in submissions] == ["--test-only", "--parsable", "--parsable"]
    for step, args in zip((2, 4), submissions[1:]):
        ckpt = run.resolve() / "checkpoints" / f"step_{step:08d}"
        assert "--array=0-1" in args and "--requeue" in args and "--partition=cpu" in args
        assert args[-1].endswith(f"element {ckpt} --shards 2 --out {run.resolve()}/rollout/step_{step:08d}")
    # Training went on without waiting: every step's loss, no rollout/* yet; the checkpoints of both evaluations kept
    # past checkpoint.keep=1.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and not any("rollout/success_rate" in r for r in records)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    assert "evaluations still pending: step 2 (array job 101: 2 of 2 shards missing" in caplog.text
    # Step 2's elements finish after training; step 4's element 1 fails for good.
    out2, out4 = run / "rollout" / "step_00000002", run / "rollout" / "step_00000004"
    (out2 / shard_name(0, 2)).write_text(json.dumps(_summary([100000, 100002], [True, False], step=2)))
    (out2 / shard_name(1, 2)).write_text(json.dumps(_summary([100001], [True], step=2)))
    (out4 / shard_name(0, 2)).write_text(json.dumps(_summary([100000], [True], step=4)))
    eval_array_main(["gather", str(run), "--wait", "60"])  # returns once nothing is pending
    late = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][4:]
    reference = _summary([100000, 100002, 100001], [True, False, True], step=2)
    assert late[0]["step"] == 2 and late[0]["rollout/success_rate"] == pytest.approx(reference["rollout/success_rate"])
    assert late[0]["rollout/mean_return"] == pytest.approx(reference["rollout/mean_return"])
    assert late[1] == {"step": 4, "rollout/missing_shards": 1.0, "rollout/shards": 2.0}
    # Step 2's checkpoint is released and pruned; step 4's stays for the rerun of its missing element.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]
    state = json.loads((run / STATE_FILE).read_text())["steps"]
    assert (state["2"]["status"], state["4"]["status"], state["4"]["missing"]) == (DONE, INCOMPLETE, [1])
    # python -m slurmvla.table reads the merged summary like an in-job evaluation's.
    from slurmvla.table import runs_of

    assert [r["evaluations"] for r in runs_of(run)] == [{2: {"success_rate": pytest.approx(2 / 3), "episodes": 3}}]


def test_a_requeued_training_run_picks_up_its_pending_evaluations(make_cfg, tmp_path, monkeypatch):
    """The training stops after step 2 (as for a requeue) with step 2's array running; the resumed run reads the state
    file, finds the array's shards complete at its first log step and logs rollout/* at step 2, once."""
    from slurmvla.trainer import Trainer

    _stand_ins(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    run = tmp_path / "run"
    cfg = make_cfg("trainer.max_steps=4", "trainer.rollout_every_steps=2", "trainer.log_every_steps=1",
                   "checkpoint.every_steps=2", "rollout_array.enabled=true", "rollout_array.shards=2",
                   "rollout_array.wait_s=0")
    trainer = Trainer(cfg, run)
    trainer.fit(stop_at=2)
    trainer.close()
    assert json.loads((run / STATE_FILE).read_text())["steps"]["2"]["status"] == SUBMITTED
    out = run / "rollout" / "step_00000002"
    (out / shard_name(0, 2)).write_text(json.dumps(_summary([100000], [True], step=2)))
    (out / shard_name(1, 2)).write_text(json.dumps(_summary([100001], [False], step=2)))
    trainer = Trainer(cfg, run)
    assert trainer.resumed_from is not None and trainer.step == 2
    trainer.fit()
    trainer.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "rollout/success_rate" in r]
    assert [(r["step"], r["rollout/success_rate"]) for r in evaluated] == [(2, 0.5)], records
    assert records.index(evaluated[0]) == [r["step"] for r in records].index(3) + 1, "not at the first log step"
    state = json.loads((run / STATE_FILE).read_text())["steps"]
    assert state["2"]["status"] == DONE and state["4"]["status"] == SUBMITTED


@pytest.mark.parametrize("squeue, expected", [
    ("echo '0|RUNNING'; echo '[1-2%1]|PENDING'", {0: "RUNNING", 1: "PENDING", 2: "PENDING"}),
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", {}),  # the controller forgot the job
    ("echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1", None),  # nothing decided
])
def test_what_squeue_and_sacct_say_of_an_array(squeue, expected, tmp_path, monkeypatch):
    """Their outputs as SLURM 22.05 writes them (an element cancelled before it was split from the pending array is
    JOB_[I] in sacct, or absent until the rest has started)."""
    from slurmvla.launch.eval_array import element_states, queued_elements

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
    (bin_dir / "sacct").write_text("#!/bin/sh\nprintf '7_0|COMPLETED|0:0\\n7_[1]|CANCELLED by 0|0:0\\n"
                                   "7_[2-3]|PENDING|0:0\\n70_1|FAILED|1:0\\n'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert queued_elements("7") == expected
    assert element_states("7") == {0: "COMPLETED 0:0", 1: "CANCELLED by 0 0:0", 2: "PENDING 0:0", 3: "PENDING 0:0"}
