"""Runs survive an upgrade (slurmvla/formats.py): a checkpoint, an exported policy and a run directory written by an
earlier release load with this one, and one written by a newer release is refused in one line naming the file, its
format and the formats this release reads.

The earlier release's files are tests/golden/old_release/, written by that release's own code (commit 3059457, the
last before the policy move; tests/reference/make_old_release.py): a tiny keypoint-policy run checkpointed at step 3
of 6, the weights of the same run trained to step 6 without a stop, that run exported, and the chunk that release's
server answered to one request. Its run directory and exported file record no format (version 1) and name the
policy at its home before the move (``policy.target: slurmvla.sim.policies.KeypointPolicy``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slurmvla.checkpoint import META_FILE, CheckpointManager, list_checkpoints, read_meta, resolve_checkpoint
from slurmvla.data.synthetic import write_droid_sample
from slurmvla.export import export
from slurmvla.formats import (
    CHECKPOINT,
    EXPORT,
    EXPORT_KEY,
    MOVED_MODULES,
    RUN_DIR,
    RUN_FILE,
    FormatError,
    moved_target,
    run_dir_version,
    saved_config,
)
from slurmvla.inference.load import CONFIG_FILE, load_exported, read_config, run_config
from slurmvla.trainer import Trainer
from tests.conftest import run_entry_points

REPO = Path(__file__).resolve().parents[1]
OLD = REPO / "tests" / "golden" / "old_release"
RECORD = json.loads((OLD / "old_release.json").read_text())
STEPS, CHECKPOINTED = RECORD["steps"], RECORD["checkpointed_step"]
NEW_KEYPOINTS = "slurmvla.policy.keypoints.model.KeypointPolicy"
# Bitwise on the CPU kind and torch the fixture was written with (the numerics did not change: the same fp32
# operations in the same order). Elsewhere torch picks other kernels (another vector width, another oneDNN
# convolution) whose sums round differently, by a few ulp per operation: three Adam steps and one forward keep
# that far below these bounds.
SAME_MACHINE = (torch.__version__, torch.backends.cpu.get_cpu_capability()) == (RECORD["torch"],
                                                                                  RECORD["cpu_capability"])
RTOL, ATOL = 1e-5, 1e-6


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if SAME_MACHINE:
        assert torch.equal(got, want), f"{what}: not bitwise ({(got - want).abs().max():.3g})"
    else:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=what)


@pytest.fixture(scope="module")
def old_data(tmp_path_factory) -> Path:
    """The sample data the old run trained on: today's writer writes the same bytes from the same arguments."""
    return write_droid_sample(tmp_path_factory.mktemp("old_release") / "data", **RECORD["data"])


def old_run(tmp_path: Path) -> Path:
    return Path(shutil.copytree(OLD / "run", tmp_path / "run"))


def test_an_old_releases_checkpoint_resumes_to_the_weights_of_its_uninterrupted_run(old_data, tmp_path):
    """Resumed by today's trainer from the old release's step-3 checkpoint, with the old run's own saved config
    (migrated: the policy's new home), the run ends at step 6 with the weights the old release's uninterrupted run
    ended with; the run directory is then in today's formats, and exports and loads as one."""
    run = old_run(tmp_path)
    assert run_dir_version(run) == 1 and read_meta(run / "checkpoints" / f"step_{CHECKPOINTED:08d}")["format"] == 2
    cfg = read_config(run_config(run), [f"data.root={old_data}"], str(run / CONFIG_FILE))
    assert (cfg.policy.name, cfg.policy.target) == ("custom", NEW_KEYPOINTS)
    trainer = Trainer(cfg, run)
    try:
        trainer.fit()
    finally:
        trainer.close()
    assert trainer.resumed_from.name == f"step_{CHECKPOINTED:08d}" and trainer.step == STEPS
    final = list_checkpoints(run / "checkpoints")[-1]
    assert final.name == f"step_{STEPS:08d}"
    got, want = load_file(str(final / "model.safetensors")), load_file(str(OLD / f"uninterrupted_step_{STEPS:08d}.safetensors"))
    assert got.keys() == want.keys()
    for k in want:
        assert_same(got[k], want[k], k)
    # Written by this release: the run directory, its config and its checkpoint record today's formats.
    assert json.loads((run / RUN_FILE).read_text())["format"] == RUN_DIR.current
    assert f"target: {NEW_KEYPOINTS}" in (run / CONFIG_FILE).read_text()
    assert json.loads((final / META_FILE).read_text())["format"] == CHECKPOINT.current
    assert load_exported(export(run, tmp_path / "policy.safetensors")).cfg.policy.target == NEW_KEYPOINTS


def test_an_old_releases_exported_policy_is_served_by_todays_server():
    """The old release's exported file (format 1, the policy at its old home) served by today's server answers the
    recorded request with the chunk the old release's own server gave."""
    from websockets.sync.client import connect

    from slurmvla.inference.build import build_server
    from slurmvla.inference.harness import serving_in_thread
    from slurmvla.inference.wire import unpackb

    policy = OLD / "policy.safetensors"
    with safe_open(str(policy), "pt") as f:
        assert EXPORT_KEY not in f.metadata()  # written before formats were recorded
    exported = load_file(str(policy))
    uninterrupted = load_file(str(OLD / f"uninterrupted_step_{STEPS:08d}.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in uninterrupted.items())
    server = build_server(str(policy), ["serve.host=127.0.0.1", "serve.port=0"], device="cpu", environ={})
    with serving_in_thread(server) as port, connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        metadata = unpackb(ws.recv())
        ws.send((OLD / "request.msgpack").read_bytes())
        reply = unpackb(ws.recv())
    assert metadata["step"] == STEPS
    got, want = np.array(reply["actions"]), np.array(RECORD["actions"], dtype=np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert_same(torch.from_numpy(got), torch.from_numpy(want), "the served chunk")


@pytest.mark.parametrize("recorded", ["absent", 1, 2])
def test_every_checkpoint_format_this_release_reads_loads(recorded, tmp_path):
    """Format 1 (no checksums) and a meta.json that records no format (version 1) load as format 2 does."""
    run = old_run(tmp_path)
    checkpoint = run / "checkpoints" / f"step_{CHECKPOINTED:08d}"
    meta = json.loads((checkpoint / META_FILE).read_text())
    if recorded != 2:
        meta.pop("files")
        meta.pop("format") if recorded == "absent" else meta.update(format=recorded)
    (checkpoint / META_FILE).write_text(json.dumps(meta))
    assert resolve_checkpoint(run) == checkpoint
    loaded = load_exported(run)
    assert loaded.step == CHECKPOINTED and loaded.cfg.policy.target == NEW_KEYPOINTS
    # Exported by this release: today's format, the config in today's form (the old run directory's migrated).
    out = export(run, tmp_path / "policy.safetensors")
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    assert metadata[EXPORT_KEY] == str(EXPORT.current) and f"target: {NEW_KEYPOINTS}" in metadata["config_yaml"]
    assert all(torch.equal(v, loaded.policy.state_dict()[k]) for k, v in load_file(str(out)).items())


def _claim(tmp_path: Path, what: str, version) -> Path:  # noqa: ANN001
    """A copy of the old release's files with ``what`` claiming format ``version``; the path a program is given."""
    if what == "exported policy":
        with safe_open(str(OLD / "policy.safetensors"), "pt") as f:
            metadata = f.metadata()
        out = tmp_path / "policy.safetensors"
        tmp_path.mkdir(parents=True, exist_ok=True)
        save_file(load_file(str(OLD / "policy.safetensors")), str(out), metadata={**metadata, EXPORT_KEY: str(version)})
        return out
    run = old_run(tmp_path)
    if what == "checkpoint":
        meta_path = run / "checkpoints" / f"step_{CHECKPOINTED:08d}" / META_FILE
        meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "format": version}))
        return run
    assert what == "run directory", what
    (run / RUN_FILE).write_text(json.dumps({"format": version}))
    return run


NEWER = {"checkpoint": CHECKPOINT.current + 1, "run directory": RUN_DIR.current + 1, "exported policy": EXPORT.current + 1}


def test_a_newer_or_unknown_format_is_refused_in_one_line_naming_both_versions(tmp_path, old_data):
    """Through each program that reads it (export, serve, train): one error line, exit 2, no traceback, naming the
    file, the version it records and the versions this release reads; a newer checkpoint is never taken for a
    damaged one (moved aside, an older one resumed)."""
    cases, expected = [], []
    train = [f"data.root={old_data}", *RECORD["overrides"]]  # the old run's command, today's policy=keypoints
    for i, (what, version, recorded_in) in enumerate([
            ("checkpoint", NEWER["checkpoint"], META_FILE), ("run directory", NEWER["run directory"], RUN_FILE),
            ("exported policy", NEWER["exported policy"], "policy.safetensors"), ("exported policy", "v9", "policy.safetensors"),
            ("checkpoint", "next", META_FILE)]):
        source = _claim(tmp_path / str(i), what, version)
        if what == "exported policy":
            cases.append(("slurmvla.serve", [str(source), "--host", "127.0.0.1", "--port", "0"]))
        else:
            cases.append(("slurmvla.export", [str(source), str(tmp_path / str(i) / "out.safetensors")]))
        expected.append((what, version, recorded_in, source))
    for what in ("checkpoint", "run directory"):  # resuming the run
        source = _claim(tmp_path / what.replace(" ", "_"), what, NEWER[what])
        cases.append(("slurmvla.train", [*train, f"hydra.run.dir={source}"]))
        expected.append((what, NEWER[what], META_FILE if what == "checkpoint" else RUN_FILE, source))
    fmt = {"checkpoint": CHECKPOINT, "run directory": RUN_DIR, "exported policy": EXPORT}
    for (code, _, err), (what, version, recorded_in, source) in zip(run_entry_points(cases), expected, strict=True):
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        line = lines[0]
        assert line.startswith("error: ") and recorded_in in line and str(source) in line, line
        assert f"{what} format {version if isinstance(version, int) else repr(version)}" in line, line
        assert f"reads {what} formats 1 to {fmt[what].current}" in line, line
        if isinstance(version, int):
            assert "is newer than this release of slurmvla" in line and "upgrade slurmvla" in line, line
        if what == "checkpoint":  # refused, not moved aside as corrupted
            assert (source / "checkpoints" / f"step_{CHECKPOINTED:08d}" / META_FILE).is_file()
            assert not list((source / "checkpoints").glob(".*corrupt*"))
    assert not list(tmp_path.rglob("out.safetensors"))


def test_a_newer_checkpoint_stops_a_resume_on_every_rank_rather_than_being_skipped(tmp_path):
    """The manager's search for the newest intact checkpoint refuses it (a FormatError) instead of moving it aside."""
    run = _claim(tmp_path, "checkpoint", NEWER["checkpoint"])
    manager = CheckpointManager(run, keep=2, engine=None, state=None, rank_state=None)
    with pytest.raises(FormatError, match=rf"checkpoint format {NEWER['checkpoint']} is newer"):
        manager.latest_intact()
    assert manager.latest().name == f"step_{CHECKPOINTED:08d}"


# -- the policy move ---------------------------------------------------------------------------------------------

OLD_TARGETS = {
    "slurmvla.sim.policies.KeypointPolicy": NEW_KEYPOINTS,
    "slurmvla.sim.policies.KeypointFlowPolicy": "slurmvla.policy.keypoints.model.KeypointFlowPolicy",
    "slurmvla.sim.policies:MeanChunkPolicy": "slurmvla.policy.baselines:MeanChunkPolicy",
    "slurmvla.sim.policies.ZeroPolicy": "slurmvla.policy.baselines.ZeroPolicy",
    "slurmvla.sim.policies.ReplayPolicy": "slurmvla.policy.baselines.ReplayPolicy",
    "slurmvla.sim.hand_crop.HandCropFlowPolicy": "slurmvla_metaworld_study.hand_crop.model.HandCropFlowPolicy",
    "slurmvla.sim.hand_crop.HandCropPolicy": "slurmvla_metaworld_study.hand_crop.model.HandCropPolicy",
    "slurmvla.sim.labelled_keypoints.LabelledKeypointFlowPolicy":
        "slurmvla_metaworld_study.labelled_keypoints.model.LabelledKeypointFlowPolicy",
}


def test_every_moved_policy_class_is_found_at_its_new_home():
    from slurmvla.policy.base import import_class

    assert {t.rpartition(":" if ":" in t else ".")[0] for t in OLD_TARGETS} == set(MOVED_MODULES)
    for old, new in OLD_TARGETS.items():
        assert moved_target(old) == new, old
        if new.startswith("slurmvla_metaworld_study") and not importlib_util_find("slurmvla_metaworld_study"):
            continue  # the study's plug-in is not installed here (pip install -e examples/metaworld_study)
        assert isinstance(import_class(new), type), new
    assert moved_target(NEW_KEYPOINTS) is None and moved_target("my_package.MyPolicy") is None
    # Given on a command line (an old run's own command), the old home is refused naming the new one.
    with pytest.raises(ValueError, match=rf"policy.target='slurmvla.sim.policies.KeypointPolicy': this class moved; "
                                         rf"it is '{NEW_KEYPOINTS}' in this release"):
        import_class("slurmvla.sim.policies.KeypointPolicy")


def importlib_util_find(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_a_committed_run_of_the_old_release_reads_with_its_policy_at_the_plugins_home():
    """The Meta-World table's committed run, as the old release wrote it (``policy.name: custom``, ``policy.target:
    slurmvla.sim.labelled_keypoints.LabelledKeypointFlowPolicy``): migrated on load, every other option as saved."""
    run = REPO / "benchmarks" / "results" / "metaworld_labelled_4000" / "hammer-v3_s0"
    saved = (run / CONFIG_FILE).read_text()
    assert "target: slurmvla.sim.labelled_keypoints.LabelledKeypointFlowPolicy" in saved and run_dir_version(run) == 1
    cfg = read_config(run_config(run), [], str(run / CONFIG_FILE))
    old = read_config(saved, [], "as saved")
    assert cfg.policy.target == "slurmvla_metaworld_study.labelled_keypoints.model.LabelledKeypointFlowPolicy"
    assert cfg.policy.name == "custom" and {**vars(cfg.policy), "target": None} == {**vars(old.policy), "target": None}
    assert cfg.policy.kwargs == old.policy.kwargs and cfg.data == old.data and cfg.trainer == old.trainer
    if importlib_util_find("slurmvla_metaworld_study"):
        from slurmvla.policy import policy_class

        assert policy_class(cfg.policy).__name__ == "LabelledKeypointFlowPolicy"
    # A config already in today's form is read as it is.
    assert saved_config(run_config(run), RUN_DIR, RUN_DIR.current, "x") == run_config(run)


@pytest.mark.parametrize("fmt", [CHECKPOINT, EXPORT, RUN_DIR])
def test_versions_recorded_and_refused(fmt):
    assert fmt.version(None, "f") == 1 and fmt.version(fmt.current, "f") == fmt.current
    assert fmt.version(str(fmt.current), "f") == fmt.current  # safetensors metadata holds strings
    for bad in (fmt.current + 1, 0, -1, True, 1.5, "2b", [2]):
        with pytest.raises(FormatError, match=rf"^f: {fmt.what} format .* reads {fmt.what} formats 1 to {fmt.current}"):
            fmt.version(bad, "f")
