"""Policy folders from an installed distribution (slurmvla/registry.py: ``plugin_packages``, ``policy_folders``): the
Meta-World study (examples/metaworld_study, installed by scripts/test.sh as a user installs it) adds its policies
through the ``slurmvla.policies`` entry point and they are selected by name as the built-in ones are; without it,
selecting one is one line naming the package that provides it; a broken plug-in is an error naming its
distribution. The moved policies compose to the options the committed Meta-World runs were trained with."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurmvla.compose import compose
from slurmvla.registry import POLICIES, POLICY_PLUGINS, plugin_packages

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "metaworld_labelled_4000" / "hammer-v3_s0" / "config.resolved.yaml"
STUDY = ("keypoints_crop", "keypoints_flow_crop", "keypoints_flow_labelled", "keypoints_flow_aux", "keypoints_flow_pixel_aux")


def test_the_studys_policies_are_found_through_its_entry_point():
    study = pytest.importorskip("slurmvla_metaworld_study", reason="pip install -e examples/metaworld_study")
    assert study in plugin_packages(POLICY_PLUGINS)
    for name in STUDY:
        assert POLICIES.get(name).target.startswith("slurmvla_metaworld_study."), name
        assert POLICIES.elsewhere[name].startswith("the plug-in slurmvla-metaworld-study"), name
    assert POLICIES.get("keypoints_flow").target == "slurmvla.policy.keypoints.model:KeypointFlowPolicy"
    assert list(POLICIES)[-1] == "custom"
    # The table's recipe as its committed command composes it: every option the committed run was trained with
    # (policy.kwargs included), only the policy's name now its own rather than custom + target.
    cfg = compose(["experiment=metaworld", "policy=keypoints_flow_labelled", "policy.image_size=128",
                   "rollout.task=hammer-v3"])
    assert type(cfg.policy).__name__ == "KeypointsFlowLabelledConfig" and cfg.policy.target is None
    committed = yaml.safe_load(COMMITTED.read_text())["policy"]
    assert committed.pop("name") == "custom" and committed.pop("target").endswith(".LabelledKeypointFlowPolicy")
    composed = dataclasses.asdict(cfg.policy)
    composed.pop("name"), composed.pop("target")
    assert composed == committed


@pytest.mark.parametrize("overrides, kwargs", [
    (["experiment=sim_pick", "policy=keypoints"], {"spatial_norm": False, "encoder": "conv", "width": 64}),
    (["experiment=sim_pick", "policy=keypoints_flow", "policy.kwargs.spatial_norm=true", "+policy.kwargs.hidden=64"],
     {"spatial_norm": True, "encoder": "conv", "width": 64, "hidden": 64}),
])
def test_the_keypoint_policies_are_a_folder_whose_options_keep_their_meaning(overrides, kwargs):
    """policy=keypoints / keypoints_flow: no YAML, the schema's defaults; policy.kwargs.* set as before."""
    cfg = compose([*overrides, "data.root=/any/where"])
    name = overrides[1].split("=")[1]
    assert (cfg.policy.name, cfg.policy.size, cfg.policy.target, cfg.policy.kwargs) == (name, name, None, kwargs)
    assert (cfg.policy.num_cameras, cfg.policy.image_size, cfg.policy.num_inference_steps) == (2, 96, 10)


WITHOUT_PLUGINS = """
import importlib.metadata, runpy, sys
entry_points = importlib.metadata.entry_points
importlib.metadata.entry_points = lambda **kw: [] if kw.get("group") == "slurmvla.policies" else entry_points(**kw)
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("slurmvla.train", run_name="__main__")
"""


def test_without_the_plugin_its_policy_is_refused_naming_the_package():
    done = subprocess.run([sys.executable, "-c", WITHOUT_PLUGINS, "experiment=metaworld", "policy=keypoints_flow_labelled",
                           "policy.image_size=128"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if x.strip()]
    assert "policy=keypoints_flow_labelled is not an option of policy; choose one of [" in line and "'keypoints_flow'" in line
    assert line.endswith("keypoints_flow_labelled is provided by the plug-in slurmvla-metaworld-study "
                         "(pip install -e examples/metaworld_study)"), line


def test_a_broken_plugin_is_named_by_its_distribution(tmp_path, monkeypatch):
    info = tmp_path / "broken_policies-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-policies\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[slurmvla.tests.plugins]\nbroken = no_such_package_of_policies\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"the installed distribution broken-policies's entry point broken = "
                                         r"'no_such_package_of_policies' \(group 'slurmvla.tests.plugins'\) does not "
                                         r"import \(ModuleNotFoundError: .*\); reinstall it or pip uninstall broken-policies"):
        plugin_packages("slurmvla.tests.plugins")
    (info / "entry_points.txt").write_text("[slurmvla.tests.plugins]\nmodule = json.decoder\n")
    with pytest.raises(ValueError, match=r"names <module 'json.decoder'.*>, not a package"):
        plugin_packages("slurmvla.tests.plugins")
    (info / "entry_points.txt").write_text("[slurmvla.tests.plugins]\nfine = json\n")
    assert [p.__name__ for p in plugin_packages("slurmvla.tests.plugins")] == ["json"]
    assert plugin_packages("slurmvla.tests.no_such_group") == []


CALIBRATION = {"CAMERA", "CAMERA_ROTATION", "CAMERA_POSITION", "CAMERA_FOVY", "FINGERTIPS"}


def test_the_product_holds_no_policy_in_sim_and_reads_no_camera_calibration_outside_its_simulator():
    """A simulator's folder holds its environment, expert and data, no trainable policy (slurmvla/policy/ and the
    plug-ins do); Meta-World's camera calibration is read by nothing of slurmvla/ outside slurmvla/sim/metaworld/
    (the fingertip crop that projects through it is the study's, examples/metaworld_study)."""
    import ast

    package = REPO / "slurmvla"
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(REPO)
        inside_metaworld = path.is_relative_to(package / "sim" / "metaworld")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and path.is_relative_to(package / "sim"):
                bases = {ast.unparse(b) for b in node.bases}
                if bases & {"nn.Module", "torch.nn.Module", "Module", "Policy"}:
                    found.append(f"{where}: class {node.name}({', '.join(sorted(bases))}), a policy under sim/")
            if isinstance(node, ast.ImportFrom) and not inside_metaworld and (node.module or "").startswith(
                    "slurmvla.sim.metaworld"):
                names = {a.name for a in node.names} & CALIBRATION
                if names:
                    found.append(f"{where}: imports Meta-World's calibration {sorted(names)}")
    assert not found, "\n".join(found)
