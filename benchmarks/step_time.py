"""Training-step time of the slurmvla Trainer against a plain PyTorch loop, same model and batch.

    python benchmarks/step_time.py [--steps 30] [--repeats 3] [HYDRA_OVERRIDES ...]
    python benchmarks/step_time.py policy=small precision=bf16 trainer.global_batch_size=32   # on a GPU

Both loops run forward, backward, gradient clipping, AdamW and zero-grad on one fixed micro-batch
(data loading is left out on purpose: this measures the step). The plain loop is the reference a
user would write by hand: its own copy of the policy, ``torch.optim.AdamW`` over the same groups.
Timing alternates the two loops over several repeats and reports medians; the ratio
``trainer / plain`` is the overhead of the trainer's machinery (1.00 = none).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from slurmvla.compose import compose
from slurmvla.optim import build_adamw
from slurmvla.trainer import Trainer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(step, steps: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false",
                   "data.num_workers=0", *args.overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        batch = trainer._next_batch()
        device = trainer.device

        # The reference: the same weights in a plain fp32/autocast loop with torch's AdamW.
        plain = copy.deepcopy(trainer.policy).float()
        groups = plain.param_groups(cfg.optim.weight_decay, cfg.optim.lr, cfg.optim.backbone_lr_scale)
        opt = build_adamw(groups, cfg.optim, device)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")

        def plain_step() -> None:
            with autocast:
                loss = plain(batch)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), cfg.trainer.max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def trainer_step() -> None:
            trainer.train_step([batch])

        for fn in (plain_step, trainer_step):
            time_loop(fn, args.warmup, device)
        plain_t, trainer_t = [], []
        for _ in range(args.repeats):
            plain_t.append(time_loop(plain_step, args.steps, device))
            trainer_t.append(time_loop(trainer_step, args.steps, device))
        trainer.close()
    p, t = statistics.median(plain_t), statistics.median(trainer_t)
    params = sum(q.numel() for q in plain.parameters())
    adamw = "fused" if opt.defaults.get("fused") else "foreach"
    print(f"device={device} policy={cfg.policy.size} params={params / 1e6:.2f}M precision={cfg.precision} "
          f"micro_batch={batch['actions'].shape[0]} threads={torch.get_num_threads()} adamw={adamw} "
          f"attention={cfg.policy.attention_implementation}")
    print(f"plain PyTorch step : {p * 1e3:8.2f} ms   (median of {args.repeats} x {args.steps} steps)")
    print(f"slurmvla step      : {t * 1e3:8.2f} ms")
    print(f"ratio slurmvla / plain: {t / p:.3f}")


if __name__ == "__main__":
    main()
