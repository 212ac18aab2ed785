from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurmvla.compose import compose
from slurmvla.config import Config
from slurmvla.data.spec import SampleSpec
from slurmvla.data.synthetic import write_droid_sample
from slurmvla.policy import sample_spec

# One compute thread per process, here and in every process a test starts (torchrun ranks, servers, SLURM
# jobs inherit it): the suite runs several processes at once on few cores, and a second OpenMP thread per
# process then spins waiting for a core instead of computing (an in-process training costs 1.2x the CPU
# time with two threads alone, about 3x beside the rest of the suite). The models are tiny; one thread is
# about as fast alone. OMP_NUM_THREADS set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# absl's logging handler (absl is imported in-process by JAX / orbax: openpi's checkpoints) binds sys.stderr as it
# is when absl is first imported -- under pytest, the capture's file -- and closes any stream that is not the
# current sys.stderr / sys.stdout whenever logging is reconfigured (Hydra's dictConfig when ``train.cli`` runs
# in-process, during a capsys test): it then closes pytest's capture file and every later test on that worker
# errors with "I/O operation on closed file". Imported here, before any test, and pointed at the real stderr.
try:
    import absl.logging as _absl_logging
except ImportError:  # absl comes with the openpi extra
    pass
else:
    _absl_logging.get_absl_handler().python_handler.setStream(sys.__stderr__)


@pytest.fixture(autouse=True)
def _root_logging_as_it_was():
    """An entry point run in-process (``train.cli``: Hydra configures the job's logging; ``logging.basicConfig``
    in the others) leaves handlers on the root logger bound to that test's captured streams, which pytest
    closes: a later test's warning then prints "--- Logging error ---" into its own captured stderr. Each
    test gets the root logger back as it found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        # pytest's own capture handlers (module _pytest.logging) come and go with each phase: theirs to remove.
        if handler not in handlers and type(handler).__module__ == "logging":
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)


# scripts/test.sh runs the suite on pytest-xdist workers (--dist loadgroup). Tests that share what
# must exist once go to one worker as a group: the SLURM test cluster (one at a time on a machine),
# the parity matrix's two jobs, and any other fixture a test module computes once for its tests.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# Module fixtures each worker may compute for itself (a few seconds), so that their tests spread.
CHEAP_TO_REPEAT = {"matrix_root", "single_references", "single_reference"}


def _worker_group(item) -> str | None:
    if "cluster" in item.fixturenames:
        return "slurm"
    if "strategy_jobs" in item.fixturenames:  # the parity matrix's torchrun jobs, each computed on first use
        from tests.test_distributed import matrix_job

        return f"matrix-{matrix_job(item.callspec.params['policy'])}"
    defs = getattr(item, "_fixtureinfo", None)
    shared = any(fixturedefs[-1].scope == "module" and name not in CHEAP_TO_REPEAT
                 for name, fixturedefs in (defs.name2fixturedefs.items() if defs else ()))
    return item.module.__name__ if shared else None


# SLURMVLA_TEST_CPU=FILE: each test's CPU seconds -- its worker's own and those of the processes it started and
# waited for (torchrun jobs, CLI runs, servers) -- appended to FILE as JSON lines, and the suite's total with the
# costliest tests printed at the end. On 2 cores the suite is CPU-bound: its time is this total over the cores,
# plus what the SLURM cluster's jobs spend (their processes are slurmd's children, not the tests').
CPU_REPORT = os.environ.get("SLURMVLA_TEST_CPU")


def _cpu_seconds() -> tuple[float, float]:
    import resource

    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


def pytest_sessionstart(session):
    """The report is this run's: an earlier run's lines go (by the controller, before any worker writes)."""
    if CPU_REPORT and not hasattr(session.config, "workerinput"):
        Path(CPU_REPORT).unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not CPU_REPORT:
        yield
        return
    import json
    import time

    (own0, waited0), t0 = _cpu_seconds(), time.monotonic()
    yield  # setup, call and teardown: a module fixture counts in the first test that uses it
    (own1, waited1), wall = _cpu_seconds(), time.monotonic() - t0
    with open(CPU_REPORT, "a") as f:  # one short line per write: the workers' lines do not interleave
        f.write(json.dumps({"test": item.nodeid, "own": round(own1 - own0, 2), "waited": round(waited1 - waited0, 2),
                            "wall": round(wall, 2)}) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not CPU_REPORT or hasattr(config, "workerinput") or not Path(CPU_REPORT).is_file():
        return
    import json

    rows = [json.loads(line) for line in Path(CPU_REPORT).read_text().splitlines() if line.strip()]
    total = sum(r["own"] + r["waited"] for r in rows)
    terminalreporter.section(f"CPU seconds per test ({CPU_REPORT})")
    terminalreporter.write_line(f"{len(rows)} tests, {total:.0f} CPU-s (own {sum(r['own'] for r in rows):.0f}, "
                                f"processes they waited for {sum(r['waited'] for r in rows):.0f}); the costliest:")
    for r in sorted(rows, key=lambda r: -(r["own"] + r["waited"]))[:25]:
        name = r["test"].replace("\n", " ")[:160]
        terminalreporter.write_line(f"{r['own'] + r['waited']:8.1f}  (own {r['own']:6.1f})  {name}")


@pytest.fixture(scope="session")
def sample_root(tmp_path_factory) -> Path:
    """A small DROID-format dataset (LeRobot v3.0, real mp4), several episodes per file."""
    return write_droid_sample(tmp_path_factory.mktemp("data") / "droid_sample", num_episodes=12, seed=1,
                              episodes_per_file=5)


@pytest.fixture(scope="session")
def sample_root_v21(tmp_path_factory) -> Path:
    """A second dataset in the LeRobot v2.1 layout (one parquet and one mp4 per episode)."""
    return write_droid_sample(tmp_path_factory.mktemp("data") / "droid_v21", num_episodes=6, seed=2, format="v2.1")


@pytest.fixture
def make_cfg(sample_root):
    """Compose the shipped config with test defaults, then apply ``overrides``."""

    def make(*overrides: str) -> Config:
        base = [f"data.root={sample_root}", "data.num_workers=0", "logging.wandb.mode=disabled",
                "trainer.progress_bar=false", "trainer.global_batch_size=8", "trainer.log_every_steps=5"]
        return compose([*base, *overrides])

    return make


@pytest.fixture(scope="session")
def trained_run(sample_root, tmp_path_factory) -> Path:
    """A run directory of the demo's configuration (experiment=demo: the tiny reference policy) cut to a
    few steps on the test data, with 3 held-out episodes, and its export (``run/policy.safetensors``)."""
    from slurmvla.export import export
    from slurmvla.trainer import Trainer

    run = tmp_path_factory.mktemp("trained") / "run"
    cfg = compose(["experiment=demo", f"data.root={sample_root}", "data.num_workers=0", "logging.wandb.mode=disabled",
                   "trainer.progress_bar=false", "trainer.global_batch_size=8", "trainer.max_steps=8",
                   "checkpoint.every_steps=8", "data.val_fraction=0.25",
                   "trainer.val_every_steps=0", "trainer.log_every_steps=4"])
    trainer = Trainer(cfg, run)
    trainer.fit()
    trainer.close()
    export(run, run / "policy.safetensors")
    return run


def policy_spec(cfg: Config, image_size: int | None = None, horizon: int | None = None,
                text_len: int | None = None) -> SampleSpec:
    """The configured policy's sample spec, with the image size, action horizon or text length a test needs."""
    changes = {k: v for k, v in (("image_size", image_size), ("action_horizon", horizon), ("max_text_len", text_len))
               if v is not None}
    return sample_spec(dataclasses.replace(cfg.policy, **changes))


REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_policy"


@pytest.fixture(scope="session")
def example_policy() -> str:
    """The example policy package, installed as a user would (pip install -e) when it is not yet;
    its import path for policy.target."""
    if importlib.util.find_spec("slurmvla_example_policy") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e",
                        str(EXAMPLE)], check=True)
        # An editable install is seen by new processes; this one finds it through its source folder.
        sys.path.insert(0, str(EXAMPLE))
    return "slurmvla_example_policy.MLPPolicy"


def run_until(cmd: list[str], timeout: int, what: str) -> tuple[int, str]:
    """``cmd`` from the repository in a session of its own (output merged), under a deadline: a hang
    SIGKILLs its whole process group and fails the test naming ``what``. Returns (exit code, log)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{what} did not finish within {timeout}s (a hang):\n{proc.communicate()[0][-4000:]}")
    return proc.returncode, log


def run_train(args: list[str], nproc: int = 0, timeout: int = 600) -> str:
    """``python -m slurmvla.train ARGS`` (or under torchrun with ``nproc`` ranks) from the repository,
    under a deadline (a hang fails the test); returns the log."""
    launcher = [sys.executable, "-m", "slurmvla.train"] if nproc == 0 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "slurmvla.train"]
    code, log = run_until([*launcher, *args], timeout, "training")
    assert code == 0, log[-4000:]
    return log


def run_entry_points(cases: list[tuple[str, list[str]]]) -> list[tuple[int | None, str, str]]:
    """(exit code, stdout, stderr) of each ``(module, args)``, run as ``python -m`` runs it (``runpy`` with
    ``alter_sys=True``), one after another in one interpreter: torch and Hydra load once, not once a case."""
    code = ("import contextlib, io, json, runpy, sys\nout = []\nfor m, args in json.loads(sys.argv[1]):\n"
            "    sys.argv, o, e, code = [m, *args], io.StringIO(), io.StringIO(), None\n"
            "    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):\n        try:\n"
            "            runpy.run_module(m, run_name='__main__', alter_sys=True)\n        except SystemExit as x:\n"
            "            code = x.code\n    out.append([code, o.getvalue(), e.getvalue()])\n"
            "print(json.dumps(out))\n")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [tuple(r) for r in json.loads(res.stdout.splitlines()[-1])]
    assert len(got) == len(cases), got
    return got


def rel_l2(a: dict, b: dict) -> float:
    """Relative L2 distance of state dict ``a`` from ``b`` over all tensors (the parity measure)."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in b) ** 0.5
    return float(num / sum((b[k].double() ** 2).sum() for k in b) ** 0.5)
