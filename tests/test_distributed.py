"""The parity matrix: every strategy trains the same model as one process (CPU, gloo, torchrun).

Tolerances (fp32): the strategies do the same arithmetic as the single process except for the
order of floating-point sums in the gradient reduction, so after 4 AdamW steps the weights agree to
1e-9 to 1e-7 relative (global L2, measured); the bound is 1e-6. Per tensor, the worst element is bounded
at 1e-3 of the tensor's largest value (measured <= 6.5e-5): where a gradient is zero in exact arithmetic
(the key bias of attention: softmax ignores a constant shift) Adam divides rounding noise by its
own tiny second moment and amplifies it. bf16 runs must track the fp32 single run to 2e-2 relative
(measured 8e-4 to 5e-3: DeepSpeed starts from the bf16-rounded weights, the others from fp32). Four steps, resumed
from the second (the schedule's warm-up then over): eight repeated the same arithmetic, with figures of the same order.

The cells run in two torchrun jobs (tests/dist_driver.py: the reference policy's; pi0's and pi0.5's), cell
after cell, under a deadline: a hang fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.checkpoint import load_model_file
from slurmvla.compose import compose
from slurmvla.config.engine import EngineConfig
from slurmvla.engine.fsdp import hsdp_degrees
from slurmvla.export import export
from slurmvla.launch import DistEnv
from slurmvla.launch.preempt import REQUEUE_EXIT_CODE
from slurmvla.registry import ENGINES
from slurmvla.trainer import Trainer
from tests.conftest import rel_l2

pytestmark = pytest.mark.multiproc
DRIVER = Path(__file__).with_name("dist_driver.py")
STEPS = 4
HALF = STEPS // 2  # where the resume runs stop, and the checkpoint interval
# Every run keeps a moving average of its weights (it changes nothing in training): each strategy's
# must match one process's and resume bitwise, like the weights.
EMA_DECAY = 0.9


@pytest.fixture(scope="module")
def matrix_root(tmp_path_factory) -> Path:
    """The matrix's data: 6 episodes of 20 frames (3 cameras, AV1, 3 per file). Every run decodes what it
    reads afresh, so the data's size is most of a tiny run's time; the engines do not care."""
    from slurmvla.data.synthetic import write_droid_sample

    return write_droid_sample(tmp_path_factory.mktemp("data") / "matrix", num_episodes=6, seed=1, episodes_per_file=3,
                              length=20)


def base_overrides(root) -> list[str]:
    # The map loader: its global order does not depend on the world size, so every world size
    # trains on the same global batches (the stream shards per rank and worker).
    return [f"data.root={root}", "data.loader=map", "logging.wandb.mode=disabled", "trainer.progress_bar=false", "data.num_workers=0",
            f"trainer.max_steps={STEPS}", "trainer.global_batch_size=8", f"checkpoint.every_steps={HALF}",
            "trainer.log_every_steps=2", "optim.lr=1e-3", "scheduler.warmup_steps=2", f"trainer.ema_decay={EMA_DECAY}"]


def run_driver(tmp: Path, nproc: int, base: list[str], runs: list[dict], deadline_s: int = 420) -> Path:
    out = tmp / f"job{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "base": base, "runs": runs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             str(DRIVER), str(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun job did not finish within {deadline_s}s (a hang):\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    return out


class Worst(float):
    """The worst tensor's relative error, printing which tensor it is when an assertion fails."""

    key = ""

    def __repr__(self) -> str:
        return f"{float(self):.3g} ({self.key})"


# A separate attention key bias (SigLIP's k_proj.bias) gets a zero gradient in exact arithmetic
# (softmax ignores a shift shared by all keys): it holds only Adam-amplified rounding noise, which
# no strategy can reproduce per element. It has no effect on any output; the global bound covers it.
INERT = ("self_attn.k_proj.bias",)


def worst_tensor(a: dict, b: dict) -> Worst:
    errs = {k: ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b
            if not k.endswith(INERT)}
    key = max(errs, key=errs.get)
    worst = Worst(errs[key])
    worst.key = key
    return worst


# The matrix runs for the reference policy and for pi0 / pi0.5 (transformers' Gemma and SigLIP
# modules, joint attention across two models' layers): the same tolerances for all.
POLICIES = {"reference": [], "pi0_tiny": ["policy=pi0_tiny"], "pi05_tiny": ["policy=pi05_tiny"]}


@pytest.fixture(scope="module")
def single_references(matrix_root, tmp_path_factory):
    """One process, same data, same global batch, same seed: the reference every strategy must match
    (per policy, computed on first use)."""
    cache: dict[str, dict] = {}

    def get(policy: str) -> dict:
        if policy not in cache:
            out = {}
            for name, extra in (("fp32", []), ("frozen", FROZEN), ("lora", LORA)):
                if name == "lora" and policy not in LORA_POLICIES:
                    continue
                cfg = compose([*base_overrides(matrix_root), *POLICIES[policy], *extra])
                trainer = Trainer(cfg, tmp_path_factory.mktemp(f"single_{policy}_{name}"))
                trainer.fit()
                out[name] = trainer.engine.model_state_dict()
                out[f"{name} ema"] = trainer.ema.state_dict()
                trainer.close()
            cache[policy] = out
        return cache[policy]

    return get


@pytest.fixture(scope="module")
def single_reference(single_references):
    return single_references("reference")


# The reference policy on every engine; pi0 / pi0.5 (one code path: joint layers, SigLIP units, the
# engines see the same module tree but for pi0.5's adaptive norms and prompt) between them on every
# engine once, pi0.5 (the superset) on the two that shard parameters. The cells left out gave figures
# identical to a kept one (fsdp_grad_op == fsdp_full == hsdp, zero1 == zero2 to all digits; pi0 == pi0.5
# on fsdp_full and zero3 to the same digits).
# fsdp_grad_op wraps the same units as fsdp_full and differs only in resharding after forward: the
# reference policy there (its pi0 cell gave fsdp_full's figures to all digits).
# hsdp at world 2 is a 1 x 2 mesh, fsdp_full's sharding with a replicate group of one: it runs at world 4 as
# 2 x 2 instead (straight, and with accumulation: the replicate all-reduce under no_sync), and is resumed there
# from 2 x 2 as 1 x 2 (test_world_size_four, test_fsdp_saved_at_world_four_resumes_at_world_two).
PI0_CELLS = {"ddp": "pi05_tiny", "fsdp_full": "pi05_tiny", "fsdp_grad_op": None,
             "zero1": "pi0_tiny", "zero2": "pi05_tiny", "zero3": "pi05_tiny"}
WORLD_TWO_ENGINES = [e for e in ENGINES if e not in ("single", "hsdp")]
STRATEGY_CELLS = [(e, p) for e in WORLD_TWO_ENGINES for p in ("reference", PI0_CELLS.get(e, "pi0_tiny")) if p is not None]
# Gradient accumulation (the engine's no_sync) and bf16 autocast with fp32 masters are the engine's
# alone: every engine runs them with the reference policy; bf16 also with pi0.5 where the engine shards
# parameters (mixed precision meets the transformer's own dtype handling there).
BF16_PI0_ENGINES = ("fsdp_full", "zero3")


# Training-time real-time chunking (a clean, delayed prefix of each chunk, outside the loss; a time per action:
# pi0.5's adaptive norms per token) rides in the frozen and LoRA runs: every engine, both policy families, LoRA.
RTC_TRAINING = ["policy.rtc_training.max_delay=3"]
FROZEN = ["policy.train_expert_only=true", *RTC_TRAINING]
# The LoRA column (peft's adapters, openpi's preset: frozen base, adapters on both language models): every
# engine of the world-2 cells, once, with its pi0 / pi0.5 cell's policy (fsdp_grad_op: the reference policy's).
LORA = ["policy.lora.enabled=true", *RTC_TRAINING]
LORA_CELLS = {e: PI0_CELLS.get(e, "pi0_tiny") or "reference" for e in WORLD_TWO_ENGINES}
LORA_POLICIES = set(LORA_CELLS.values())
ACCUM = ["trainer.grad_accum_steps=2"]  # global batch 8 as 2 ranks x 2 accumulation steps x 2 == 2 ranks x 4


def cell_runs(engine: str, policy: str) -> list[dict]:
    """One cell's runs: straight; resumed from the straight run's half-way checkpoint (saved mid-run); frozen
    backbone; and where they apply, gradient accumulation, bf16 and LoRA (straight and resumed the same way).
    Only the runs another resumes from save half-way; every run saves its last step.
    Activation checkpointing (where the engine has it) rides in a run whose result is already held to 1e-6 and
    trains the checkpointed layers: the accumulation run of the reference policy, the LoRA runs of pi0 / pi0.5
    (adapters inside the recomputed layers). Recomputation changes no arithmetic: that run's bound holds it to
    the 1e-6 a run of its own did, one run fewer per cell (pi0.5's LoRA with recomputation 1.4e-9 to 1.6e-9 from
    one process on ddp / fsdp_full / zero2, 1.4e-9 without it on zero3, which has none)."""
    ckpt = ["policy.gradient_checkpointing=true"] if engine in ENGINES.names(activation_checkpointing=True) else []
    last_only = ["checkpoint.every_steps=0"]
    runs = [
        {"name": "straight"},
        {"name": "resumed", "start_from": ["straight", HALF]},
        {"name": "frozen", "overrides": [*FROZEN, *last_only]},
    ]
    if LORA_CELLS.get(engine) == policy:
        lora = [*LORA, *([] if policy == "reference" else ckpt)]
        runs += [{"name": "lora", "overrides": lora},
                 {"name": "lora_resumed", "overrides": [*lora, *last_only], "start_from": ["lora", HALF]}]
    if policy == "reference":
        runs.append({"name": "accum", "overrides": [*ACCUM, *ckpt, *last_only]})
    if policy == "reference" or engine in BF16_PI0_ENGINES:
        runs.append({"name": "bf16", "overrides": ["precision=bf16", *last_only]})
    return runs


def matrix_job(policy: str) -> str:
    """The torchrun job a policy's cells run in: the reference policy's, and one for pi0 and pi0.5 together."""
    return "reference" if policy == "reference" else "pi0"


@pytest.fixture(scope="module")
def strategy_jobs(request, matrix_root, tmp_path_factory):
    """The cells of a job (:func:`matrix_job`) run in one torchrun job, cell after cell in the same two
    processes (starting processes and importing torch / DeepSpeed cost more than a cell's tiny runs). Only
    the cells this session selected run. Returns ``get(engine, policy) -> (folder, runs)``; a failed job
    fails each of its cells with the job's log (dist_driver names the run it was in)."""
    jobs: dict[str, dict | Exception] = {}

    def get(engine: str, policy: str) -> tuple[Path, list[dict]]:
        name = matrix_job(policy)
        if name not in jobs:
            selected = {(item.callspec.params["engine"], item.callspec.params["policy"]) for item in request.session.items
                        if item.originalname == "test_strategy_matches_single_process"
                        and matrix_job(item.callspec.params["policy"]) == name}
            # DeepSpeed's engines last: nothing it sets up may be what the others find.
            cells = sorted(selected, key=lambda c: (c[0].startswith("zero"), list(ENGINES).index(c[0]), c[1]))
            runs = [{**r, "name": f"{p}.{e}.{r['name']}", "dir": f"{p}.{e}.{r.get('dir', r['name'])}",
                     "overrides": [*POLICIES[p], f"engine={e}", *r.get("overrides", [])],
                     **({"start_from": [f"{p}.{e}.{r['start_from'][0]}", HALF]} if "start_from" in r else {})}
                    for e, p in cells for r in cell_runs(e, p)]
            try:
                out = run_driver(tmp_path_factory.mktemp(f"matrix_{name}"), 2, base_overrides(matrix_root), runs,
                                 deadline_s=540)
                jobs[name] = {"out": out}
            except (AssertionError, pytest.fail.Exception) as e:  # every cell of the job reports it
                jobs[name] = e
        job = jobs[name]
        if isinstance(job, Exception):
            pytest.fail(f"the {name} matrix job failed (this cell: {engine}, {policy}): {job}", pytrace=False)
        return job["out"], [{**r, "file": f"{policy}.{engine}.{r['name']}"} for r in cell_runs(engine, policy)]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "policy"), STRATEGY_CELLS)
def test_strategy_matches_single_process(engine, policy, single_references, strategy_jobs, tmp_path):
    single_reference = single_references(policy)
    out, runs = strategy_jobs(engine, policy)
    ref = single_reference["fp32"]
    w = {r["name"]: load_file(str(out / f"{r['file']}.safetensors")) for r in runs}
    ema = {r["name"]: load_file(str(out / f"{r['file']}.ema.safetensors")) for r in runs}
    report = {r["name"]: json.loads((out / f"{r['file']}.json").read_text()) for r in runs}

    if "lora" in w:
        print(f"parity {policy} {engine}: lora {rel_l2(w['lora'], single_reference['lora']):.2e}")
    figures = {"straight": rel_l2(w["straight"], ref), "worst tensor": worst_tensor(w["straight"], ref),
               "frozen": rel_l2(w["frozen"], single_reference["frozen"]),
               "ema": rel_l2(ema["straight"], single_reference["fp32 ema"])}
    for name, other in (("accum", w["straight"]), ("bf16", ref)):
        if name in w:
            figures[name] = rel_l2(w[name], other)
    print(f"parity {policy} {engine}: " + ", ".join(f"{k} {float(v):.2e}" for k, v in figures.items()))
    # Every run of the cell ran on this cell's engine (the job runs many engines in the same processes).
    assert {r["engine"].split(":")[1] for r in report.values()} == {engine}, {k: r["engine"] for k, r in report.items()}
    assert rel_l2(w["straight"], ref) < 1e-6
    assert worst_tensor(w["straight"], ref) < 1e-3
    # N steps straight == from the strategy's own checkpoint at N/2 (saved mid-run), resumed to N.
    assert report["resumed"]["resumed_from"].endswith(f"step_{HALF:08d}")
    assert all(torch.equal(w["straight"][k], w["resumed"][k]) for k in ref), "resume is bitwise on CPU"
    # The moving average, held as the strategy holds its optimizer state: one process's, and resumed bitwise.
    assert rel_l2(ema["straight"], single_reference["fp32 ema"]) < 1e-6
    assert rel_l2(ema["straight"], w["straight"]) > 1e-4, "the average must lag the weights"
    assert all(torch.equal(ema["straight"][k], ema["resumed"][k]) for k in ref), "the average resumes bitwise"
    # The strategy's checkpoint exports (one process, no process group) to the same weights, and by default
    # (serve.weights=auto) to its moving average.
    run = out / f"{policy}.{engine}.straight"
    exported = load_file(str(export(run, tmp_path / "trained.safetensors", ema=False)))
    assert all(torch.equal(exported[k], w["straight"][k]) for k in ref)
    exported = load_file(str(export(run, tmp_path / "default.safetensors")))
    assert all(torch.equal(exported[k], ema["straight"][k]) for k in ref)
    if "accum" in w:  # global batch 8 as 2 ranks x 2 accumulation steps x 2 == 2 ranks x 4 (recomputing, see cell_runs)
        assert rel_l2(w["accum"], w["straight"]) < 1e-6
    if "bf16" in w:  # fp32 parameters and state in the optimizer that steps, weights near the fp32 run
        assert report["bf16"]["state_dtypes"] and all(d.endswith("float32") for d in report["bf16"]["state_dtypes"])
        assert all(d == "torch.float32" for d in report["bf16"]["param_dtypes"])
        assert rel_l2(w["bf16"], ref) < 2e-2
        assert rel_l2(ema["bf16"], single_reference["fp32 ema"]) < 2e-2
    # Frozen backbone: the same result as one process with the same parts frozen.
    assert rel_l2(w["frozen"], single_reference["frozen"]) < 1e-6
    if "lora" in w:  # LoRA: one process's adapters, resumed bitwise from a checkpoint without the frozen base
        lora_ref = single_reference["lora"]
        assert set(w["lora"]) == set(lora_ref)
        assert rel_l2(w["lora"], lora_ref) < 1e-6, rel_l2(w["lora"], lora_ref)
        assert all(torch.equal(w["lora"][k], w["lora_resumed"][k]) for k in lora_ref), "LoRA resume is bitwise on CPU"
        assert rel_l2(ema["lora"], single_reference["lora ema"]) < 1e-6
        assert all(torch.equal(ema["lora"][k], ema["lora_resumed"][k]) for k in ema["lora"])
        held = load_model_file(out / f"{policy}.{engine}.lora" / "checkpoints" / f"step_{STEPS:08d}")
        assert held and all(k in lora_ref for k in held) and len(held) < len(lora_ref), "a LoRA checkpoint leaves out the base"
        merged = load_file(str(export(out / f"{policy}.{engine}.lora", tmp_path / "lora.safetensors")))
        assert not any(".lora_" in k or ".base_layer." in k for k in merged)


# Straight at world 4 (hsdp as 2 x 2), and hsdp's accumulation: its replicate all-reduce under no_sync.
WORLD_FOUR = [("hsdp", "reference", ""), ("hsdp", "reference", "accum"), ("zero2", "reference", "")]
FOUR_TO_TWO = [("fsdp_full", "reference"), ("hsdp", "pi05_tiny")]  # saved at world 4, resumed at world 2


def _two_by_two(engine: str) -> list[str]:
    return ["engine.replicate_degree=2", "engine.shard_degree=2"] if engine == "hsdp" else []


ACCUM_CKPT = [*ACCUM, "policy.gradient_checkpointing=true"]  # recomputing too, as the matrix's accumulation runs


def _four_name(engine: str, policy: str, run: str) -> str:
    return ".".join(filter(None, (engine, policy, run)))


@pytest.fixture(scope="module")
def world_four_jobs(matrix_root, tmp_path_factory):
    """One job of four ranks: the world-four cells, and the first halves of the 4 -> 2 resumes (hsdp as
    2 x 2); then one job of two ranks resumes both (hsdp as 1 x 2). Returns (world 4 folder, world 2 folder)."""
    four = [{"name": _four_name(e, p, r), "overrides": [*POLICIES[p], f"engine={e}", *_two_by_two(e),
                                                        *(ACCUM_CKPT if r == "accum" else []), "checkpoint.every_steps=0"]}
            for e, p, r in WORLD_FOUR]
    four += [{"name": f"{e}.{p}.half", "dir": f"{e}.{p}.run", "stop_at": HALF,
              "overrides": [*POLICIES[p], f"engine={e}", *_two_by_two(e)]} for e, p in FOUR_TO_TWO]
    first = run_driver(tmp_path_factory.mktemp("world4"), 4, base_overrides(matrix_root), four)
    two = [{"name": f"{e}.{p}.resumed", "dir": str(first / f"{e}.{p}.run"), "overrides": [*POLICIES[p], f"engine={e}"]}
           for e, p in FOUR_TO_TWO]
    return first, run_driver(tmp_path_factory.mktemp("world2"), 2, base_overrides(matrix_root), two)


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "policy", "run"), WORLD_FOUR, ids=["hsdp-2x2", "hsdp-2x2-accum", "zero2"])
def test_world_size_four(engine, policy, run, single_references, world_four_jobs):
    """hsdp as 2 x 2 (replicate x shard), straight and accumulating, and a ZeRO stage, at world size 4 (pi0.5
    under hsdp 2 x 2: the world 4 -> 2 test below)."""
    single_reference = single_references(policy)
    w = load_file(str(world_four_jobs[0] / f"{_four_name(engine, policy, run)}.safetensors"))
    print(f"parity {policy} {engine} {run or 'straight'} world 4: {rel_l2(w, single_reference['fp32']):.2e}, worst "
          f"tensor {float(worst_tensor(w, single_reference['fp32'])):.2e}")
    assert rel_l2(w, single_reference["fp32"]) < 1e-6
    assert worst_tensor(w, single_reference["fp32"]) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "policy"), FOUR_TO_TWO)
def test_fsdp_saved_at_world_four_resumes_at_world_two(engine, policy, single_references, world_four_jobs):
    """Trained at world 4 (hsdp: 2 x 2), resumed at world 2 (hsdp: 1 x 2) to the single process's weights.
    pi0_tiny: the same units and DCP state as pi0.5."""
    single_reference = single_references(policy)
    second = world_four_jobs[1]
    report = json.loads((second / f"{engine}.{policy}.resumed.json").read_text())
    assert report["resumed_from"].endswith(f"step_{HALF:08d}") and report["step"] == STEPS
    w = load_file(str(second / f"{engine}.{policy}.resumed.safetensors"))
    ema = load_file(str(second / f"{engine}.{policy}.resumed.ema.safetensors"))
    print(f"parity {policy} {engine} saved at world 4, resumed at 2: {rel_l2(w, single_reference['fp32']):.2e}, "
          f"moving average {rel_l2(ema, single_reference['fp32 ema']):.2e}")
    assert rel_l2(w, single_reference["fp32"]) < 1e-6
    assert rel_l2(ema, single_reference["fp32 ema"]) < 1e-6


# -- start-up checks (no processes) -----------------------------------------------------------------

def test_hsdp_degrees_must_multiply_to_the_world_size():
    env = DistEnv(rank=0, world_size=4, local_world_size=2)
    assert hsdp_degrees(EngineConfig(name="hsdp"), env) == (2, 2)
    assert hsdp_degrees(EngineConfig(name="hsdp", replicate_degree=1, shard_degree=4), env) == (1, 4)
    with pytest.raises(ValueError, match=r"replicate_degree=3 x shard_degree=2 = 6 != world size 4"):
        hsdp_degrees(EngineConfig(name="hsdp", replicate_degree=3, shard_degree=2), env)


def test_zero3_refuses_gradient_checkpointing():
    with pytest.raises(ValueError) as e:
        compose(["engine=zero3", "policy.gradient_checkpointing=true"])
    assert "'zero3'" in str(e.value) and "fsdp_full" in str(e.value) and "zero2" in str(e.value)


def test_single_engine_refuses_a_multi_process_world(make_cfg):
    from slurmvla.engine import build_engine

    with pytest.raises(ValueError, match="engine=single runs one process.*world size 2.*'ddp'"):
        build_engine(make_cfg(), DistEnv(rank=0, world_size=2, local_world_size=2), torch.device("cpu"), 4)


def test_sharding_without_wrap_units_is_an_error():
    from torch import nn

    from slurmvla.engine.fsdp import FSDPEngine

    class NoUnits(nn.Module):
        def wrap_units(self):
            return []

    engine = FSDPEngine.__new__(FSDPEngine)
    engine.name = "fsdp_full"
    with pytest.raises(ValueError, match=r"wrap_units\(\) is empty"):
        engine.shard(NoUnits())


def _torchrun_train(args: list[str], launcher: bool = False) -> subprocess.Popen:
    """Two ranks under torchrun; with ``launcher``, through launchers/train.sh (its torchrun wrapper) as a job runs."""
    if launcher:
        cmd = ["bash", "launchers/train.sh", *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NNODES", "NODE_RANK", "MASTER_", "DRY_RUN",
                                                                        "EXTRA_TAIL_OVERRIDES", "SLURM"))}
        env.update(NPROC_PER_NODE="2", PYTHON=sys.executable)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "slurmvla.train", *args]
        env = dict(os.environ)
    return subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.slow
def test_preemption_signal_on_one_rank_checkpoints_all_and_resumes_exactly(matrix_root, tmp_path):
    """USR2 to rank 1 only: the ranks agree, save together, stop; a restart ends where an
    uninterrupted run ends, bitwise. The uninterrupted run is the real entry path, torchrun -m slurmvla.train on
    two ranks into one run directory; the preempted run goes through launchers/train.sh: its torchrun says so in
    one line and exits with the requeue code, no failure report."""
    import time

    import psutil

    common = ["engine=ddp", *base_overrides(matrix_root), "trainer.max_steps=40", "checkpoint.every_steps=10",
              "trainer.signal_check_every_steps=1"]
    straight = _torchrun_train([*common, f"hydra.run.dir={tmp_path / 'straight'}"])
    assert straight.wait(timeout=300) == 0, straight.stdout.read()[-3000:]
    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000040"
    assert (ckpt / "rank_00000.pt").is_file() and (ckpt / "rank_00001.pt").is_file()
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2

    run = tmp_path / "preempted"
    job = _torchrun_train([*common, f"hydra.run.dir={run}"], launcher=True)
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_00000010").exists():
        assert job.poll() is None and time.monotonic() < deadline, "training did not reach step 10"
        time.sleep(0.05)
    workers = [p for p in psutil.Process(job.pid).children(recursive=True) if "slurmvla.train" in p.cmdline()]
    rank1 = [w for w in workers if w.environ().get("LOCAL_RANK") == "1"]
    assert len(rank1) == 1
    rank1[0].send_signal(signal.SIGUSR2)
    log, _ = job.communicate(timeout=120)
    assert job.returncode == REQUEUE_EXIT_CODE, log[-5000:]
    stop_lines = [line for line in log.splitlines() if "for requeue (exit 75)" in line]
    assert "Traceback" not in log and "ChildFailedError" not in log and "FAILED" not in log, log[-5000:]
    # rank 0 had no signal of its own: it counts from rank 1's and names it
    assert "preemption signal on another rank (SIGUSR2, " in log, log[-5000:]
    assert re.search(r"stopped at step \d+, [\d.]+ s after SIGUSR2 on another rank: checkpoint", log), log[-5000:]
    stopped = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    stopped_at = max(int(n.split("_")[1]) for n in stopped)
    assert 10 <= stopped_at < 40 and not (run / "FINISHED").exists()
    assert stop_lines == [f"slurmvla: run stopped at step {stopped_at} for requeue (exit 75); its checkpoint is saved "
                          "and the same command resumes it"], log[-5000:]

    resumed = _torchrun_train([*common, f"hydra.run.dir={run}"])
    log, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, log[-3000:]
    assert (run / "FINISHED").read_text().strip() == "40"
    a = load_file(str(tmp_path / "straight" / "checkpoints" / "step_00000040" / "model.safetensors"))
    b = load_file(str(run / "checkpoints" / "step_00000040" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
