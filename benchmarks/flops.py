"""Model FLOPs per sample at any size, without weights (the profiler's count, on the meta device).

    python benchmarks/flops.py [--policies pi0,pi05,base] [--cameras 3]

Forward + backward of one training sample under torch's FlopCounterMode, the policy and the batch
on the meta device, so full-size pi0 / pi0.5 (~3B parameters) cost no memory. Printed with the
parameter count and the ratio to the 6 x parameters x tokens rule of thumb (which ignores attention
and counts every parameter for every token; the vision tower runs once per image, the backbone once
per prefix token, the expert once per action token).
"""

from __future__ import annotations

import argparse

import torch

from slurmvla.compose import compose
from slurmvla.data.spec import DataFeatures  # noqa: F401 (import order: config before policies)
from slurmvla.profile import count_flops_per_sample


def meta_batch(cfg) -> dict:
    """One sample on the meta device, its prompt at ``max_text_len`` tokens: as the data tokenizes it, or (pi0 /
    pi0.5, whose host-side preparation cuts the prompt and pi0.5's writes it from the state) as that hands it over."""
    from slurmvla.policy import policy_class
    from slurmvla.policy.pi0.model import PROMPT_IDS, PROMPT_MASK

    p = cfg.policy
    h, s, c = p.action_horizon, p.image_size, p.num_cameras * p.num_obs_history
    text = ("text", "text_mask") if policy_class(p).prepare_inference is None else (PROMPT_IDS, PROMPT_MASK)
    with torch.device("meta"):
        return {
            "images": torch.empty(1, c, s, s, 3, dtype=torch.uint8), "image_mask": torch.ones(1, c, dtype=torch.bool),
            "state": torch.empty(1, p.num_obs_history, p.state_dim) if p.num_obs_history > 1 else torch.empty(1, p.state_dim),
            "actions": torch.empty(1, h, p.action_dim), "action_mask": torch.ones(1, h, dtype=torch.bool),
            text[0]: torch.zeros(1, p.max_text_len, dtype=torch.long),
            text[1]: torch.ones(1, p.max_text_len, dtype=torch.bool),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="pi0,pi05,base")
    args = parser.parse_args()
    from slurmvla.policy import build_policy

    for name in args.policies.split(","):
        cfg = compose([f"policy={name}", "data.num_workers=0", "logging.wandb.mode=disabled"])
        flops = count_flops_per_sample(cfg, meta_batch(cfg))
        with torch.device("meta"):
            params = sum(p.numel() for p in build_policy(cfg.policy).parameters())
        p = cfg.policy
        tokens = p.num_cameras * (p.image_size // p.patch_size) ** 2 + p.max_text_len + p.action_horizon + 1
        print(f"policy={name:5s} {params / 1e6:9.2f}M parameters, {tokens:4d} tokens: {flops / 1e9:10.3f} GFLOP per "
              f"sample (forward + backward); / (6 x params x tokens) = {flops / (6 * params * tokens):.2f}")


if __name__ == "__main__":
    main()
