"""Every shipped config composes; bad input fails at start-up naming the value and the choices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ValidationError

from slurmvla.compose import compose, config_dir
from slurmvla.data.source import LeRobotSource, dataset_specs
from slurmvla.trainer import Trainer
from tests.conftest import policy_spec

REPO = Path(__file__).resolve().parents[1]

GROUPS = sorted(p.name for p in config_dir().iterdir() if p.is_dir() and not p.name.startswith("_"))


def test_groups_named_by_the_contract_exist():
    for group in ("engine", "policy", "data", "optim", "scheduler", "trainer", "checkpoint", "logging", "experiment"):
        assert group in GROUPS


@pytest.mark.parametrize("option", [f"{g}={p.stem}" for g in GROUPS for p in sorted((config_dir() / g).glob("*.yaml"))])
def test_every_shipped_option_composes_and_validates(option):
    # An option with a required value gets one (policy=custom names a class; nothing is imported here).
    # experiment=pi05_droid normalizes with the statistics saved beside the weights it starts from.
    required = {"policy=custom": ["policy.target=my_pkg.policies.MyPolicy"],
                "experiment=pi05_droid": ["policy.pretrained_path=/any/pi05_droid"]}.get(option, [])
    cfg = compose([option, "data.root=/any/where", *required])
    group, name = option.split("=")
    if group not in ("experiment", "trainer", "checkpoint", "logging", "optim"):
        section = getattr(cfg, group)
        assert getattr(section, "size", None) == name or getattr(section, "name", None) == name


def test_the_contract_keys_exist():
    cfg = compose([])
    assert cfg.trainer.max_steps > 0 and cfg.trainer.global_batch_size > 0
    assert cfg.precision == "fp32" and cfg.engine.name == "single" and cfg.policy.size == "tiny"
    assert cfg.logging.wandb.mode == "offline"
    assert cfg.data.root is None and cfg.checkpoint.keep >= 1


def hydra_compose(overrides: list[str]):
    """Hydra alone, without slurmvla's key check: the schema itself must catch what the check would."""
    from hydra import compose as _compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return _compose(config_name="config", overrides=overrides)


def test_unknown_group_option_names_the_choices():
    with pytest.raises(MissingConfigException) as e:
        hydra_compose(["engine=fsdp_typo"])
    assert "fsdp_typo" in str(e.value) and "single" in str(e.value)


def test_misspelled_key_is_named():
    with pytest.raises(ConfigCompositionException) as e:
        hydra_compose(["trainer.max_stpes=3"])
    assert "max_stpes" in str(e.value.__cause__ or e.value)


def test_wrong_type_is_named():
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        hydra_compose(["trainer.max_steps=many"])
    assert "max_steps" in str(e.value.__cause__ or e.value)


@pytest.mark.parametrize("override, words", [
    ("precision=fp16", ["precision='fp16'", "fp32", "bf16"]),
    ("policy.attention_implementation=xformers", ["xformers", "sdpa", "eager"]),
    ("scheduler.name=linear", ["linear", "cosine", "frozen_backbone"]),
    ("logging.wandb.mode=cloud", ["cloud", "offline", "disabled"]),
    ("trainer.device=tpu", ["tpu", "auto", "cpu"]),
    ("policy.image_size=60", ["image_size=60", "patch_size=16"]),
])
def test_invalid_values_raise_value_error_with_choices(override, words):
    with pytest.raises(ValueError) as e:
        compose([override])
    for w in words:
        assert w in str(e.value)


def test_global_batch_not_divisible(make_cfg, tmp_path):
    cfg = make_cfg("trainer.global_batch_size=9", "trainer.grad_accum_steps=2")
    with pytest.raises(ValueError, match=r"global_batch_size=9 .*grad_accum_steps=2 = 2; choose a multiple of 2"):
        Trainer(cfg, tmp_path)


def test_data_root_not_lerobot(make_cfg, tmp_path):
    cfg = make_cfg(f"data.root={tmp_path}")
    with pytest.raises(ValueError, match="is not a LeRobot dataset"):
        LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 64, 8, 24), 0)
    cfg = make_cfg(f"data.root={tmp_path / 'nope'}")
    with pytest.raises(ValueError, match="does not exist"):
        LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 64, 8, 24), 0)


def _source(cfg):
    return LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 64, 8, 24), 0)


def _copy_with_info(sample_root, tmp_path, edit):
    root = tmp_path / "copy"
    shutil.copytree(sample_root, root, ignore=shutil.ignore_patterns("checksums.json"))  # edited on purpose
    info = json.loads((root / "meta" / "info.json").read_text())
    edit(info)
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return root


def test_missing_feature_is_named_with_what_the_dataset_has(make_cfg, sample_root, tmp_path):
    root = _copy_with_info(sample_root, tmp_path, lambda info: info["features"].pop("observation.images.wrist_left"))
    cfg = make_cfg(f"data.root={root}")
    with pytest.raises(ValueError) as e:
        LeRobotSource(dataset_specs(cfg.data)[0], cfg.data, policy_spec(cfg, 64, 8, 24), 0)
    msg = str(e.value)
    assert "'observation.images.wrist_left'" in msg and "observation.images.exterior_1_left" in msg


def test_unsupported_version(make_cfg, sample_root, tmp_path):
    root = _copy_with_info(sample_root, tmp_path, lambda info: info.update(codebase_version="v1.6"))
    with pytest.raises(ValueError, match=r"'v1.6' is not supported; supported: \['v2.1', 'v3.0'\]"):
        _source(make_cfg(f"data.root={root}"))


def test_policy_shape_must_match_data(make_cfg, tmp_path):
    cfg = make_cfg("policy.state_dim=7")
    with pytest.raises(ValueError, match=r"policy.state_dim=7 does not match .*observation.state.*=8"):
        Trainer(cfg, tmp_path)


def test_misspelled_key_lists_the_valid_keys_there():
    from slurmvla.compose import check_override_keys

    with pytest.raises(ValueError) as e:
        check_override_keys(["engine=hsdp", "engine.replicat_degree=2"], GROUPS)
    assert "'engine.replicat_degree'" in str(e.value) and "'replicate_degree'" in str(e.value)
    with pytest.raises(ValueError, match=r"data.keep_ranges has no 'pth'.*'path'"):
        check_override_keys(["data.keep_ranges.pth=x"], GROUPS)
    with pytest.raises(ValueError, match=r"the top level has no 'precison'.*'precision'"):
        check_override_keys(["precison=bf16"], GROUPS)
    check_override_keys(["experiment=demo", "+extra.key=1", "hydra.run.dir=x", "trainer.seed=0,1",
                         "data.keep_ranges.path=x", "optim.betas=[0.9,0.99]"], GROUPS)


@pytest.mark.parametrize("override, meant", [
    ("trainer.max_step=3", "did you mean trainer.max_steps?"),
    ("precison=bf16", "did you mean precision?"),
    ("data.keep_ranges.pth=x", "did you mean data.keep_ranges.path?"),
    ("policy.num_inference_step=5", "did you mean policy.num_inference_steps?"),
])
def test_a_misspelled_key_names_the_key_meant(override, meant):
    with pytest.raises(ValueError) as e:
        compose([override])
    assert meant in str(e.value), e.value


def test_a_key_like_none_there_suggests_nothing():
    from slurmvla.compose import check_override_keys

    with pytest.raises(ValueError) as e:
        check_override_keys(["trainer.zzzz=1"], GROUPS)
    assert "did you mean" not in str(e.value) and "valid keys there: [" in str(e.value)


def test_cli_rejects_a_misspelled_key_with_the_valid_ones(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "slurmvla.train", "engine=hsdp", "engine.shard_degre=2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "'shard_degree'" in res.stderr and not (tmp_path / "outputs").exists()
    assert "did you mean engine.shard_degree?" in res.stderr, res.stderr


# A stand-in for the trainer (no torch, no run) and a counter of Hydra's compositions, in a fresh process. submitit's
# executor is replaced by one that calls each job here, after the pickle round trip submitit makes ("job" marks the
# start of one: what follows it happens in the job's own process on a cluster).
COUNT_COMPOSITIONS = """
import json, os, sys, types
import cloudpickle, submitit
from hydra._internal.config_loader_impl import ConfigLoaderImpl

modes, seen = [], {}
load = ConfigLoaderImpl.load_configuration


def counting(self, *args, **kwargs):
    modes.append(str(kwargs["run_mode"]).split(".")[-1])
    return load(self, *args, **kwargs)


class Trainer:
    stopped_for_requeue = False

    def __init__(self, cfg, out, closed_loop=None):
        seen.setdefault("steps", []).append(cfg.policy.num_inference_steps)
        seen["full_error"] = os.environ.get("HYDRA_FULL_ERROR")

    def fit(self):
        return {}

    def close(self, failed=False):
        pass


class Executor:
    def __init__(self, **kwargs):
        pass

    def update_parameters(self, **kwargs):
        pass

    def map_array(self, fn, *iterables):
        jobs = []
        for args in zip(*iterables):
            modes.append("job")
            result = cloudpickle.loads(cloudpickle.dumps(fn))(*args)
            jobs.append(types.SimpleNamespace(results=lambda result=result: [result]))
        return jobs


ConfigLoaderImpl.load_configuration = counting
submitit.AutoExecutor = Executor
submitit.JobEnvironment = lambda: types.SimpleNamespace(job_id="1")
sys.modules["slurmvla.trainer"] = types.ModuleType("slurmvla.trainer")
sys.modules["slurmvla.trainer"].Trainer = Trainer
from slurmvla import train

for args in json.loads(sys.argv[1]):
    modes.clear()
    seen.clear()
    sys.argv = ["train", *args]
    train.cli()
    print("COUNTED", json.dumps({"modes": modes, **seen}), flush=True)
"""


def test_every_start_up_composes_once(tmp_path):
    """What ``python -m slurmvla.train ...`` composes before it trains, counted, for each flag a user passes: once.
    Overrides alone (a ``policy.*`` one too), ``--cfg job``, ``--help`` and ``--dry-run`` (``-m`` with it too)
    compose once; ``-m`` composes the sweep once and each job's config once in the process that runs it: a local
    sweep's jobs here (the composition Hydra's sweeper makes of each job before launching any, which the basic
    launcher takes), a submitit sweep's in each job's process (the submitting process composes them too, Hydra's
    check that every job composes before any is submitted). A config asking for a multirun itself (``hydra.mode``)
    composes its sweep as a run's. ``@hydra.main`` composes a run twice, a multirun three times before its jobs
    (Hydra 1.3 reads ``hydra.mode`` with a silent composition of its own). A change to start-up shows here first."""
    runs = [[f"hydra.run.dir={tmp_path / 'a'}"], [f"hydra.run.dir={tmp_path / 'b'}", "policy.num_inference_steps=4"],
            ["--cfg", "job"], ["--cfg", "job", "policy.num_inference_steps=4"], ["--help"],
            ["--dry-run"], ["--dry-run", "-m", "hydra/launcher=submitit_slurm", "engine=ddp"],
            ["-m", f"hydra.sweep.dir={tmp_path / 'm'}", "policy.num_inference_steps=2,3"],
            ["-m", "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={tmp_path / 's'}", "policy.num_inference_steps=2,3"],
            ["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path / 'c'}", "policy.num_inference_steps=5"]]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    res = subprocess.run([sys.executable, "-c", COUNT_COMPOSITIONS, json.dumps(runs)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    counted = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines() if line.startswith("COUNTED ")]
    run, sweep = ["RUN"], ["MULTIRUN"]
    assert counted == [{"modes": run, "steps": [10], "full_error": None},
                       {"modes": run, "steps": [4], "full_error": None},
                       {"modes": run}, {"modes": run}, {"modes": run},
                       {"modes": run}, {"modes": sweep},
                       {"modes": sweep + run + run, "steps": [2, 3], "full_error": None},
                       {"modes": sweep + run + run + ["job"] + run + ["job"] + run, "steps": [2, 3], "full_error": None},
                       {"modes": run + run, "steps": [5], "full_error": None}], res.stdout[-3000:]
    assert "== Configuration groups ==" in res.stdout and "submitit.core._submit" in res.stdout
    # Hydra's run as @hydra.main makes it: the run directory, its .hydra/ record and the job's log file; a sweep's
    # jobs each in theirs, under the sweep's directory.
    for run_dir in ("a", "b", "m/0", "m/1", "s/0", "s/1", "c/0"):
        assert {p.name for p in (tmp_path / run_dir / ".hydra").iterdir()} == {"config.yaml", "hydra.yaml", "overrides.yaml"}
        assert (tmp_path / run_dir / "train.log").is_file()
    assert "policy.num_inference_steps=4" in (tmp_path / "b" / ".hydra" / "overrides.yaml").read_text()
    assert "policy.num_inference_steps=3" in (tmp_path / "s" / "1" / ".hydra" / "overrides.yaml").read_text()
    assert "mode: MULTIRUN" in (tmp_path / "m" / "1" / ".hydra" / "hydra.yaml").read_text()


def test_experiment_overlays_override_the_primary_config():
    demo = compose(["experiment=demo"])
    assert demo.name == "demo" and demo.trainer.max_steps == 1500
    droid = compose(["experiment=droid", "data.root=/data/droid"])
    assert (droid.name, droid.precision, droid.engine.name, droid.policy.size) == ("droid", "bf16", "hsdp", "base")
    # and the command line overrides the overlay
    assert compose(["experiment=droid", "data.root=/d", "precision=fp32"]).precision == "fp32"


# -- one schema per policy ------------------------------------------------------------------------

@pytest.mark.parametrize("option, schema", [("tiny", "FlowVLAConfig"), ("base", "FlowVLAConfig"), ("pi0_tiny", "Pi0Config"),
                                            ("pi05", "Pi05Config"), ("custom", "PolicyConfig")])
def test_each_policy_option_composes_into_its_own_schema(option, schema):
    extra = ["policy.target=my_pkg.MyPolicy"] if option == "custom" else []
    cfg = compose([f"policy={option}", *extra])
    assert type(cfg.policy).__name__ == schema
    # A saved config (what export, serve and evaluate rebuild from) comes back as the same schema.
    from omegaconf import OmegaConf

    from slurmvla.compose import to_config
    assert type(to_config(OmegaConf.create(OmegaConf.to_yaml(OmegaConf.structured(cfg)))).policy).__name__ == schema


@pytest.mark.parametrize("overrides, message", [
    (["policy=pi0_tiny", "policy.mlp_ratio=4"], "policy.name=pi0 has no option 'mlp_ratio' (an option of policy.name=flow_vla)"),
    (["policy.state_input=discrete"], "policy.name=flow_vla has no option 'state_input' (an option of policy.name=pi05)"),
    (["policy=pi0", "policy.state_input=continuous"], "policy.name=pi0 has no option 'state_input'"),
    (["policy=tiny", "policy.pretrained_path=/w"], "policy.name=flow_vla has no option 'pretrained_path'"),
    (["policy=custom", "policy.target=a.B", "policy.hidden=3"], "a plug-in's own options go in policy.kwargs"),
    # A config file that sets an option its policy lacks is said the same way.
    (["experiment=pi05_droid", "policy=tiny", "data.root=/d"], "policy.name=flow_vla has no option 'state_input'"),
])
def test_an_option_the_policy_does_not_have_is_one_line_naming_the_policy_and_its_options(overrides, message, tmp_path):
    with pytest.raises(ValueError) as e:
        compose(overrides)
    assert message in str(e.value) and "its options: [" in str(e.value)
    res = subprocess.run([sys.executable, "-m", "slurmvla.train", *overrides, f"hydra.run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode != 0 and message in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


def test_a_policy_config_built_by_hand_must_be_its_policys_schema():
    from slurmvla.config.policy import policy_schema
    from slurmvla.policy.flow_vla.config import FlowVLAConfig
    from slurmvla.policy.pi0.config import Pi05Config

    assert policy_schema("pi05") is Pi05Config and Pi05Config().state_input == "discrete"
    with pytest.raises(ValueError, match="policy.name='pi05' has the schema Pi05Config, not FlowVLAConfig"):
        FlowVLAConfig(name="pi05")


def test_every_experiment_serves_what_it_trained_on():
    """A policy with observation history reads, when served in its experiment's rollout, the frames training showed
    it (closed_loop.history_warning has nothing to say): experiment=metaworld trains its two frames 3 steps apart,
    as the rollout asks every 3 steps."""
    from slurmvla.inference.closed_loop import history_warning

    for path in sorted((config_dir() / "experiment").glob("*.yaml")):
        extra = ["data.root=/d", "policy.pretrained_path=/ckpt"] if path.stem.startswith("pi05") else []
        cfg = compose([f"experiment={path.stem}", *extra])
        assert history_warning(cfg.data, cfg.serve, cfg.rollout.replan_steps) is None, path.stem
    v2 = compose(["experiment=metaworld", "data.history_interval=1", "serve.request_interval=1"])
    assert "frames 3 steps apart" in history_warning(v2.data, v2.serve, v2.rollout.replan_steps)


def test_the_v2_tables_command_composes_the_configuration_its_runs_trained_with():
    """The Meta-World v2 table's command (docs/benchmarks.md), with the two options that keep its regime, composes
    today the configuration a committed run of that table saved, option for option (its policy's target moved
    since: slurmvla.formats migrates it; the evaluation array's options are new and off)."""
    from omegaconf import OmegaConf

    run = REPO / "benchmarks" / "results" / "metaworld_labelled_4000" / "hammer-v3_s2"
    pytest.importorskip("slurmvla_metaworld_study", reason="pip install -e examples/metaworld_study")
    cfg = compose(["experiment=metaworld", "policy=keypoints_flow_labelled", "policy.image_size=128",
                   "rollout.task=hammer-v3", "trainer.max_steps=4000", "trainer.rollout_every_steps=500",
                   "trainer.seed=2", "rollout.videos=0", "data.history_interval=1", "serve.request_interval=1"])

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    saved = flat(OmegaConf.to_container(OmegaConf.load(run / "config.resolved.yaml")))
    now = flat(OmegaConf.to_container(OmegaConf.structured(cfg)))
    moved = {"policy.name", "policy.target", "data.root", "data.cache_dir"}
    differ = {k: (saved.get(k), now.get(k)) for k in set(saved) | set(now)
              if saved.get(k) != now.get(k) and k not in moved and not k.startswith("rollout_array.")}
    assert not differ
    assert saved["policy.target"].endswith("LabelledKeypointFlowPolicy") and now["policy.name"] == "keypoints_flow_labelled"
