"""Launch layer: DistEnv tables, node lists, ports, override splitting, the preemption flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmvla.launch import DistEnv
from slurmvla.launch.distenv import PORT_BASE, PORT_SPAN, SlurmJob, derive_master_port
from slurmvla.launch.nodelist import expand_nodelist
from slurmvla.launch.overrides import split_overrides


@pytest.mark.parametrize("expr, hosts", [
    ("node1", ["node1"]),
    ("n[1-3,5],gpu-a[01-02]", ["n1", "n2", "n3", "n5", "gpu-a01", "gpu-a02"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[7]", ["a", "b7"]),
])
def test_nodelist_expansion(expr, hosts):
    assert expand_nodelist(expr) == hosts


@pytest.mark.parametrize("expr", ["", "n[1-", "n[3-1]", "n[a-b]", "n]1[", "a,,b", "n[1-2", "n[[1]]"])
def test_invalid_nodelists_name_the_expression(expr):
    with pytest.raises(ValueError, match="invalid nodelist"):
        expand_nodelist(expr)


def test_torchrun_table():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}
    d = DistEnv.from_environ(env)
    assert (d.rank, d.local_rank, d.world_size, d.node_rank, d.num_nodes, d.master_addr, d.master_port, d.source) == \
        (3, 1, 4, 1, 2, "node7", 29400, "torchrun")


SLURM_STEP = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0",
              "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NODELIST": "gpu[03-04,07],cpu9",
              "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_NNODES": "4"}


def test_slurm_step_table():
    d = DistEnv.from_environ(SLURM_STEP)
    assert (d.rank, d.local_rank, d.world_size, d.local_world_size, d.node_rank, d.num_nodes) == (5, 1, 8, 2, 2, 4)
    assert d.master_addr == "gpu03" and d.master_port == derive_master_port(4242) and d.source == "slurm"
    assert DistEnv.from_environ({**SLURM_STEP, "SUBMITIT_EXECUTOR": "slurm"}).source == "submitit"


def test_set_variables_win_over_derived_ones():
    d = DistEnv.from_environ({**SLURM_STEP, "MASTER_ADDR": "login1", "MASTER_PORT": "23456"})
    assert d.master_addr == "login1" and d.master_port == 23456


def test_batch_script_without_srun_is_one_process():
    """In the batch step SLURM_NTASKS may be 8 while one process runs: not a world of 8."""
    env = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_STEP_ID",)}
    assert DistEnv.from_environ(env).world_size == 1


def test_torchrun_inside_a_slurm_task_wins():
    env = {**SLURM_STEP, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert DistEnv.from_environ(env).source == "torchrun"


def test_slurm_errors_name_the_variable():
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        DistEnv.from_environ({**SLURM_STEP, "SLURM_PROCID": "x"})
    with pytest.raises(ValueError, match="has 4 hosts for 3 nodes"):
        DistEnv.from_environ({**SLURM_STEP, "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "6"})
    with pytest.raises(ValueError, match="not the same number per node"):
        DistEnv.from_environ({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "7"})


def _node(tmp_path: Path, pci: dict[str, tuple[str, str]], dev: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A node's /sys (PCI devices: name -> (vendor, class)) and /dev (these files)."""
    sys_root, dev_root = tmp_path / "sys", tmp_path / "dev"
    for name, (vendor, klass) in pci.items():
        d = sys_root / "bus" / "pci" / "devices" / name
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
    dev_root.mkdir()
    for f in dev:
        (dev_root / f).touch()
    return sys_root, dev_root


CPU_NODE = {"0000:00:00.0": ("0x8086", "0x060000"), "0000:00:03.0": ("0x1af4", "0x020000")}


@pytest.mark.parametrize("pci, dev, may", [
    (CPU_NODE, (), False),  # a host bridge and a network card: no GPU, torch is never imported
    ({**CPU_NODE, "0000:17:00.0": ("0x10de", "0x030200")}, (), True),  # an NVIDIA 3D controller (H100)
    ({**CPU_NODE, "0000:c1:00.0": ("0x1002", "0x038000")}, (), True),  # an AMD display controller (MI300)
    ({**CPU_NODE, "0000:17:00.1": ("0x10de", "0x040300")}, (), False),  # NVIDIA's audio function is no GPU
    (CPU_NODE, ("nvidia0",), True),  # a driver's device file (a container that sees no PCI GPU)
    (CPU_NODE, ("kfd",), True),
    ({}, (), True),  # no PCI bus to read: cannot tell, torch counts
], ids=["cpu", "nvidia", "amd", "nvidia-audio", "dev-nvidia0", "dev-kfd", "no-pci"])
def test_a_node_without_a_gpu_is_counted_without_torch(tmp_path, pci, dev, may):
    from slurmvla.launch.__main__ import gpus_may_be_present, nproc_per_node

    sys_root, dev_root = _node(tmp_path, pci, dev)
    assert gpus_may_be_present(sys_root, dev_root) is may
    if not may:
        assert nproc_per_node({}, sys_root, dev_root) == 1
    # The scheduler's and the user's figures win either way.
    assert nproc_per_node({"SLURM_GPUS_ON_NODE": "4"}, sys_root, dev_root) == 4
    assert nproc_per_node({"NPROC_PER_NODE": "2", "GPUS_PER_NODE": "8"}, sys_root, dev_root) == 2


def test_nproc_per_node_on_a_cpu_node_loads_no_torch():
    """On this machine, when it is certainly GPU-less (no GPU device file, a PCI bus without a GPU), the launcher's
    helper answers 1 without importing torch."""
    from slurmvla.launch.__main__ import gpus_may_be_present

    if gpus_may_be_present():
        pytest.skip("this machine may have a GPU (or its PCI bus cannot be read): torch counts there")
    code = ("import sys\nfrom slurmvla.launch.__main__ import nproc_per_node\n"
            "print(nproc_per_node({}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["1", "False"], out.stdout + out.stderr


def test_port_derivation_is_deterministic_and_outside_the_ephemeral_range():
    ports = {derive_master_port(j) for j in range(1, 5000)}
    assert len(ports) == 4999, "consecutive jobs on one node never share a port"
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN <= 32768 for p in ports)
    assert derive_master_port(77, 0) != derive_master_port(77, 1) == derive_master_port("77", "1")
    with pytest.raises(ValueError, match="not an integer"):
        derive_master_port("abc")


def test_an_array_task_gets_one_port_and_one_master_everywhere():
    """The sbatch path (python -m slurmvla.launch, in the batch step) and DistEnv (in each srun task)
    read the same SlurmJob: one port per array task, from the array's job id, not the task's own."""
    batch = {"SLURM_JOB_ID": "1007", "SLURM_ARRAY_JOB_ID": "1000", "SLURM_ARRAY_TASK_ID": "7",
             "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_NNODES": "2", "SLURM_RESTART_COUNT": "2"}
    step = {**batch, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[03-04]"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}

    def cli(what: str) -> str:
        return subprocess.run([sys.executable, "-m", "slurmvla.launch", what], env={**clean, **batch},
                              capture_output=True, text=True, check=True).stdout.strip()

    job = SlurmJob.from_environ(batch)
    assert job.restart_count == 2 and job.job_id == "1007"
    port = derive_master_port(1000, 7)
    assert port != derive_master_port(1007, 7)
    assert int(cli("master-port")) == job.master_port == DistEnv.from_environ(step).master_port == port
    assert cli("master-addr") == job.master_addr == DistEnv.from_environ(step).master_addr == "gpu03"
    # Another task of the same array: another port.
    assert SlurmJob.from_environ({**batch, "SLURM_JOB_ID": "1008", "SLURM_ARRAY_TASK_ID": "8"}).master_port != port
    with pytest.raises(ValueError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        SlurmJob.from_environ({"SLURM_RESTART_COUNT": "x"})


def test_exports_never_overwrite_silently():
    d = DistEnv.from_environ(SLURM_STEP)
    env = {"MASTER_PORT": "11111"}
    kept = d.export_to(env)
    assert env["RANK"] == "5" and env["NODE_RANK"] == "2" and env["NNODES"] == "4" and env["WORLD_SIZE"] == "8"
    assert env["MASTER_PORT"] == "11111" and kept == [f"MASTER_PORT=11111 (derived: {d.master_port})"]


@pytest.mark.parametrize("text, parts", [
    ("", []),
    ("  ", []),
    ("trainer.max_steps=5 precision=bf16", ["trainer.max_steps=5", "precision=bf16"]),
    ("'name=a b' tags='[x, y]'", ["name=a b", "tags=[x, y]"]),
    ('name="x y"', ["name=x y"]),
    ("name=$(id) b=`id`; c=1", ["name=$(id)", "b=`id`;", "c=1"]),
    ("'name=$(touch /tmp/x)'", ["name=$(touch /tmp/x)"]),
])
def test_override_splitting(text, parts):
    assert split_overrides(text) == parts


def test_unbalanced_quote_shows_the_string():
    with pytest.raises(ValueError, match=r"EXTRA_TAIL_OVERRIDES cannot be split .*\"name='a b\""):
        split_overrides("name='a b")


def test_override_module_prints_nul_separated_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    env = {**os.environ, "EXTRA_TAIL_OVERRIDES": f"'a=x y' 'b=$(touch {marker})'"}
    out = subprocess.run([sys.executable, "-m", "slurmvla.launch.overrides"], env=env, capture_output=True, check=True)
    assert out.stdout.split(b"\0")[:-1] == [b"a=x y", f"b=$(touch {marker})".encode()]
    assert not marker.exists()
    bad = subprocess.run([sys.executable, "-m", "slurmvla.launch.overrides"], capture_output=True, text=True,
                         env={**os.environ, "EXTRA_TAIL_OVERRIDES": "a='b"})
    assert bad.returncode == 2 and "a='b" in bad.stderr


def test_alloc_conf_default_is_set_once_and_never_overrides(caplog):
    from slurmvla.launch.runtime import apply_process_defaults

    env: dict[str, str] = {}
    with caplog.at_level("INFO", logger="slurmvla"):
        apply_process_defaults(True, env)
        apply_process_defaults(True, env)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert sum("PYTORCH_CUDA_ALLOC_CONF" in r.message for r in caplog.records) == 1
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    apply_process_defaults(True, mine)
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_snapshot_keeps_the_job_shape_and_drops_secrets():
    from slurmvla.launch.runtime import job_environment

    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "MASTER_ADDR": "node1", "WANDB_API_KEY": "xyz",
           "SLURM_AUTH_TOKEN": "t", "HF_TOKEN": "h", "HOME": "/root", "EXTRA_TAIL_OVERRIDES": "a=1"}
    kept = job_environment(env)
    assert kept == {"EXTRA_TAIL_OVERRIDES": "a=1", "MASTER_ADDR": "node1", "SLURM_JOB_ID": "7",
                    "SLURM_JOB_NODELIST": "node[1-2]"}


GOLDEN = Path(__file__).parents[1] / "golden"
_LAUNCH_VARS = ("SLURM", "NNODES", "NODE_RANK", "MASTER_", "RUN_DIR", "DROID_ROOT", "EPISODE_ID_TO_PATH", "LAUNCHER",
                "SLURMVLA_", "KEEP_RANGES_PATH", "EXTRA_TAIL_OVERRIDES", "NPROC_PER_NODE", "GPUS_PER_NODE", "DRY_RUN")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}


def test_wrapper_works_run_and_sourced_and_stops_on_a_malformed_tail():
    repo = Path(__file__).resolve().parents[2]
    env = {**_clean_env(), "DRY_RUN": "1", "NPROC_PER_NODE": "1", "EXTRA_TAIL_OVERRIDES": "'a=b c'"}
    run = subprocess.run(["bash", "launchers/train.sh", "x=1"], cwd=repo, env=env, capture_output=True, text=True)
    sourced = subprocess.run(["bash", "-c", "source launchers/train.sh x=1"], cwd=repo, env=env, capture_output=True,
                             text=True)
    assert run.returncode == sourced.returncode == 0 and run.stdout == sourced.stdout
    assert run.stdout.strip().endswith("-m slurmvla.train x=1 a=b\\ c")
    bad = subprocess.run(["bash", "launchers/train.sh"], cwd=repo, capture_output=True, text=True,
                         env={**env, "EXTRA_TAIL_OVERRIDES": "a='b", "DRY_RUN": "0"})
    assert bad.returncode == 2 and "a='b" in bad.stderr and "torchrun" not in bad.stdout


@pytest.mark.parametrize("script, args, golden", [
    ("sbatch/droid.sh", ["trainer.seed=1"], "sbatch_droid_dry_run.txt"),
    ("launchers/train.sh", ["engine=ddp"], "launcher_single_node_dry_run.txt"),
])
def test_dry_runs_match_golden_files(script, args, golden, tmp_path):
    """The exact command lines each path would run (regenerate with SLURMVLA_REGOLDEN=1)."""
    repo = Path(__file__).resolve().parents[2]
    keep = tmp_path / "keep_ranges_1_0_1.json"
    keep.write_text("{}")
    env = _clean_env()
    env.update(DRY_RUN="1", NPROC_PER_NODE="2", PYTHON="python3", KEEP_RANGES_PATH=str(keep),
               EXTRA_TAIL_OVERRIDES="'name=two words' trainer.max_steps=3")
    out = subprocess.run(["bash", script, *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout
    out = out.replace(str(keep), "<KEEP_RANGES_PATH>")
    path = GOLDEN / golden
    if os.environ.get("SLURMVLA_REGOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(out)
    assert out == path.read_text()


def test_the_droid_wrapper_runs_the_recipe_experiment_names():
    repo = Path(__file__).resolve().parents[2]
    env = {**_clean_env(), "DRY_RUN": "1", "NPROC_PER_NODE": "1"}
    default = subprocess.run(["bash", "launchers/droid.sh"], cwd=repo, env=env, capture_output=True, text=True, check=True)
    openpi = subprocess.run(["bash", "launchers/droid.sh", "x=1"], cwd=repo, env={**env, "EXPERIMENT": "pi05_droid"},
                            capture_output=True, text=True, check=True)
    assert default.stdout.strip().endswith("-m slurmvla.train experiment=droid")
    assert openpi.stdout.strip().endswith("-m slurmvla.train experiment=pi05_droid x=1")


def test_python_dry_runs_print_and_submit_nothing(tmp_path):
    env = {**_clean_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "slurmvla.train", "--dry-run", "-m", "hydra/launcher=slurm_cluster",
                          "hydra.launcher.nodes=4", "hydra.launcher.partition=gpu", "engine=fsdp_full"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=USR2@120", "#SBATCH --partition=gpu", "submitit.core._submit"):
        assert line in res.stdout
    assert "training with these overrides: engine=fsdp_full" in res.stdout
    local = subprocess.run([sys.executable, "-m", "slurmvla.train", "--dry-run", "engine=ddp", "precision=bf16"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert local.returncode == 0 and "-m slurmvla.train engine=ddp precision=bf16" in local.stdout
    assert "engine=ddp precision=bf16" in local.stdout.splitlines()[-1]
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    bad = subprocess.run([sys.executable, "-m", "slurmvla.train", "--dry-run", "precision=fp8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "precision='fp8'" in bad.stderr


def test_restart_budget_holds_for_slurms_own_requeues():
    """A job SLURM requeued after a node failure starts again only within SLURMVLA_MAX_RESTARTS."""
    def check(count: int) -> subprocess.CompletedProcess:
        env = {**os.environ, "SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": str(count), "SLURMVLA_MAX_RESTARTS": "3"}
        return subprocess.run([sys.executable, "-m", "slurmvla.launch", "check-budget"], env=env, capture_output=True,
                              text=True)

    assert check(3).returncode == 0
    over = check(4)
    assert over.returncode == 1 and "job 41 was requeued 4 times, more than its budget SLURMVLA_MAX_RESTARTS=3" in over.stderr


@pytest.mark.parametrize("codes", [(75, 75), (75, 3)])
def test_torchrun_wrapper_says_a_stop_for_requeue_in_one_line_and_keeps_torchruns_report_for_a_failure(
        tmp_path, codes):
    """Every rank exiting with the requeue code is one line and that exit code; a rank exiting otherwise keeps
    torchrun's report and its exit code 1 (the training run's own stop, with its step: tests/test_distributed.py)."""
    # Like the trainers after their save, the ranks ignore the SIGTERM torchrun sends the ranks still running
    # once one has exited (its warning is held back too); a rank exiting with 75 waits for the other's start (and,
    # when that one fails, its exit), so a SIGTERM never finds a rank before it ignores it.
    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "rank = int(os.environ['LOCAL_RANK'])\n"
        "code = int(os.environ['CODES'].split(',')[rank])\n"
        "open(os.path.join(sys.argv[1], f'rank{rank}'), 'w').close()\n"
        "other, deadline = os.path.join(sys.argv[1], f'rank{1 - rank}'), time.monotonic() + 60\n"
        "while code == 75 and not os.path.exists(other) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "sys.exit(code)\n")
    env = {**_clean_env(), "CODES": ",".join(map(str, codes)), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "slurmvla.launch.torchrun", "--standalone", "--nproc_per_node=2",
                          str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    lines = (res.stdout + res.stderr).strip().splitlines()
    if codes == (75, 75):
        assert res.returncode == 75 and lines == [
            "slurmvla: run stopped for requeue (exit 75); its checkpoint is saved and the same command resumes it"], lines
    else:
        assert res.returncode == 1 and "ChildFailedError" in res.stderr and "exitcode  : 3" in res.stderr, res.stderr
        assert "failed (exitcode: " in res.stderr  # the agent's own line, held back, then logged
        assert "for requeue" not in res.stderr
