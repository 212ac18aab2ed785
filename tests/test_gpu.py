"""The GPU path on a real GPU: single-GPU debug mode, bf16 with fp32 masters, fused AdamW, CUDA RNG in
checkpoints, CUDA-event profiling, NCCL process groups, FSDP2 on CUDA, export to the CPU.

Marked ``gpu``; they are part of the README's test command, so they run wherever a GPU exists. Without
CUDA they run in their CPU mode: the same code on the CPU, which checks the tests themselves (the driver,
fixtures and references they share with the rest of the suite) so that they cannot rot unseen; it proves
nothing about CUDA, and the CUDA-only assertions and tests are left out. The suite (CI) runs the cheap
ones so; those that take half a minute or more on the CPU (marked ``slow``) skip there unless
``SLURMVLA_GPU_TESTS_ON_CPU=1``, which runs all of them on the CPU, on a GPU machine too.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slurmvla.checkpoint import load_model_file, resolve_checkpoint
from slurmvla.compose import compose
from slurmvla.config import OptimConfig
from slurmvla.engine.precision import MasterWeightOptimizer, check_fp32_master_state
from slurmvla.export import export
from slurmvla.optim import build_adamw
from slurmvla.policy import build_policy
from slurmvla.trainer import Trainer
from tests.conftest import rel_l2, run_train

ALL_ON_CPU = os.environ.get("SLURMVLA_GPU_TESTS_ON_CPU") == "1"
CUDA = torch.cuda.is_available() and not ALL_ON_CPU
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.gpu
# The tests that take half a minute or more on the CPU (300 demo steps in bf16: ~140 CPU-s; two training processes:
# ~25 CPU-s), also marked slow: on a GPU, or on the CPU when asked for; the suite's CPU mode leaves them out.
slow_on_the_cpu = pytest.mark.skipif(not (CUDA or ALL_ON_CPU),
                                     reason="slow on the CPU; SLURMVLA_GPU_TESTS_ON_CPU=1 runs it there")
REPO = Path(__file__).resolve().parents[1]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
@slow_on_the_cpu
def test_debug_mode_on_one_gpu_learns_in_bf16_with_fp32_masters_and_state(tmp_path):
    """The demo's main job (experiment=demo, its sample data), shortened, in bf16 on one GPU."""
    cfg = compose(["experiment=demo", "trainer.max_steps=300", f"trainer.device={DEVICE}", "precision=bf16",
                   "logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.every_steps=0",
                   "trainer.val_every_steps=0"])
    trainer = Trainer(cfg, tmp_path)
    try:
        trainer.fit()
        assert trainer.device.type == DEVICE
        live = [p for p in trainer.policy.parameters() if p.requires_grad]
        assert {p.dtype for p in live} == {torch.bfloat16} and {p.device.type for p in live} == {DEVICE}
        assert isinstance(trainer.optimizer, MasterWeightOptimizer)
        assert {(m.dtype, m.device.type) for m in trainer.optimizer.masters} == {(torch.float32, DEVICE)}
        moments = [v for s in trainer.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and {(v.dtype, v.device.type) for v in moments} == {(torch.float32, DEVICE)}
        check_fp32_master_state(trainer.optimizer)
        if CUDA:
            # Fused AdamW on CUDA (optim.fused=auto), and the batch arrived from pinned memory.
            assert trainer.optimizer.inner.defaults.get("fused") is True
        # The exported state is fp32 and on the CPU, for any consumer.
        state = trainer.engine.model_state_dict()
        assert {(v.device.type, v.dtype) for v in state.values() if v.is_floating_point()} == {("cpu", torch.float32)}
    finally:
        trainer.close()
    history = losses(tmp_path)
    # On the CPU the demo's loss goes from ~1.7 at step 25 to ~0.36 at step 300.
    assert history[-1] < 0.5 * history[0], history


def _common(root: Path) -> list[str]:
    return [f"data.root={root}", "data.loader=map", "data.num_workers=0", "logging.wandb.mode=disabled",
            "trainer.progress_bar=false", "trainer.global_batch_size=8", "optim.lr=1e-3", f"trainer.device={DEVICE}"]


def test_resume_on_cuda_repeats_the_uninterrupted_run(sample_root, tmp_path):
    """Resume carries the CUDA RNG state. With trainer.deterministic=true (cuBLAS workspace fixed,
    deterministic kernels where torch has them) the resumed run repeats the uninterrupted one; the
    bound is 1e-6 relative rather than bitwise because some CUDA backward kernels (atomics in
    attention / embedding backward) have no deterministic variant and only warn."""
    # A fresh process (cuBLAS reads its workspace setting once): an uninterrupted run, then one that
    # stops at step 10 with a checkpoint and a second Trainer on the same run directory resumes.
    spec = {"out": str(tmp_path), "base": [*_common(sample_root), "trainer.max_steps=20", "checkpoint.every_steps=10",
                                           "trainer.deterministic=true"],
            "runs": [{"name": "straight"}, {"name": "half", "dir": "resumed", "stop_at": 10}, {"name": "resumed"}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    res = subprocess.run([sys.executable, str(REPO / "tests" / "dist_driver.py"), str(tmp_path / "spec.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text())["resumed_from"]
    a = load_file(str(tmp_path / "straight.safetensors"))
    b = load_file(str(tmp_path / "resumed.safetensors"))
    gap = rel_l2(b, a)
    print(f"resume on {DEVICE}: relative L2 gap {gap:.2e} (bitwise: {all(torch.equal(a[k], b[k]) for k in a)})")
    assert gap < 1e-6


@pytest.mark.slow
@slow_on_the_cpu
@pytest.mark.parametrize("engine", ["ddp", "fsdp_full"])
def test_nccl_engines_at_world_one_match_the_single_engine(engine, sample_root, tmp_path):
    common = [*_common(sample_root), "trainer.max_steps=10", "checkpoint.every_steps=0"]
    backend = ["engine.backend=nccl"] if CUDA else []
    run_train([*common, f"hydra.run.dir={tmp_path / 'single'}"])
    run_train([*common, f"engine={engine}", *backend, f"hydra.run.dir={tmp_path / engine}"], nproc=1)
    gap = rel_l2(load_model_file(resolve_checkpoint(tmp_path / engine)),
                 load_model_file(resolve_checkpoint(tmp_path / "single")))
    # fp32, the same math at world 1; TF32 is off by default for matmuls in torch.
    assert gap < 1e-5, gap


class AdamWByHand:
    """AdamW's update written out (decoupled weight decay, bias-corrected moments), for the CPU mode."""

    def __init__(self, params, cfg: OptimConfig):
        self.params, self.cfg, self.t = list(params), cfg, 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        (b1, b2), lr, self.t = self.cfg.betas, self.cfg.lr, self.t + 1
        for p, m, v in zip(self.params, self.m, self.v):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.mul_(1 - lr * self.cfg.weight_decay)
            p.sub_(lr * (m / (1 - b1 ** self.t)) / ((v / (1 - b2 ** self.t)).sqrt() + self.cfg.eps))

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None


def test_fused_adamw_is_chosen_on_cuda_and_equals_the_unfused_one():
    torch.manual_seed(0)
    device = torch.device(DEVICE)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    models = {k: copy.deepcopy(base) for k in ("fused", "plain")}
    opts = {}
    for k, m in models.items():
        groups = [{"name": "all", "params": list(m.parameters()), "param_names": [n for n, _ in m.named_parameters()]}]
        cfg = OptimConfig(lr=1e-3, fused="auto" if k == "fused" else "false")
        # On the CPU "auto" is torch's foreach kernel, the one optim.fused=false picks: the reference is AdamW by hand.
        opts[k] = build_adamw(groups, cfg, device) if CUDA or k == "fused" else AdamWByHand(m.parameters(), cfg)
    if CUDA:
        assert opts["fused"].defaults.get("fused") is True and not opts["plain"].defaults.get("fused")
    else:
        assert opts["fused"].defaults.get("foreach") is True and not opts["fused"].defaults.get("fused")
    for step in range(20):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device)
        for k, m in models.items():
            m(x).square().mean().backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
    a = {n: p.detach() for n, p in models["fused"].named_parameters()}
    b = {n: p.detach() for n, p in models["plain"].named_parameters()}
    # The fused kernel computes the same update in another order: ~1e-7 relative after 20 steps.
    assert rel_l2(a, b) < 1e-5


def test_cuda_event_phases_tile_the_step_and_report_memory_and_mfu(sample_root, tmp_path, capsys):
    from slurmvla.profile import main

    out = tmp_path / "p.json"
    main([f"data.root={sample_root}", "data.num_workers=0", f"trainer.device={DEVICE}", "precision=bf16",
          "profile.warmup_steps=2", "profile.steps=5", "profile.peak_tflops=100", "--json", str(out)])
    (report,) = json.loads(out.read_text())["runs"]
    assert report["config"]["device"] == DEVICE
    assert sum(report["phases_s"].values()) == pytest.approx(report["step_s"], rel=1e-6)
    assert report["phases_s"]["forward"] > 0 and report["phases_s"]["backward"] > 0
    if CUDA:
        assert 0 < report["peak_allocated_bytes"] <= report["peak_reserved_bytes"]
        assert 0 < report["mfu"] < 1
    print(capsys.readouterr().out)


def test_a_gpu_run_exports_a_file_the_cpu_loads_and_predicts_with(make_cfg, tmp_path):
    cfg = make_cfg(f"trainer.device={DEVICE}", "trainer.max_steps=5", "checkpoint.every_steps=0")
    trainer = Trainer(cfg, tmp_path / "run")
    try:
        trainer.fit()
        batch = trainer._next_batch()
        trainer.policy.eval()
        noise = torch.randn(batch["actions"].shape, generator=torch.Generator().manual_seed(0))
        on_gpu = trainer.policy.sample_actions(batch, noise=noise.to(trainer.device))
    finally:
        trainer.close()
    path = export(tmp_path / "run", tmp_path / "policy.safetensors")
    weights = load_file(str(path))  # loads with no GPU in the process's way: every tensor on the CPU
    assert {v.device.type for v in weights.values()} == {"cpu"}
    cpu_policy = build_policy(cfg.policy)
    cpu_policy.load_state_dict(weights, strict=True)
    cpu_batch = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    on_cpu = cpu_policy.eval().sample_actions(cpu_batch, noise=noise)
    assert on_gpu.device.type == DEVICE
    # Another device's kernels: fp32, ten integration steps; agreement to ~1e-5 of the action scale.
    assert torch.allclose(on_cpu, on_gpu.cpu(), rtol=1e-3, atol=1e-4)


def test_the_server_runs_the_policy_on_the_gpu_in_bf16_close_to_the_cpu(trained_run):
    """serve.device=cuda with precision=bf16 (autocast): the chunk the GPU serves agrees with the fp32 CPU
    chunk for the same observation and seed, to bf16's resolution over ten integration steps."""
    import numpy as np

    from slurmvla.inference.build import build_runner
    from tests.inference.test_serve import droid_obs

    chunks = {}
    for device, precision in (("cpu", "fp32"), (DEVICE, "bf16")):
        runner = build_runner(str(trained_run), [f"precision={precision}"], device=device)
        assert runner.device.type == device
        if CUDA and precision == "bf16":
            assert runner.autocast is not None
        obs = droid_obs(9)
        chunks[precision] = runner.infer(obs)["actions"]
    scale = np.abs(chunks["fp32"]).max()
    assert np.abs(chunks["bf16"] - chunks["fp32"]).max() < 0.05 * scale


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled_graph"])
def test_cuda_graph_inference_equals_eager(compiled):
    """serve.cuda_graph (and serve.compile), with the server's fused projections: sample_actions replayed
    from a CUDA graph gives eager mode's actions (unfused), in bf16 to its resolution; a second prompt length
    captures a second graph, and each input shape replays its own. Without a GPU the option is refused with
    the reason."""
    from slurmvla.inference.graphs import GraphedSampler
    from slurmvla.inference.optimize import fuse_projections, lower_weights
    from tests.policy.test_pi0 import B, batch_for, perturbed_policy

    cfg, policy = perturbed_policy("pi05_tiny")
    if not CUDA:
        with pytest.raises(ValueError, match=r"cuda_graph replays CUDA graphs and needs the policy on a GPU"):
            GraphedSampler(policy)
        return
    policy.to(DEVICE)
    lower_weights(policy, torch.bfloat16)
    plain = copy.deepcopy(policy)
    fuse_projections(policy)
    sampler = GraphedSampler(policy, compile=compiled)
    batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch_for(cfg).items()}
    longer = {**batch, "instruction": [t + " and then" + " again" * 40 for t in batch["instruction"]]}
    for b in (batch, longer, batch):
        noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim, device=DEVICE)
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            eager = plain.sample_actions(b, noise=noise)
            graphed = sampler.sample_actions(b, noise=noise)
        scale = eager.abs().max()
        assert (graphed - eager).abs().max() <= 0.02 * scale, (graphed - eager).abs().max()
    assert len(sampler.graphs) == 2


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="float8 matrix products need compute capability 8.9 or above")
def test_the_fp8_prefix_served_compiled_and_graphed_stays_near_bf16():
    """serve.fp8_prefix as the server runs it (bf16 weights, the prefix quantized, projections fused, compiled and
    replayed from a CUDA graph, bf16 autocast) against the bf16 policy eager, on 102 observations: within 2 % of
    the actions' largest value, as the graphed bf16 modes are held (tests/inference/test_fp8.py holds the same float8
    products to 1 % of the spread on the CPU)."""
    from slurmvla.inference.fp8 import check_fp8, quantize_prefix
    from slurmvla.inference.graphs import GraphedSampler
    from slurmvla.inference.optimize import fuse_projections, lower_weights
    from tests.policy.test_pi0 import B, batch_for, perturbed_policy

    cfg, policy = perturbed_policy("pi05_tiny")
    policy.to(DEVICE)
    lower_weights(policy, torch.bfloat16)
    plain = copy.deepcopy(policy)
    check_fp8(policy, torch.device(DEVICE))
    assert quantize_prefix(policy) > 0
    fuse_projections(policy)
    sampler = GraphedSampler(policy, compile=True)
    worst = 0.0
    for i in range(34):
        batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch_for(cfg, seed=i).items()}
        noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim, device=DEVICE)
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            eager = plain.sample_actions(batch, noise=noise)
            fp8 = sampler.sample_actions(batch, noise=noise)
        worst = max(worst, float((fp8 - eager).abs().max() / eager.abs().max()))
    assert 0 < worst <= 0.02, worst


@pytest.mark.skipif(not CUDA, reason="CUDA graphs exist on a GPU only")
@pytest.mark.parametrize("trained_for_delays", [False, True], ids=["guidance", "prefix"])
def test_rtc_requests_replay_one_graph_whatever_the_delay(trained_for_delays):
    """A real-time chunking request under serve.cuda_graph: its previous chunk and delay are static tensors, so
    every delay replays one graph (guidance's backward pass captured inside it, or training-time RTC's prefix),
    and the chunk is eager mode's."""
    from slurmvla.config.policy import RTCTrainingConfig
    from slurmvla.inference.graphs import GraphedSampler
    from slurmvla.policy.rtc import Guidance
    from tests.policy.test_pi0 import B, batch_for, perturbed_policy

    over = {"rtc_training": RTCTrainingConfig(max_delay=3)} if trained_for_delays else {}
    cfg, policy = perturbed_policy("pi05_tiny", **over)
    policy.to(DEVICE)
    sampler = GraphedSampler(policy)
    batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch_for(cfg).items()}
    prev = torch.randn(B, cfg.action_horizon, cfg.action_dim, device=DEVICE)
    for d in (0, 2, 3):
        rtc = Guidance(prev, torch.full((B,), d, device=DEVICE), torch.full((B,), 6, device=DEVICE))
        noise = torch.randn(B, cfg.action_horizon, cfg.max_action_dim, device=DEVICE)
        eager = policy.sample_actions(policy.prepare_inference(batch), noise=noise, rtc=rtc)
        graphed = sampler.sample_actions(batch, noise, rtc=rtc)
        assert (graphed - eager).abs().max() <= 1e-3 * eager.abs().max()
        assert torch.equal(graphed[:, :d], prev[:, :d])
    assert len(sampler.graphs) == 1 and not sampler.eager


@pytest.mark.skipif(not CUDA, reason="host-device synchronisation exists on a GPU only")
@pytest.mark.parametrize("policy", ["pi05_tiny", "tiny"])
def test_a_training_step_never_waits_on_the_gpu(policy, make_cfg, tmp_path):
    """Issue #35's rule for the step: nothing in it synchronises the host with the GPU (torch's sync debug
    mode raises at the first synchronising call: a copy to the host, .item(), a data-dependent shape)."""
    trainer = Trainer(make_cfg(f"policy={policy}", "trainer.device=cuda", "precision=bf16", "trainer.max_steps=4"),
                      tmp_path / "run")
    try:
        batches = [[trainer._next_batch()] for _ in range(3)]  # the host part and the copy: before the step
        trainer.train_step(batches[0])  # the first step checks the batch's fields across ranks and the state's dtypes
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for micro in batches[1:]:
                trainer.train_step(micro)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    finally:
        trainer.close()
