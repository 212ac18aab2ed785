"""Process-group initialisation (the one place) and rank-uniform helpers."""

from __future__ import annotations

import datetime
import os

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


def set_determinism(environ: dict[str, str] | None = None) -> None:
    """Deterministic algorithms where torch has them. Call before CUDA initialises: cuBLAS reads its
    workspace setting when its first handle is created."""
    env = os.environ if environ is None else environ
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # warn_only: an op without a deterministic kernel (some attention backwards) warns instead of
    # stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def init_process_group(env: DistEnv, device: torch.device, backend: str, timeout_s: int,
                       required: bool = False) -> None:
    """Join the job's process group from the DistEnv. A world of one needs none, unless ``required``
    (a multi-process engine, e.g. DDP or FSDP under ``torchrun --nproc_per_node=1``)."""
    if not (env.is_distributed or required) or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    # env:// so that under torchrun the workers join the agent's existing store on MASTER_PORT.
    for name, value in (("MASTER_ADDR", env.master_addr), ("MASTER_PORT", str(env.master_port))):
        os.environ.setdefault(name, value)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if backend == "nccl" else None,
    )


def shutdown_process_group(failed: bool = False) -> None:
    """Leave the process group. After a failure no barrier: the peers may be gone, and waiting for
    them would hold the allocation until the timeout instead of letting the launcher end the job."""
    if dist.is_initialized():
        if not failed:
            # Keeps a fast rank from tearing down gloo while a peer is still exiting; without it a
            # few percent of runs abort at exit although training finished.
            dist.barrier()
        dist.destroy_process_group()
