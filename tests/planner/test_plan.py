"""python -m slurmvla.plan: the model states it counts are the bytes a real run holds, its activation figure is
what a real forward + backward allocates, and its command line says what fits where.

The activations are compared on the CPU, where the real step's allocations are read from torch's profiler
(every allocation and free of the CPU allocator); the plan's own figure comes from fake tensors. In fp32 the
two agree to the byte (measured: policy=tiny at micro-batch 8 and policy=small at micro-batch 2, relative
error 0); in bf16, with the same autocast lists on both sides, the real step allocates up to ~1 % more inside
the CPU's bf16 kernels (workspaces that are no op's output: policy=tiny 0.8 %, pi05_tiny 7e-7), so the bounds are
1 % and 2 %.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from slurmvla import plan
from slurmvla.compose import compose
from slurmvla.planner import fit
from slurmvla.planner.activations import ShapeStep, analytic_activations, backward
from slurmvla.planner.autocast import (
    AUTOCAST_FP32,
    AUTOCAST_FP32_OPT_DTYPE,
    AUTOCAST_LOWER,
    AUTOCAST_PROMOTE,
    CudaAutocast,
)
from slurmvla.planner.fit import Planner
from slurmvla.planner.gpus import GPUS
from slurmvla.planner.model_states import build_on_meta, count_tensors, model_states
from tests.conftest import run_until

# The plans of pi0.5 at its published size go to one worker, one after another: the planner of a policy
# configuration (its module tree on fake tensors, each measured pass) is kept for the next (planner_for).
PUBLISHED_PI05 = pytest.mark.xdist_group("pi05-published-plans")


def trainer_for(make_cfg, run_dir, *overrides):
    from slurmvla.trainer import Trainer

    cfg = make_cfg("checkpoint.every_steps=0", "checkpoint.resume=false", *overrides)
    return cfg, Trainer(cfg, run_dir)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# -- model states against a real single-process run --------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    ["policy=tiny"],
    ["policy=tiny", "precision=bf16"],
    # Frozen parameters stay fp32 under bf16 (only the trainable ones are lowered, their masters fp32).
    ["policy=pi05_tiny", "precision=bf16", "policy.freeze_vision_encoder=true"],
    pytest.param(["policy=pi05_tiny", "precision=bf16", "policy.lora.enabled=true"],
                 id="pi05_tiny-bf16-lora"),
], ids=lambda o: "-".join(x.split("=")[-1] for x in o) if isinstance(o, list) else None)
def test_model_states_are_the_bytes_a_real_run_holds(make_cfg, tmp_path, overrides):
    cfg, trainer = trainer_for(make_cfg, tmp_path, *overrides)
    try:
        trainer.run_step()  # AdamW's state exists after the first step
        planned = model_states(cfg, count_tensors(cfg, build_on_meta(cfg)), 1, 1).held
        policy, optimizer = trainer.policy, trainer.optimizer
        assert planned["parameters"] == nbytes(policy.parameters())
        assert planned["buffers"] == nbytes(policy.buffers())
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        assert planned["AdamW state"] == nbytes(state)
        masters = getattr(optimizer, "masters", [])  # the master-weight optimizer's fp32 copies (bf16)
        assert planned["fp32 master weights"] == nbytes(masters)
        assert (cfg.precision == "bf16") == bool(masters)
        with trainer.engine.autocast():
            out = trainer.model(trainer._next_batch())
        trainer.engine.backward(out["loss"])
        assert planned["gradients"] == nbytes(p.grad for p in policy.parameters() if p.grad is not None)
        if "policy.lora.enabled=true" in overrides:
            frozen = [p for p in policy.parameters() if not p.requires_grad]
            assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    finally:
        trainer.close()


# -- activations against a real CPU step ------------------------------------------------------------------


def real_peak(trainer, autocast, accumulating: bool) -> int:
    """Peak bytes the CPU allocator holds beyond what existed before, over one training forward + backward, from
    torch's profiler. ``accumulating``: a micro-batch after the first of an accumulation (the first one's
    gradients held); else the first (no gradient yet: the step before freed them)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    trainer.model.train()
    if accumulating:
        with autocast:
            backward(trainer.model(trainer._next_batch())["loss"])
    assert all((p.grad is not None) == accumulating for p in trainer.policy.parameters() if p.requires_grad)
    batch = trainer._next_batch()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with autocast:
            out = trainer.model(batch)
            backward(out["loss"])  # checkpointed layers recompute under the same autocast
        del out
    current = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        current += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("overrides, bound", [
    (["policy=tiny", "trainer.global_batch_size=8"], 0.01),
    # Accumulating: the gradients are resident through the second micro-batch's forward + backward.
    (["policy=tiny", "trainer.global_batch_size=8", "trainer.grad_accum_steps=2"], 0.01),
    (["policy=small", "trainer.global_batch_size=2"], 0.01),
    # bf16: the same CUDA autocast lists on both sides (the real step's CPU kernels add up to ~1 % of their own).
    (["policy=tiny", "precision=bf16", "trainer.global_batch_size=8"], 0.02),
    (["policy=pi05_tiny", "precision=bf16", "trainer.global_batch_size=4", "policy.freeze_vision_encoder=true",
      "policy.gradient_checkpointing=true"], 0.02),
], ids=["tiny-fp32", "tiny-fp32-accumulating", "small-fp32", "tiny-bf16", "pi05_tiny-bf16-frozen-checkpointing"])
def test_activations_are_what_a_real_step_allocates(make_cfg, tmp_path, overrides, bound):
    """The measured pass against a real one (the single engine makes its gradients in backward; accumulating,
    they are held), and the plan's forward + backward phase against everything a real step holds at its peak."""
    cfg, trainer = trainer_for(make_cfg, tmp_path, *overrides)
    try:
        trainer.run_step()  # the AdamW state exists from the first step on; the step freed the gradients
        accumulating = cfg.trainer.grad_accum_steps > 1
        autocast = CudaAutocast() if cfg.precision == "bf16" else contextlib.nullcontext()
        real = real_peak(trainer, autocast, accumulating)
        optimizer = trainer.optimizer
        held = nbytes([*trainer.policy.parameters(), *trainer.policy.buffers(), *getattr(optimizer, "masters", []),
                       *(v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)),
                       *(p.grad for p in trainer.policy.parameters() if p.grad is not None and accumulating)])
        planner = Planner(cfg)
        states = model_states(cfg, planner.tensors, 1, 1)
        micro = trainer.micro_batch_size
        # Byte for byte as the CPU allocates (no rounding), and as the plan reports it (CUDA's 512-byte blocks).
        planner._steps[True] = ShapeStep(cfg, planner.policy, round_to=1)
        exact = planner.measure(cfg, micro, states.compute, resident_grads=accumulating).peak_bytes
        reported = Planner(cfg).activations(cfg, micro, states.compute, resident_grads=accumulating).at(micro)
        r = fit.plan_engine(planner, cfg, GPUS["h100-80gb"], 1, 1, peak_only=True)  # its pass: the one above
        planned = sum(r["held_bytes"].values()) + sum(r["forward_backward_bytes"].values()) + exact
        print(f"{' '.join(overrides)}: real {real} B, plan {exact} B (rel {exact / real - 1:+.2e}), "
              f"reported {reported} B (rel {reported / real - 1:+.2e}); with the states {held + real} B real, "
              f"{planned} B planned")
        assert abs(exact / real - 1) < bound
        assert abs(reported / real - 1) < bound
        assert abs(planned / (held + real) - 1) < bound
    finally:
        trainer.close()


def test_activations_grow_with_the_micro_batch_and_shrink_with_checkpointing():
    cfg = compose(["policy=small", "trainer.global_batch_size=4"])
    states = model_states(cfg, Planner(cfg).tensors, 1, 1)
    full = Planner(cfg).activations(cfg, 4, states.compute)
    ckpt_cfg = compose(["policy=small", "trainer.global_batch_size=4", "policy.gradient_checkpointing=true"])
    ckpt = Planner(ckpt_cfg).activations(ckpt_cfg, 4, states.compute)
    assert full.per_sample > 0 and full.at(4) > full.at(2)
    assert ckpt.at(4) < full.at(4) / 2
    # Recomputation issues more FLOPs than the model's forward + backward; without it they are the same.
    assert ckpt.issued_flops_per_sample > ckpt.model_flops_per_sample == full.model_flops_per_sample
    assert full.issued_flops_per_sample == full.model_flops_per_sample


def test_flops_counted_on_the_meta_device_equal_the_fake_tensor_passes(monkeypatch):
    """The FLOPs are counted on a meta-device copy (cheaper); a policy the meta device cannot run falls back to
    the fake-tensor passes. Both count the same, with recomputation and without."""
    cfg = compose(["policy=pi05_tiny", "precision=bf16", "trainer.global_batch_size=4",
                   "policy.gradient_checkpointing=true"])
    compute = (torch.bfloat16, torch.bfloat16)
    meta = Planner(cfg).flops(cfg, compute)
    monkeypatch.setattr(ShapeStep, "flops_on_meta", lambda self, low: 1 / 0)
    fake = Planner(cfg).flops(cfg, compute)
    assert meta == fake and meta[1] > meta[0] > 0, (meta, fake)


def _saved_tensors_module():
    """benchmarks/saved_tensors.py, whose counter of what autograd keeps for the backward this test uses too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("saved_tensors", Path(__file__).resolve().parents[2] / "benchmarks"
                                                  / "saved_tensors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The bytes autograd keeps for the backward pass while inside: every tensor saved by any node (eager or a compiled
# region's), each storage once, less those that existed before (parameters, the batch).
Saved = _saved_tensors_module().SavedByShape


def test_a_compiled_step_saves_what_the_plan_measures_under_the_partitioner(make_cfg, tmp_path):
    """trainer.compile: the bytes a real compiled CPU step (inductor, its generated code) keeps for the backward
    are what the plan's fake step keeps with its layers traced and partitioned; both less than eager autograd
    keeps (the same fake step without compiling)."""
    overrides = ["policy=pi05_tiny", "trainer.global_batch_size=4", "policy.gradient_checkpointing=false"]
    cfg, trainer = trainer_for(make_cfg, tmp_path, *overrides, "trainer.compile=true")
    try:
        batch = trainer._next_batch()
        trainer.model.train()
        trainer.model(batch)  # compiles (the forward: its partition is made here; no backward is needed)
        known = [*trainer.policy.parameters(), *trainer.policy.buffers(),
                 *(v for v in batch.values() if torch.is_tensor(v))]
        with Saved(known) as real:
            trainer.model(batch)
    finally:
        trainer.close()
    planner = Planner(cfg)
    step = planner._step(on_meta=False)  # the compiled layers are traced on fake tensors
    for on_meta in (True, False):  # the real batch's prompt, not the longest one, in every pass
        planner._step(on_meta).sample = {k: v[:1] for k, v in batch.items()}
    states = model_states(cfg, planner.tensors, 1, 1)
    # The plan's figure, as the report names it (this also traces the layers: a trace saves for a backward of
    # its own); with trainer.compile=false, eager autograd's as before.
    acts = planner.activations(cfg, 4, states.compute, count_flops=False)
    eager_cfg = make_cfg(*overrides, "trainer.compile=false")
    eager = planner.activations(eager_cfg, 4, states.compute, count_flops=False)
    assert acts.method.startswith("measured under the compiled step's partitioner (")
    assert eager.method == "measured (meta tensors)"
    assert acts.at(4) <= eager.at(4)
    saved = {}
    for compiled in (True, False):
        with Saved([*step.policy.parameters(), *step.policy.buffers()]) as s:
            step.run(4, states.compute, False, compiled=compiled)
        saved[compiled] = s.bytes
    print(f"saved for backward: real compiled {real.bytes} B, plan compiled {saved[True]} B "
          f"(rel {saved[True] / real.bytes - 1:+.2e}), plan eager {saved[False]} B")
    assert abs(saved[True] / real.bytes - 1) < 0.02
    assert saved[True] < 0.9 * saved[False]


def test_model_flops_agree_with_the_profilers_count(make_cfg, tmp_path):
    from slurmvla.profile import count_flops_per_sample

    cfg, trainer = trainer_for(make_cfg, tmp_path, "policy=tiny")
    try:
        theirs = count_flops_per_sample(cfg, trainer._next_batch(), trainer.policy)
    finally:
        trainer.close()
    states = model_states(cfg, Planner(cfg).tensors, 1, 1)
    ours = Planner(cfg).activations(cfg, 2, states.compute).model_flops_per_sample
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_a_policy_fake_tensors_cannot_run_gets_the_analytic_estimate(monkeypatch, capsys):
    def cannot(*args, **kwargs):
        raise RuntimeError("no fake kernel for this op")

    monkeypatch.setattr(fit, "_LAST", {})  # no planner of an earlier test, with its measurements
    monkeypatch.setattr(ShapeStep, "run", cannot)
    plan.main(["policy=small", "--gpu", "h100-80gb"])
    out = capsys.readouterr().out
    assert "activations, micro-batch 16: analytic ESTIMATE" in out
    assert "meta and fake tensors failed: RuntimeError: no fake kernel for this op" in out
    cfg = compose(["policy=small"])
    assert analytic_activations(cfg, 2) == 2 * analytic_activations(cfg, 1) > 0


def test_the_autocast_lists_are_cudas():
    """Every op torch registers an AutocastCUDA kernel for is in exactly one of the plan's lists (the
    upsampling ops under their functional name, interpolate), and the lists name nothing else."""
    registered = {r.split("::")[1].split(".")[0] for r in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
    lists = (AUTOCAST_LOWER, AUTOCAST_FP32, AUTOCAST_FP32_OPT_DTYPE, AUTOCAST_PROMOTE)
    for a in range(len(lists)):
        for b in range(a + 1, len(lists)):
            assert not lists[a] & lists[b]
    ours = set().union(*lists) - {"interpolate"}
    assert registered - ours == set(), "ops CUDA autocasts that the plan does not"
    assert ours - registered == set(), "ops the plan casts that CUDA's autocast does not"


def test_the_autocast_emulation_casts_as_cuda_does():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    with CudaAutocast():
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16
        assert (x.bfloat16() @ x.T).dtype == torch.bfloat16
        assert torch.nn.functional.layer_norm(x.bfloat16(), (8,)).dtype == torch.float32
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32
        assert x.bfloat16().sum().dtype == torch.float32
        assert (x.bfloat16() + x).dtype == torch.float32  # plain type promotion, no autocast
        q, kv = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
        mask = torch.ones(1, 1, 5, 5, dtype=torch.bool)
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
        assert out.dtype == torch.bfloat16 and out.shape == (1, 4, 5, 8)


# -- per-engine rules --------------------------------------------------------------------------------------


def test_engine_rules_follow_the_shard_counts():
    cfg = compose(["policy=small", "precision=bf16", "engine=fsdp_full", "trainer.global_batch_size=8"])
    t = count_tensors(cfg, build_on_meta(cfg))
    nt = t.trainable
    per = {e: model_states(compose(["policy=small", "precision=bf16", f"engine={e}",
                                         "trainer.global_batch_size=8"]), t, 8, 8)
           for e in ("ddp", "fsdp_full", "fsdp_grad_op", "zero1", "zero2", "zero3")}
    assert per["ddp"].held["parameters"] == 2 * nt and per["ddp"].held["fp32 master weights"] == 4 * nt
    assert per["ddp"].step["fp32 copy of the gradients (master-weight optimizer)"] == 4 * nt
    # FSDP: fp32 shards, each tensor's rows rounded up per rank; no separate master.
    assert per["fsdp_full"].held["parameters"] == 4 * t.sharded(8) >= 4 * nt / 8
    assert per["fsdp_full"].held["AdamW state"] == 8 * t.sharded(8) + 4 * t.trainable_tensors
    assert t.sharded(8) - nt / 8 < sum(math.prod(s[1:]) for s, _ in t.params)  # at most one row per tensor
    assert sum(per["fsdp_grad_op"].forward_backward.values()) > sum(per["fsdp_full"].forward_backward.values())
    # ZeRO: bf16 module, fp32 partitions; gradients whole (1), partitioned (2, 3); parameters partitioned (3).
    z1, z2, z3 = per["zero1"].held, per["zero2"].held, per["zero3"].held
    assert z1["gradients"] == 2 * nt and z2["gradients"] < nt / 3 and z3["parameters"] < z2["parameters"] / 4
    assert z1["fp32 master weights"] == z2["fp32 master weights"] == 4 * t.flat_partitions(8)
    assert 0 <= t.flat_partitions(8) - nt / 8 < 2 * len(t.groups)


# -- the command line -------------------------------------------------------------------------------------


@PUBLISHED_PI05
def test_pi05_full_fine_tuning_does_not_fit_a_24gb_gpu_under_single(capsys):
    plan.main(["policy=pi05", "precision=bf16", "trainer.global_batch_size=4", "policy.gradient_checkpointing=true",
               "--gpu", "rtx4090-24gb"])
    out = capsys.readouterr().out
    assert "engine=single" in out and "3.244B parameters" in out
    assert "DOES NOT FIT" in out and "largest micro-batch that fits: none" in out
    # The model states with the optimizer step's fp32 gradient copy: 60.43 GiB, whatever the activations, so no
    # pass measures them (the eight-GPU plan below measures pi0.5's at this size).
    assert "= peak (optimizer step)" in out and "60.43" in out
    assert "activations, micro-batch 4: NOT MEASURED" in out and "alone exceed the budget" in out


@PUBLISHED_PI05
def test_pi05_on_eight_h100s_every_engine(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    plan.main(["policy=pi05", "precision=bf16", "engine=fsdp_full", "trainer.global_batch_size=32",
               "policy.gradient_checkpointing=false", "--gpu", "h100-80gb", "--nodes", "1", "--gpus-per-node", "8",
               "--compare", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "8 x h100-80gb" in out and "engine=fsdp_full" in out and "FITS" in out
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())["plans"]}
    assert set(rows) == {"ddp", "fsdp_full", "fsdp_grad_op", "hsdp", "zero1", "zero2", "zero3"}  # no single at 8
    assert not any("refused" in r for r in rows.values())
    full, ddp, zero2, zero3 = rows["fsdp_full"], rows["ddp"], rows["zero2"], rows["zero3"]
    assert full["micro_batch_size"] == 4 and all(r["fits"] for r in (full, ddp, zero2, zero3))
    assert full["peak_bytes"] < zero2["peak_bytes"] < ddp["peak_bytes"] and zero3["peak_bytes"] < zero2["peak_bytes"]
    # fp32 shards over 8 ranks against bf16 replicas: a quarter (plus each tensor's rounding).
    assert ddp["held_bytes"]["parameters"] / 4 <= full["held_bytes"]["parameters"] < ddp["held_bytes"]["parameters"] / 3.9
    assert full["time_estimate"]["model_flops_per_sample"] > 1e13  # pi0.5: ~13 TFLOP per sample


def test_a_bad_gpu_is_one_line_naming_it_and_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main(["--gpu", "h100"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu h100" in err and "'rtx4090-24gb'" in err and "'h100-80gb'" in err


@pytest.mark.parametrize("argv, words", [
    (["policy.bogus=1"], "has no option 'bogus'"),
    (["engine=zero4"], "engine=zero4 is not an option of engine"),
    (["engine=ddp", "trainer.global_batch_size=6", "--gpus-per-node", "4"], "is not divisible by world size 4"),
    (["--gpus-per-node", "2"], "engine=single runs one process"),
    (["--nodes", "0"], "--nodes 0 is not valid"),
    (["--nodes", "x"], "--nodes x is not valid"),
])
def test_usage_mistakes_are_one_line(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        plan.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and words in err, err


# -- LoRA ------------------------------------------------------------------------------------------------


def test_lora_holds_the_frozen_base_in_bf16_and_trains_the_adapters():
    base = ["policy=pi05_tiny", "precision=bf16"]
    full, lora = compose(base), compose([*base, "policy.lora.enabled=true"])
    tf = count_tensors(full, build_on_meta(full))
    tl = count_tensors(lora, build_on_meta(lora))
    assert tl.adapters > 0 and tl.frozen > 0 and tl.trainable < tf.trainable
    sf, sl = model_states(full, tf, 1, 1).held, model_states(lora, tl, 1, 1).held
    assert sl["parameters"] == 2 * (tl.trainable + tl.frozen)
    assert sl["AdamW state"] < sf["AdamW state"]


# -- several ranks --------------------------------------------------------------------------------------

DRIVER = '''
import json, os, sys, tempfile
import torch
from slurmvla.compose import compose
from slurmvla.trainer import Trainer

out = {}
for engine in ("fsdp_full", "zero2"):
    cfg = compose([*sys.argv[2:], f"engine={engine}"])
    trainer = Trainer(cfg, os.path.join(sys.argv[1], engine))
    trainer.run_step()
    opt = trainer.optimizer
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP's state is sharded DTensors
    state = sum(local(v).numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v))
    if engine == "zero2":
        ds = trainer.engine._ds.optimizer
        params = sum(t.numel() * t.element_size() for t in ds.bit16_groups_flat)
        params += sum(p.numel() * p.element_size() for p in trainer.policy.parameters() if not p.requires_grad)
        masters = sum(t.numel() * t.element_size() for t in ds.single_partition_of_fp32_groups)
    else:
        local = [p.to_local() for p in trainer.policy.parameters()]
        params = sum(t.numel() * t.element_size() for t in local)
        masters = 0
    out[engine] = {"parameters": params, "fp32 master weights": masters, "AdamW state": state}
    trainer.close(keep_process_group=True)
    del trainer
rank = torch.distributed.get_rank()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_hold_what_the_plan_says(sample_root, tmp_path):
    """fsdp_full and zero2 at world 2 (gloo, bf16): each rank's parameters, fp32 masters and AdamW state
    against the plan's worst rank."""
    overrides = [f"data.root={sample_root}", "data.num_workers=0", "logging.wandb.mode=disabled",
                 "trainer.progress_bar=false", "trainer.global_batch_size=4", "checkpoint.every_steps=0",
                 "checkpoint.resume=false", "precision=bf16", "policy=pi05_tiny", "policy.freeze_vision_encoder=true"]
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    code, log = run_until([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(driver), str(tmp_path), *overrides], 600, "the two-rank plan check")
    assert code == 0, log[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for engine in ("fsdp_full", "zero2"):
        cfg = compose([*overrides, f"engine={engine}"])
        planned = model_states(cfg, count_tensors(cfg, build_on_meta(cfg)), 2, 2).held
        for key in ("parameters", "fp32 master weights", "AdamW state"):
            assert planned[key] == max(r[engine][key] for r in ranks), (engine, key, planned[key], ranks)


def test_the_plan_runs_as_a_module_and_no_row_label_is_cut():
    """``python -m slurmvla.plan``, bf16 under single: the master-weight optimizer's row, longer than the usual label
    column, appears whole (the label is model_states' own key), and every figure ends in the same column as the
    unit's header."""
    code, log = run_until([sys.executable, "-m", "slurmvla.plan", "policy=tiny", "precision=bf16", "--gpu", "l40s-48gb"],
                          120, "python -m slurmvla.plan")
    assert code == 0, log
    assert "1 x l40s-48gb" in log and "FITS" in log
    cfg = compose(["policy=tiny", "precision=bf16"])
    label = next(k for k in model_states(cfg, count_tensors(cfg, build_on_meta(cfg)), 1, 1).step if "master-weight" in k)
    assert len(label) + len("optimizer step: ") > 64
    assert f"  optimizer step: {label} " in log, log
    lines = log.splitlines()
    header = next(ln for ln in lines if ln.startswith("per GPU (worst rank)"))
    rows = [ln for ln in lines if re.fullmatch(r"  \S.*\s\d+\.\d\d", ln)]
    assert len(rows) >= 8 and {len(ln) for ln in rows} == {len(header)}, "\n".join([header, *rows])


def test_a_refusing_engine_says_why_in_the_comparison(tmp_path, capsys):
    out = tmp_path / "p.json"
    plan.main(["policy=tiny", "policy.gradient_checkpointing=true", "--compare", "--json", str(out)])
    rows = {r["engine"]: r for r in json.loads(out.read_text())["plans"]}
    assert set(rows) == set(fit.compare_engines(1)) and [e for e, r in rows.items() if "refused" in r] == ["zero3"]
    assert "gradient_checkpointing" in rows["zero3"]["refused"] and "zero3" in capsys.readouterr().out


def test_json_has_every_figure(tmp_path, capsys):
    out = tmp_path / "p.json"
    plan.main(["--gpu", "a100-40gb", "--json", str(out)])
    data = json.loads(out.read_text())
    r = data["plans"][0]
    assert data["gpu"]["name"] == "a100-40gb" and data["gpu"]["bf16_tflops"] == 312.0
    for key in ("held_bytes", "activations", "peak_bytes", "budget_bytes", "fits", "largest_micro_batch",
                "time_estimate"):
        assert key in r
    assert Path(out).stat().st_size > 0


@pytest.mark.parametrize("overrides", [
    # The reference policy: its peak is in attention (unrouted, the meta pass's math path holds 11 % more).
    ["policy=tiny", "trainer.global_batch_size=2"],
    # pi0.5: grouped-query attention under a boolean mask, bf16 autocast, selective recomputation keeping the
    # matmuls (what the fused attention kernel saves is what that policy keeps).
    ["policy=pi05_tiny", "precision=bf16", "trainer.global_batch_size=4", "policy.gradient_checkpointing=true",
     "policy.checkpoint_saves=matmuls"],
], ids=["tiny", "pi05_tiny-bf16-matmuls"])
def test_the_meta_device_pass_holds_what_the_fake_tensor_pass_holds(overrides):
    """The plan's passes run on the meta device, whose attention is routed to the kernel the CPU runs; on fake
    CPU tensors (the compiled layers' passes, and the plan's method before) every peak is the same to the byte,
    with resident gradients and with those the backward makes. (The reference policies' meta passes are held
    against real steps above.)"""
    cfg = compose(overrides)
    planner = Planner(cfg)
    compute = model_states(cfg, planner.tensors, 1, 1).compute
    meta, fake = planner._step(on_meta=True), planner._step(on_meta=False)
    assert not meta.fake and fake.fake
    for resident in (True, False):
        got = {name: step.run(2, compute, cfg.precision == "bf16", resident_grads=resident).peak_bytes
               for name, step in (("meta", meta), ("fake", fake))}
        assert got["meta"] == got["fake"] > 0, (resident, got)
