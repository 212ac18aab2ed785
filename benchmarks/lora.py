"""LoRA against full fine-tuning, same policy, data and batch, measured in one run: trainable parameters,
checkpoint size, optimizer state, step time and peak memory.

    python benchmarks/lora.py [--steps 10] [HYDRA_OVERRIDES ...]
    python benchmarks/lora.py policy=pi05_tiny
    python benchmarks/lora.py policy=small trainer.global_batch_size=8
    python benchmarks/lora.py policy=pi05 precision=bf16 trainer.global_batch_size=16 policy.gradient_checkpointing=true  # a GPU

Each variant runs in a process of its own (peak memory is the variant's) through ``slurmvla.profile`` (the
trainer's own step, warm-up steps untimed), then writes one checkpoint: the sizes are the files a run keeps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from slurmvla.checkpoint import checkpoint_bytes
from slurmvla.compose import compose
from slurmvla.profile import profile_run
from slurmvla.trainer import Trainer

VARIANTS = {"full": [], "lora": ["policy.lora.enabled=true"]}


def measure(overrides: list[str], steps: int, root: Path) -> dict:
    cfg = compose([*overrides, f"profile.steps={steps}", "profile.warmup_steps=2", "logging.wandb.mode=disabled",
                   "trainer.progress_bar=false"])
    report = profile_run(cfg, root / "profile")
    trainer = Trainer(compose([*overrides, "trainer.max_steps=1", "logging.wandb.mode=disabled",
                               "trainer.progress_bar=false"]), root / "checkpoint")
    trainable = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.policy.parameters())
    trainer.fit()  # one step: Adam's state exists from the first step on
    optimizer_state = sum(v.numel() * v.element_size() for s in trainer.optimizer.state.values()
                          for v in s.values() if hasattr(v, "numel"))
    checkpoint = trainer.checkpoints.latest()
    trainer.close()
    return {"trainable": trainable, "total": total, "checkpoint_bytes": checkpoint_bytes(checkpoint),
            "optimizer_state_bytes": optimizer_state, "step_s": report["step_s"],
            "samples_per_s": report["samples_per_s"],
            "peak_bytes": report.get("peak_allocated_bytes", report["peak_rss_bytes"]),
            "peak_kind": "GPU allocated" if "peak_allocated_bytes" in report else "process RSS"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # one variant, in this process
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory() as tmp:
            row = measure([*args.overrides, *VARIANTS[args.variant]], args.steps, Path(tmp))
        print("RESULT " + json.dumps(row))
        return
    rows = {}
    for name in VARIANTS:  # each in a process of its own: a process's peak memory is its own variant's
        out = subprocess.run([sys.executable, __file__, "--variant", name, "--steps", str(args.steps), *args.overrides],
                             capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            sys.exit(f"the {name} variant failed:\n{out.stderr[-3000:]}")
        rows[name] = json.loads(lines[-1][len("RESULT "):])
    full, lora = rows["full"], rows["lora"]
    print(f"LoRA vs full fine-tuning ({' '.join(args.overrides) or 'defaults'}; {args.steps} timed steps each)")
    print(f"{'':24s}{'full':>16s}{'lora':>16s}{'lora / full':>14s}")
    for key, label, fmt in (("trainable", "trainable parameters", "{:,.0f}"), ("total", "parameters", "{:,.0f}"),
                            ("checkpoint_bytes", "checkpoint MiB", "{:.2f}"),
                            ("optimizer_state_bytes", "optimizer state MiB", "{:.2f}"),
                            ("step_s", "step ms", "{:.1f}"), ("samples_per_s", "samples/s", "{:.1f}"),
                            ("peak_bytes", f"peak MiB ({full['peak_kind']})", "{:.0f}")):
        scale = 1 / 2**20 if key.endswith("bytes") else 1000 if key == "step_s" else 1
        a, b = full[key] * scale, lora[key] * scale
        print(f"{label:24s}{fmt.format(a):>16s}{fmt.format(b):>16s}{b / a:>14.3f}")


if __name__ == "__main__":
    main()
