"""A user's mistake, on every entry point: exactly one ``error: ...`` line on stderr naming the value (and the
file), a non-zero exit, no traceback.

Entry points run in this process (their ``main(argv)`` / ``cli()``) where they can; one runs as the user types
it (``python -m slurmvla.train`` failing mid-run in a data loader worker: inside Hydra's application, and the
process must exit). Damaged datasets are copies of the session's sample dataset.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slurmvla import check, evaluate, export, inspect, serve, train
from slurmvla.data import DataError, synthetic
from slurmvla.errors import Failure, boundary, exit_code
from slurmvla.launch import __main__ as launch
from slurmvla.launch.runlock import RunDirInUse
from tests.conftest import run_entry_points

REPO = Path(__file__).resolve().parents[1]
NO_DATA = ["logging.wandb.mode=disabled", "data.num_workers=0"]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def fails(capsys, call, *words: str, code: int | None = None) -> str:
    """``call()`` exits non-zero (SystemExit, or a returned code; ``code`` where given) with one error line
    holding ``words``."""
    capsys.readouterr()
    try:
        got = call()
    except SystemExit as e:
        got = e.code
    assert got not in (0, None) and code in (None, got), got
    line = one_error_line(capsys.readouterr().err)
    for word in words:
        assert word in line, line
    return line


@pytest.fixture
def restore_signals():
    """train.cli installs the preemption flag's signal handlers: give this process its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2,
                                              signal.SIGCONT, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        if handler is not None:
            signal.signal(sig, handler)


def run_module(monkeypatch, name: str, *args: str) -> None:
    """``python -m NAME ARGS`` in this process (its ``__main__`` block)."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    runpy.run_module(name, run_name="__main__", alter_sys=False)


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python -m ARGS``; one that does not exit in time (a data loader worker left behind) fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"python -m {' '.join(args)} did not exit within {timeout}s:\n{proc.communicate()[1][-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def damaged(sample_root, tmp_path):
    """A copy of the sample dataset to damage, without its checksums (as LeRobot's own datasets come): the damage is
    met where the file is read, not by slurmvla.data.checksums."""
    root = tmp_path / "damaged"
    shutil.copytree(sample_root, root, ignore=shutil.ignore_patterns("checksums.json"))
    return root


@pytest.mark.parametrize("error, code", [(ValueError("a bad value"), 2), (Failure("the disk is full"), 1),
                                         (DataError("a damaged file"), 1), (RunDirInUse("a run holds it"), 2)])
def test_one_exit_code_rule_the_class_decides(error, code, capsys):
    """errors.exit_code: a DataError (a ValueError and a Failure) exits 1 wherever it is met, start-up included."""
    with pytest.raises(SystemExit) as e, boundary():
        raise error
    assert e.value.code == exit_code(error) == code and one_error_line(capsys.readouterr().err) == f"error: {error}"


# -- the three mistakes users found ---------------------------------------------------------------


def test_a_bad_pretrained_path_is_named_before_the_model_is_built(make_cfg, tmp_path, monkeypatch):
    """The trainer checks policy.pretrained_path with the data, before it builds pi0.5 (billions of parameters
    at the published size) only to fail loading it."""
    import slurmvla.trainer
    from slurmvla.trainer import Trainer

    def never(*args, **kwargs):
        raise AssertionError("the policy was built before its pretrained path was checked")

    monkeypatch.setattr(slurmvla.trainer, "build_policy", never)
    for path, said in (("/no/such/dir", "policy.pretrained_path='/no/such/dir' does not exist"),
                       (str(tmp_path), f"policy.pretrained_path='{tmp_path}' holds no model.safetensors")):
        with pytest.raises(ValueError, match=re.escape(said)):
            Trainer(make_cfg("policy=pi05", f"policy.pretrained_path={path}"), tmp_path / "run")


def test_a_pretrained_path_that_does_not_exist_is_said_so(tmp_path):
    """``python -m slurmvla.train policy=pi05 policy.pretrained_path=/no/such/dir`` prints this ValueError (train
    prints every start-up ValueError as its one line: see the other train cases). pi05_tiny: the same code path
    at toy size (pi05 reads the path while it builds its layers)."""
    from slurmvla.compose import compose
    from slurmvla.policy import build_policy

    with pytest.raises(ValueError) as e:
        build_policy(compose(["policy=pi05_tiny", "policy.pretrained_path=/no/such/dir"]).policy)
    assert "policy.pretrained_path='/no/such/dir' does not exist" in str(e.value) and "tokenizer" not in str(e.value)
    # An existing directory that lacks the tokenizer: what is missing, and what is there.
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        build_policy(compose(["policy=pi05_tiny", f"policy.pretrained_path={tmp_path}"]).policy)
    assert "holds no tokenizer: none of ['tokenizer.json'" in str(e.value) and "(it has: model.safetensors)" in str(e.value)


def test_a_keep_ranges_file_that_is_not_json_names_the_file_and_the_layout(sample_root, tmp_path, capsys):
    garbage = tmp_path / "keep.txt"
    garbage.write_text("start,end\n0,10\n")
    fails(capsys, lambda: inspect.main([f"data.root={sample_root}", f"data.keep_ranges.path={garbage}", *NO_DATA]),
          str(garbage), "is not JSON", "keep-ranges layout", "[[start, end], ...]")


def test_a_plain_value_for_a_group_of_settings_says_which_key_was_meant(capsys, monkeypatch, restore_signals):
    monkeypatch.setattr(sys, "argv", ["train", "data.keep_ranges=/data/keep_ranges.json"])
    fails(capsys, train.cli, "data.keep_ranges is a group of settings (data.keep_ranges.path, ",
          "did you mean data.keep_ranges.path=/data/keep_ranges.json")


# -- python -m slurmvla.train: overrides ----------------------------------------------------------


@pytest.mark.parametrize("override, words", [
    ("trainer.max_steps=abc", ["trainer.max_steps='abc'", "an integer"]),
    ("engine=fsdp3", ["engine=fsdp3", "'fsdp_full'"]),
    ("experiment=demoo", ["experiment=demoo", "'demo'"]),  # Hydra skips an optional group's unknown option
    ("logging.wandb=offline", ["did you mean logging.wandb.mode=offline"]),
    ("engine=ddp,single", ["engine=ddp,single gives several values", "-m (--multirun)"]),
    ("--bogus-flag", ["unknown option '--bogus-flag'", "--multirun"]),
    ("policy.lora.parts=[arm]", ["policy.lora.parts='arm' is not valid", "'backbone', 'expert', 'vision'"]),
    ("policy.lora.rank=0", ["policy.lora.rank=0 is not valid", "> 0"]),
])
def test_train_override_mistakes(override, words, capsys, monkeypatch, restore_signals):
    monkeypatch.setattr(sys, "argv", ["train", override])
    fails(capsys, train.cli, *words)


def test_lora_adapters_on_a_backbone_that_must_not_train_are_one_line(capsys, monkeypatch, restore_signals):
    monkeypatch.setattr(sys, "argv", ["train", "policy=pi0_tiny", "policy.lora.enabled=true",
                                      "policy.train_expert_only=true"])
    fails(capsys, train.cli, "policy.train_expert_only=true", "policy.lora.parts=[expert]")


def test_a_missing_video_found_while_training_is_one_line(damaged, tmp_path):
    """Start-up opens no video: a missing one is found when first read, here in a data loader worker."""
    video = sorted((damaged / "videos").glob("*/chunk-000/file-000.mp4"))[0]
    video.unlink()
    res = cli("slurmvla.train", f"data.root={damaged}", "data.num_workers=1", "data.on_damaged=error",
              "logging.wandb.mode=disabled",
              "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.progress_bar=false",
              f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 1
    assert f"video {video} does not exist" in one_error_line(res.stderr)


# -- inspect, check: the same composition, other programs ---------------------------------------


def test_inspect_names_a_corrupted_metadata_file(damaged, capsys):
    meta = sorted((damaged / "meta" / "episodes").glob("**/*.parquet"))[0]
    meta.write_bytes(b"PAR1 not really")
    # A DataError met at start-up: exit 1, as mid-run (errors.exit_code).
    fails(capsys, lambda: inspect.main([f"data.root={damaged}", *NO_DATA]), str(meta), "cannot be read as parquet",
          code=1)


@pytest.mark.filterwarnings("ignore:'slurmvla.inspect' found in sys.modules")  # the old path runs it by name
def test_data_inspect_names_a_data_root_that_is_a_file(sample_root, capsys, monkeypatch):
    info = sample_root / "meta" / "info.json"
    fails(capsys, lambda: run_module(monkeypatch, "slurmvla.data.inspect", f"data.root={info}", *NO_DATA),
          f"data root {str(info)!r} does not exist or is not a directory")


def test_inspect_reads_a_dataset_with_an_episode_index_gap(damaged, capsys):
    """Episodes 0, 1, 3, ...: a gap is no mistake, nothing is lost around it."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    meta = next((damaged / "meta" / "episodes").glob("**/*.parquet"))
    table = pq.read_table(meta)
    pq.write_table(table.filter(pc.not_equal(table["episode_index"], 2)), meta)
    inspect.main([f"data.root={damaged}", *NO_DATA])
    summary = json.loads(capsys.readouterr().out)["datasets"]["droid_sample"]
    assert summary["episodes"] == summary["episodes_kept"] == 11


def test_inspect_names_a_keep_ranges_path_that_is_a_directory(sample_root, capsys):
    fails(capsys, lambda: inspect.main([f"data.root={sample_root}", f"data.keep_ranges.path={sample_root}", *NO_DATA]),
          f"data.keep_ranges.path={str(sample_root)!r} is a directory")


def test_check_names_a_wrong_type(capsys):
    fails(capsys, lambda: check.main(["trainer.max_steps=abc"]), "trainer.max_steps='abc'")


@pytest.mark.filterwarnings("ignore:'slurmvla.policy.check' found in sys.modules")  # imported by a test before
@pytest.mark.filterwarnings("ignore:'slurmvla.check' found in sys.modules")  # the old path runs it by name
def test_policy_check_names_an_unknown_engine(capsys, monkeypatch):
    fails(capsys, lambda: run_module(monkeypatch, "slurmvla.policy.check", "engine=fsdp3"), "engine=fsdp3", "'ddp'")


# -- export, evaluate, serve: a run directory or a checkpoint ---------------------------------------


def test_export_names_a_source_that_does_not_exist_or_is_no_checkpoint(sample_root, tmp_path, capsys):
    out = str(tmp_path / "policy.safetensors")
    fails(capsys, lambda: export.main([str(tmp_path / "nope"), out]), f"{str(tmp_path / 'nope')!r} does not exist")
    fails(capsys, lambda: export.main([str(sample_root), out]), "neither a checkpoint folder")
    fails(capsys, lambda: export.main([]), "the following arguments are required")


@pytest.fixture
def old_run(trained_run, tmp_path):
    """The trained run as another version would have written it: its config has a key this one removed."""
    run = tmp_path / "old_run"
    shutil.copytree(trained_run / "checkpoints", run / "checkpoints")
    config = (trained_run / "config.resolved.yaml").read_text()
    (run / "config.resolved.yaml").write_text(config.replace("\ntrainer:\n", "\ntrainer:\n  warmup_ratio: 0.1\n", 1))
    return run


def test_evaluate_and_serve_name_the_config_file_and_its_unknown_key(old_run, capsys):
    words = [str(old_run / "config.resolved.yaml"), "'trainer.warmup_ratio'", "another version"]
    fails(capsys, lambda: evaluate.main([str(old_run), "--plot-episodes", "0"]), *words)
    fails(capsys, lambda: serve.main([str(old_run), "--port", "0"]), *words)


def test_serve_names_a_group_given_one_value(trained_run, capsys):
    fails(capsys, lambda: serve.main([str(trained_run), "engine=fsdp3"]), "engine is a group of settings",
          "did you mean engine.name=fsdp3")


def test_an_fp8_prefix_for_a_policy_without_one_is_one_line(trained_run, capsys):
    """serve.fp8_prefix for the reference policy (no prefix_modules): the option and the reason, before anything is
    quantized or served (tests/inference/test_fp8.py: the CPU's refusal for pi0.5)."""
    fails(capsys, lambda: serve.main([str(trained_run), "--host", "127.0.0.1", "serve.fp8_prefix=true", "serve.device=cpu"]),
          "serve.fp8_prefix=true needs a policy with prefix_modules()")


def test_cuda_graphs_without_a_gpu_or_for_a_policy_without_them_are_one_line(trained_run, capsys):
    """serve.cuda_graph / evaluate --cuda-graph on the CPU, and for the reference policy (no
    prepare_inference): the option and the reason, before anything is served or read."""
    fails(capsys, lambda: serve.main([str(trained_run), "--host", "127.0.0.1", "serve.cuda_graph=true", "serve.device=cpu"]),
          "serve.cuda_graph=true replays CUDA graphs and needs the policy on a GPU (it is on cpu)")
    fails(capsys, lambda: evaluate.main([str(trained_run), "--cuda-graph", "--device", "cpu", "--plot-episodes", "0"]),
          "--cuda-graph replays CUDA graphs")
    from slurmvla.inference.graphs import check_graphable
    from slurmvla.inference.load import load_exported

    reference = load_exported(trained_run).policy  # the demo's policy: the reference flow-matching VLA
    with pytest.raises(ValueError, match=rf"needs a policy with prepare_inference.*{type(reference).__qualname__} has none"):
        check_graphable(reference, torch.device("cuda"), "serve.cuda_graph=true")


def test_evaluate_names_a_missing_video_read_in_a_worker(trained_run, damaged, capsys):
    video = sorted((damaged / "videos").glob("*/chunk-000/file-000.mp4"))[0]
    video.unlink()
    fails(capsys, lambda: evaluate.main([str(trained_run), "--split", "all", "--plot-episodes", "0",
                                         f"data.root={damaged}", "data.num_workers=1", "data.on_damaged=error"]),
          f"video {video} does not exist")


def test_evaluate_skips_a_damaged_data_file_and_says_so(trained_run, damaged, capsys):
    """Under data.on_damaged=skip (the default) evaluate reports the damaged episodes and leaves them out."""
    import pyarrow.parquet as pq

    data = sorted((damaged / "data").glob("**/*.parquet"))[0]
    held = sorted(set(pq.read_table(data, columns=["episode_index"])["episode_index"].to_pylist()))
    data.write_bytes(data.read_bytes()[:300])
    evaluate.main([str(trained_run), "--split", "all", "--plot-episodes", "0", "--out", str(damaged.parent / "eval"),
                   f"data.root={damaged}", "data.max_damaged_share=1"])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipped")]
    assert len(said) == 1 and said[0].startswith(f"skipped {len(held)} damaged episode(s)") and str(data) in said[0]
    metrics = json.loads((damaged.parent / "eval" / "metrics.json").read_text())
    episodes = pq.read_table(next((damaged / "meta" / "episodes").glob("**/*.parquet")), columns=["episode_index", "length"])
    lengths = dict(zip(episodes["episode_index"].to_pylist(), episodes["length"].to_pylist()))
    assert metrics["num_samples"] == sum(n for e, n in lengths.items() if e not in held)
    assert len(metrics["skipped_damaged"]) == len(held)


def test_evaluate_names_a_corrupted_data_file(trained_run, damaged, capsys):
    data = sorted((damaged / "data").glob("**/*.parquet"))[0]  # the first episodes': read first
    data.write_bytes(data.read_bytes()[:300])
    fails(capsys, lambda: evaluate.main([str(trained_run), "--split", "all", "--plot-episodes", "0",
                                         f"data.root={damaged}", "data.on_damaged=error"]), str(data),
          "cannot be read as parquet", code=1)


# -- the sample-data writer and the launch helpers --------------------------------------------------


def test_synthetic_names_an_output_that_is_a_file_and_a_bad_number(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(capsys, lambda: synthetic.main(["--out", str(tmp_path / "file")]), "is a file")
    fails(capsys, lambda: synthetic.main(["--out", str(tmp_path / "d"), "--episodes", "abc"]), "'abc'")


def test_launch_helpers_name_missing_arguments_and_bad_numbers(capsys, monkeypatch):
    fails(capsys, lambda: launch.main(["requeue"]), "requeue RUN_DIR EXIT_CODE")
    fails(capsys, lambda: launch.main(["requeue", "/run", "abc"]), "EXIT_CODE='abc'")
    fails(capsys, lambda: launch.main(["restart"]), "unknown command 'restart'")
    monkeypatch.setenv("SLURMVLA_MAX_RESTARTS", "three")
    fails(capsys, lambda: launch.main(["check-budget"]), "SLURMVLA_MAX_RESTARTS='three'")


# Every program that reads its command line with argparse (python -m slurmvla.X).
ARGPARSE_PROGRAMS = ("slurmvla.serve", "slurmvla.check", "slurmvla.rollout", "slurmvla.export", "slurmvla.sim.record",
                     "slurmvla.plan", "slurmvla.data.synthetic", "slurmvla.evaluate", "slurmvla.profile", "slurmvla.table",
                     "slurmvla.eval_array")


def test_the_argparse_programs_are_all_listed():
    found = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
             for p in (REPO / "slurmvla").rglob("*.py") if "ArgumentParser(" in p.read_text() and p.name != "cli.py"}
    assert found == set(ARGPARSE_PROGRAMS)


def test_help_names_every_program_as_it_is_run():
    """--help's usage line is a command that runs (python -m slurmvla.X), not the file's name (X.py). The programs
    run one after another in one interpreter (torch loads once, not once a program), each as ``python -m`` runs
    it: ``runpy.run_module(alter_sys=True)`` puts the module's file in sys.argv[0], as ``-m`` does."""
    got = dict(zip(ARGPARSE_PROGRAMS, ([code, out] for code, out, _ in
                                       run_entry_points([(m, ["--help"]) for m in ARGPARSE_PROGRAMS]))))
    wrong = {m: (code, text[:200]) for m, (code, text) in got.items()
             if code not in (0, None) or not text.startswith(f"usage: python -m {m} [-h]")}
    assert not wrong, wrong


def test_usage_mistakes_are_one_line_on_every_entry_point(capsys):
    """argparse's own usage errors (a bad flag value, an unknown flag) are one ``error:`` line too."""
    from slurmvla import profile, rollout
    from slurmvla.sim import record

    fails(capsys, lambda: serve.main(["run", "--port", "x"]), "--port: invalid int value: 'x'")
    fails(capsys, lambda: profile.main(["--bogus"]), "unrecognized arguments: --bogus")
    fails(capsys, lambda: rollout.main(["run", "--shard", "1/2", "--bogus"]), "--bogus")
    fails(capsys, lambda: record.main(["--out", "x", "--episodes", "many"]), "'many'")
