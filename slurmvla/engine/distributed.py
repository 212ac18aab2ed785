"""Process-group initialisation (the one place) and rank-uniform helpers."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from slurmvla.launch import DistEnv


def select_device(requested: str, env: DistEnv) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but CUDA is not available; valid here: ['auto', 'cpu']")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(env: DistEnv, device: torch.device, backend: str, timeout_s: int) -> None:
    """Join the job's process group from the DistEnv; a world of one needs none."""
    if not env.is_distributed or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )


def shutdown_process_group() -> None:
    # The barrier keeps a fast rank from tearing down gloo while a peer is still exiting; without it
    # a few percent of runs abort at exit although training finished.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
