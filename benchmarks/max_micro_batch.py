"""The largest micro-batch one training step fits in, and its peak memory and throughput.

    python benchmarks/max_micro_batch.py policy=base precision=bf16                 # on a GPU
    python benchmarks/max_micro_batch.py --limit 64 policy=tiny                     # anywhere (no OOM on CPU)

Builds the Trainer for the given overrides, takes one real batch and tiles it to the size under
test (so any size can be tried whatever the dataset), and runs full training steps (forward,
backward, clip, optimizer) through ``Trainer.train_step``: doubling until a CUDA out-of-memory
error or ``--limit``, then bisecting between the last size that fit and the first that did not.
Prints, per size tried, ms/step, samples/s and peak allocated / reserved memory.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from slurmvla.compose import compose
from slurmvla.trainer import Trainer


def prompt_length(batch: dict) -> int | None:
    """Tokens in a prepared batch's prompt (pi0 / pi0.5: written and cut to its bucket by the policy's host part;
    other policies: the tokenized text), None for a policy without one."""
    ids = next((batch[k] for k in ("prompt_ids", "text") if torch.is_tensor(batch.get(k))), None)
    return None if ids is None else ids.shape[-1]


def tile(batch: dict, size: int) -> dict:
    n = len(batch["actions"])
    index = torch.arange(size) % n
    return {k: v[index.to(v.device)] if torch.is_tensor(v) else [v[i] for i in index.tolist()] for k, v in batch.items()}


def try_size(trainer: Trainer, batch: dict, size: int, steps: int) -> dict | None:
    """ms/step and peak memory at micro-batch ``size``, or None when it does not fit."""
    cuda = trainer.device.type == "cuda"
    big = tile(batch, size)
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(trainer.device)
        trainer.train_step([big])  # warmup: allocator, kernels, optimizer state
        if cuda:
            torch.cuda.synchronize(trainer.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.train_step([big])
        if cuda:
            torch.cuda.synchronize(trainer.device)
        step_s = (time.perf_counter() - t0) / steps
    except torch.cuda.OutOfMemoryError:
        trainer.optimizer.zero_grad(set_to_none=True)
        return None
    out = {"size": size, "step_ms": step_s * 1e3, "samples_per_s": size / step_s}
    if cuda:
        out["allocated_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        out["reserved_gib"] = torch.cuda.max_memory_reserved(trainer.device) / 2**30
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=8)
    parser.add_argument("--limit", type=int, default=4096, help="largest size tried")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per size")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false",
                   "data.num_workers=0", "trainer.global_batch_size=8", *args.overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        batch = trainer._next_batch()
        print(f"device={trainer.device} policy={cfg.policy.size} precision={cfg.precision} "
              f"attention={cfg.policy.attention_implementation} checkpointing={cfg.policy.gradient_checkpointing}")
        fits, fails, size = None, None, args.start
        while size <= args.limit:
            result = try_size(trainer, batch, size, args.steps)
            print(result if result else {"size": size, "fits": False}, flush=True)
            if result is None:
                fails = size
                break
            fits, size = result, size * 2
        while fits and fails and fails - fits["size"] > max(1, fits["size"] // 16):
            mid = (fits["size"] + fails) // 2
            result = try_size(trainer, batch, mid, args.steps)
            print(result if result else {"size": mid, "fits": False}, flush=True)
            fits, fails = (result, fails) if result else (fits, mid)
        trainer.close()
    bound = f"(the first size that did not fit: {fails})" if fails else f"(--limit {args.limit} reached)"
    print(f"largest micro-batch that fits: {fits['size'] if fits else 'none'} {bound}")


if __name__ == "__main__":
    main()
