"""The compute pi0.5 spends on prompt padding at DROID's prompt lengths, and what cutting it saves.

    python benchmarks/prompt_padding.py [--micro 16] [--batches 4] [--tokenizer DIR] [overrides ...]

pi0.5 writes its prompt per sample (``Task: <instruction>, State: <256-bin ids of the state>;\\nAction: ``) and
LeRobot / openpi pad it to ``max_text_len`` = 200 tokens for every sample. slurmvla cuts a batch's prompt to its
longest sample, rounded up to ``policy.prompt_bucket`` columns (32 on a GPU, 1 on the CPU). The prompts here are
the DROID-format sample's (its instructions and states, normalized by its statistics: the sample is written
into the cache on first use; ``data.root=...`` for another dataset), written by the policy's own code; the FLOPs
are model FLOPs per training sample (forward + backward) at pi0.5's published size, counted on the meta device
(no weights), micro-batches of ``--micro`` samples as the trainer draws them.

The tokenizer: the published PaliGemma tokenizer with ``--tokenizer DIR`` (a pretrained checkpoint's
``tokenizer/`` directory: what a fine-tuning run uses); without it, the byte tokenizer slurmvla uses for a
randomly initialised pi0.5 (one token per byte: longer prompts than PaliGemma's, so less padding saved).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurmvla.compose import compose  # noqa: E402
from slurmvla.planner.activations import count_flops_of  # noqa: E402
from slurmvla.policy.pi0.model import PROMPT_IDS, PROMPT_MASK  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from slurmvla.trainer import Trainer

    tok = [f"policy.tokenizer_path={args.tokenizer}"] if args.tokenizer else []
    common = ["data.num_workers=0", "logging.wandb.mode=disabled", "trainer.progress_bar=false",
              f"trainer.global_batch_size={args.micro}", *tok, *args.overrides]
    full = compose(["policy=pi05", *common])
    # The prompts, written by pi0.5's code with the data's statistics (a toy-size copy: the prompt does not
    # depend on the model's size), at the published max_text_len.
    small = compose(["policy=pi05_tiny", f"policy.max_text_len={full.policy.max_text_len}",
                     f"policy.action_horizon={full.policy.action_horizon}", "trainer.max_steps=1", *common])
    with tempfile.TemporaryDirectory() as run:
        trainer = Trainer(small, Path(run))
        try:
            policy, batches = trainer.policy, trainer.data.iterate(0, 0)
            raw = [next(batches) for _ in range(args.batches)]
        finally:
            trainer.close()
    lengths: list[int] = []
    widths: dict[str, list[int]] = {"pad": [], "32": [], "1": []}
    with torch.no_grad():
        for batch in raw:
            alone = [policy.prepare_inference({k: v[i:i + 1] for k, v in batch.items()}, bucket=1)
                     for i in range(len(batch["state"]))]
            own = [int(a[PROMPT_MASK].sum()) for a in alone]
            lengths += own
            widths["pad"].append(full.policy.max_text_len)
            for bucket in (32, 1):
                widths[str(bucket)].append(policy.prepare_inference(batch, bucket=bucket)[PROMPT_MASK].shape[1])
    template = policy.prepare_inference({k: v[:1] for k, v in raw[0].items()}, bucket=1)

    def at(width: int) -> dict:
        one = dict(template)
        one[PROMPT_IDS] = torch.zeros(1, width, dtype=torch.long)
        one[PROMPT_MASK] = torch.ones(1, width, dtype=torch.bool)
        return one

    # A forward + backward's FLOPs are a degree-2 polynomial in the prompt's width (slurmvla.profile.padding_flops):
    # three widths counted at the published size, every other read off the polynomial through them.
    from slurmvla.profile import quadratic_through

    points = sorted({min(lengths), full.policy.max_text_len, (min(lengths) + full.policy.max_text_len) // 2})
    counted = [f for f, _ in count_flops_of(full, [at(w) for w in points], issued=False)]

    def flops(width: int) -> float:
        return quadratic_through([float(p) for p in points], counted, float(width))

    rows = [("LeRobot / openpi: every prompt padded to max_text_len", widths["pad"]),
            ("slurmvla on a GPU: the batch's longest, bucket 32", widths["32"]),
            ("slurmvla on the CPU: the batch's longest, bucket 1", widths["1"])]
    useful = sum(flops(n) for n in lengths) / len(lengths)
    print(f"pi0.5 (published size), {full.policy.num_cameras} cameras at {full.policy.image_size} px; "
          f"{len(lengths)} DROID-sample prompts ({'tokenizer ' + str(args.tokenizer) if args.tokenizer else 'byte tokenizer'}): "
          f"{min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.1f}; micro-batch {args.micro}")
    print(f"{'prompt width':55s} {'mean tokens':>11s} {'GFLOP/sample':>13s} {'vs padded':>9s} {'on padding':>10s}")
    base = sum(flops(w) for w in widths["pad"]) / len(widths["pad"])
    for label, ws in rows:
        f = sum(flops(w) for w in ws) / len(ws)
        print(f"{label:55s} {sum(ws) / len(ws):11.1f} {f / 1e9:13.1f} {f / base:9.3f} {100 * (1 - useful / f):9.1f}%")
    print(f"{'useful: each sample its own tokens':55s} {sum(lengths) / len(lengths):11.1f} {useful / 1e9:13.1f} "
          f"{useful / base:9.3f} {0.0:9.1f}%")


if __name__ == "__main__":
    main()
