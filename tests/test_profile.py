"""python -m slurmvla.profile: phases tile the step, samples are counted per optimizer step, the
slowest rank sets the throughput, and FLOPs include the backward pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from slurmvla.policy import build_policy, policy_class
from slurmvla.profile import PHASES, count_flops_per_sample, main


def _common(sample_root):
    return [f"data.root={sample_root}", "data.num_workers=0", "profile.warmup_steps=1", "profile.steps=3",
            "trainer.global_batch_size=8"]


def test_phases_accumulation_compare_json_and_plot(sample_root, tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    main([*_common(sample_root), "--json", str(out), "--plot", str(png),
          "--compare", "trainer.grad_accum_steps=1",
          "trainer.grad_accum_steps=2 precision=bf16 policy.gradient_checkpointing=true"])
    text = capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["trainer.grad_accum_steps=1",
                                          "trainer.grad_accum_steps=2 precision=bf16 policy.gradient_checkpointing=true"]
    # Each run names the recomputation it trained with (what policy.gradient_checkpointing=auto resolves to).
    assert [r["config"]["recompute"] for r in runs] == ["none", "full (inputs, every layer)"]
    assert "recompute=none;" in text and "recompute=full (inputs, every layer);" in text
    for r in runs:
        assert list(r["phases_s"]) == list(PHASES) and all(v >= 0 for v in r["phases_s"].values())
        # The phases tile the step: their sum is the step, and the table's shares add up to 100%.
        assert sum(r["phases_s"].values()) == pytest.approx(r["step_s"], rel=1e-6)
        # Throughput counts the global batch per optimizer step, whatever the accumulation.
        assert r["samples_per_s"] * r["step_s"] == pytest.approx(8)
    assert runs[1]["config"]["micro_batch_size"] == 4 and runs[1]["config"]["grad_accum_steps"] == 2
    shares = [float(line.split()[-1].rstrip("%")) for line in text.splitlines()
              if line.split() and " ".join(line.split()[:-2]) in PHASES]
    assert len(shares) == 2 * len(PHASES) and sum(shares[: len(PHASES)]) == pytest.approx(100, abs=0.5)
    assert "samples/s" in text and "ratio" in text  # the side-by-side table
    assert all(r["useful_flops_per_sample"] == r["flops_per_sample"] > 0 for r in runs)  # no prompt to cut
    assert "GFLOP on the tokens that carry data (0.0% spent on prompt padding)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flops_include_the_backward_pass(make_cfg):
    """Forward + backward of a transformer is about three forwards (backward: two matmuls per forward one)."""
    cfg = make_cfg()
    g = torch.Generator().manual_seed(0)
    p = cfg.policy
    batch = {
        "images": torch.randint(0, 256, (1, p.num_cameras, p.image_size, p.image_size, 3), generator=g, dtype=torch.uint8),
        "image_mask": torch.ones(1, p.num_cameras, dtype=torch.bool), "state": torch.randn(1, p.state_dim),
        "actions": torch.randn(1, p.action_horizon, p.action_dim), "action_mask": torch.ones(1, p.action_horizon, dtype=torch.bool),
    }
    ids, mask = policy_class(p).sample_spec(p).tokenizer("pick up the cup")  # the policy reads instructions
    batch.update(text=ids[None], text_mask=mask[None])
    total = count_flops_per_sample(cfg, batch)
    with FlopCounterMode(display=False) as fwd, torch.no_grad():
        build_policy(cfg.policy)(batch)
    assert 2.5 < total / fwd.get_total_flops() < 3.2
    # Model FLOPs: activation checkpointing's recomputation (a fourth forward) is not counted.
    cfg.policy.gradient_checkpointing = True
    assert count_flops_per_sample(cfg, batch) == total


@pytest.mark.multiproc
def test_two_ranks_report_each_rank_and_the_slowest(sample_root, tmp_path):
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "slurmvla.profile",
           *_common(sample_root), "engine=ddp", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["config"]["world_size"] == 2 and len(run["step_s_per_rank"]) == 2
    assert run["step_s"] == max(run["step_s_per_rank"])
    assert run["samples_per_s"] == pytest.approx(8 / run["step_s"])
    assert res.stdout.count("mean step per rank") == 1, "one report, from rank 0"


def test_pi05_flops_as_run_and_useful_count_the_prompt_padding_apart(make_cfg, tmp_path, monkeypatch):
    """The trainer hands the profiler batches whose prompt it already wrote (pi0.5): counted as a raw one.
    As run, every sample carries the batch's prompt width (cut to a multiple of policy.prompt_bucket);
    useful, each sample its own tokens: held to each sample counted alone, and to the first sample counted
    at the width the batch runs at. More than three widths: the polynomial read is what is held."""
    from slurmvla.planner import activations
    from slurmvla.planner.activations import count_flops
    from slurmvla.policy.pi0.model import PROMPT_MASK
    from slurmvla.profile import padding_flops
    from slurmvla.trainer import Trainer

    trainer = Trainer(make_cfg("policy=pi05_tiny", "policy.prompt_bucket=16", "trainer.max_steps=1"), tmp_path / "run")
    try:
        cfg, policy = trainer.cfg, trainer.policy
        prepared = trainer._next_batch()
        raw = next(trainer.data.iterate(0, 0))
        assert count_flops_per_sample(cfg, prepared, policy) == count_flops_per_sample(cfg, raw, policy) > 0
        counted = []
        real = activations.count_flops_of
        monkeypatch.setattr(activations, "count_flops_of", lambda c, samples, *a, **k: counted.append(len(samples))
                            or real(c, samples, *a, **k))
        executed, useful = padding_flops(cfg, raw, policy)
        monkeypatch.undo()
        assert counted == [3]  # three widths counted, the rest read off the polynomial
        lengths = [int(policy.prepare_inference({k: v[i:i + 1] for k, v in raw.items()}, bucket=1)
                                     [PROMPT_MASK].sum()) for i in range(len(raw["state"]))]
        width = prepared[PROMPT_MASK].shape[1]
        assert len(set(lengths)) > 3 and width % 16 == 0 and width >= max(lengths)
        alone = [count_flops_per_sample(cfg, {k: v[i:i + 1] for k, v in raw.items()}, policy)
                 for i in range(len(raw["state"]))]
        assert useful == pytest.approx(sum(alone) / len(alone), rel=1e-9)
        assert executed == count_flops(cfg, {k: v[:1] for k, v in prepared.items()}, issued=False)[0] > useful
    finally:
        trainer.close()
