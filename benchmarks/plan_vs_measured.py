"""``python -m slurmvla.plan``'s figures against what one GPU allocates, for the same configuration (world 1).

    python benchmarks/plan_vs_measured.py policy=pi05 precision=bf16 --sizes 4 16                         # on a GPU
    python benchmarks/plan_vs_measured.py policy=pi05 precision=bf16 policy.lora.enabled=true --sizes 4 16

For each micro-batch size: the plan's peak (model states, transients, the activations it measures on fake
tensors) against ``torch.cuda.max_memory_allocated`` over real training steps (``Trainer.train_step`` on the
configuration's own batch tiled to the size: forward, backward, clip, optimizer), and the error. The plan fills
the prompt to policy.max_text_len (the worst case); for a policy with a prompt it is planned at the measured
batches' own prompt length too, so the error splits into the prompt's share and the rest. Between the two sizes,
the per-sample slope of each (the activations' growth: the plan's extrapolation to its largest micro-batch rests
on it). The GPU model is read from the device's name (``--gpu`` overrides it).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from max_micro_batch import prompt_length, tile, try_size  # noqa: I001 (a sibling script)

from slurmvla.compose import compose
from slurmvla.planner.fit import plan_engine, planner_for
from slurmvla.planner.gpus import GPUS
from slurmvla.trainer import Trainer

GiB = 2**30


def gpu_model(name: str, memory_bytes: int) -> str:
    """The table's entry of this device's family (in its name) with the nearest memory (A100 40 / 80 GB)."""
    family = [g for key, g in GPUS.items() if key.split("-")[0] in name.lower().replace(" ", "")]
    if not family:
        raise SystemExit(f"no entry of the planner's GPU table matches {name!r}; give --gpu one of {list(GPUS)}")
    return min(family, key=lambda g: abs(g.memory_bytes - memory_bytes)).name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16], help="micro-batch sizes measured")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per size (after one warm-up)")
    parser.add_argument("--gpu", help="the plan's GPU model (default: read from the device)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this compares against a GPU's allocator: run it where CUDA is (tests/planner/test_plan.py "
                         "validates the plan against CPU runs)")
    gpu = GPUS[args.gpu or gpu_model(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)]
    base = ["logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false", "data.num_workers=0",
            "trainer.device=cuda", *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(compose([*base, f"trainer.global_batch_size={max(args.sizes)}"]), run_dir)
        batch = trainer._next_batch()
        # The prompt the GPU trains on (after the policy's host part: written, cut to its bucket); the plan fills
        # policy.max_text_len, the worst case. Planned at both, the error splits into the prompt's share and the rest.
        prompt = prompt_length(batch)
        at_prompt = [f"policy.max_text_len={prompt}"] if prompt and prompt < getattr(trainer.cfg.policy, "max_text_len", 0) else []
        for size in args.sizes:
            cfg = compose([*base, f"trainer.global_batch_size={size}"])
            plan = plan_engine(planner_for(cfg), cfg, gpu, 1, 1, 0.0, 0.4)
            if at_prompt:
                short = compose([*base, f"trainer.global_batch_size={size}", *at_prompt])
                plan["at_prompt_bytes"] = plan_engine(planner_for(short), short, gpu, 1, 1, 0.0, 0.4)["peak_bytes"]
            measured = try_size(trainer, tile(batch, size) if len(batch["actions"]) != size else batch, size, args.steps)
            rows.append((size, plan, measured))
        trainer.close()
    print(f"plan vs {torch.cuda.get_device_name()} ({gpu.name}), {' '.join(args.overrides)}")
    if at_prompt:
        print(f"the measured batches' prompt: {prompt} tokens; 'at prompt' plans with {at_prompt[0]}")
    print(f"{'micro':>6s} {'plan GiB':>9s} {'measured GiB':>13s} {'error':>8s} {'at prompt':>10s} {'error':>8s}  "
          "plan's peak phase")
    for size, plan, measured in rows:
        if measured is None:
            print(f"{size:6d} {plan['peak_bytes'] / GiB:9.2f} {'OOM':>13s}")
            continue
        got = measured["allocated_gib"] * GiB
        short = plan.get("at_prompt_bytes")
        tail = f"{short / GiB:10.2f} {(short - got) / got:+8.1%}" if short else f"{'-':>10s} {'-':>8s}"
        print(f"{size:6d} {plan['peak_bytes'] / GiB:9.2f} {got / GiB:13.2f} {(plan['peak_bytes'] - got) / got:+8.1%} "
              f"{tail}  {plan['peak_phase']}")
    ok = [(s, p, m) for s, p, m in rows if m is not None]
    if len(ok) >= 2:
        (s0, p0, m0), (s1, p1, m1) = ok[0], ok[-1]
        plan_slope = (p1["peak_bytes"] - p0["peak_bytes"]) / (s1 - s0)
        measured_slope = (m1["allocated_gib"] - m0["allocated_gib"]) * GiB / (s1 - s0)
        print(f"peak per added sample between micro-batch {s0} and {s1}: plan {plan_slope / GiB:.3f} GiB, measured "
              f"{measured_slope / GiB:.3f} GiB (the plan's activations per sample: "
              f"{p1['activations']['per_sample_bytes'] / GiB:.3f} GiB; the slopes are the activations' where both "
              "sizes peak in forward + backward)")
        print(f"the plan's largest micro-batch on this GPU (no allocator margin): {ok[-1][1]['largest_micro_batch']}")


if __name__ == "__main__":
    main()
