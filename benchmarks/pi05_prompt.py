"""Cost of pi0.5's discrete-state prompt, written and tokenized by the policy in every forward
(the state's bins need the policy's statistics), against the forward it sits in.

    python benchmarks/pi05_prompt.py [--batch 32] [--repeats 20]

Prints milliseconds per batch for building + tokenizing the prompts (with a Hugging Face fast
tokenizer from tests/golden/lerobot061/tokenizer, as a pretrained run uses) and for the whole
training forward of pi05_tiny on the same batch, and their ratio (CPU; on a GPU the prompt step also
copies the state to the host once per forward).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml

from slurmvla.policy import build_policy
from slurmvla.policy.pi0.config import Pi05Config

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    raw = {k: v for k, v in yaml.safe_load((REPO / "conf" / "policy" / "pi05_tiny.yaml").read_text()).items()
           if k != "defaults"}
    cfg = Pi05Config(**{**raw, "tokenizer_path": str(REPO / "tests" / "golden" / "lerobot061" / "tokenizer")})
    policy = build_policy(cfg).eval()
    b, h = args.batch, cfg.action_horizon
    g = torch.Generator().manual_seed(0)
    batch = {"images": torch.randint(0, 256, (b, 3, 180, 320, 3), dtype=torch.uint8, generator=g),
             "image_mask": torch.ones(b, 3, dtype=torch.bool), "state": torch.randn(b, 8, generator=g),
             "actions": torch.randn(b, h, 8, generator=g), "action_mask": torch.ones(b, h, dtype=torch.bool),
             "noise": torch.randn(b, h, 32, generator=g), "time_u": torch.rand(b, generator=g),
             "instruction": ["pick up the red block and put it in the bowl"] * b}

    def timed(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            fn()
        return (time.perf_counter() - t0) / args.repeats * 1e3

    with torch.no_grad():
        prompt = timed(lambda: policy._text(batch))
        forward = timed(lambda: policy(batch))
    print(f"batch {b}: prompt build + tokenize {prompt:.2f} ms | pi05_tiny forward {forward:.1f} ms | "
          f"prompt / forward {prompt / forward:.3f}")


if __name__ == "__main__":
    main()
