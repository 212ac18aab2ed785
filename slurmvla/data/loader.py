"""Data loaders over a :class:`~slurmvla.data.mixture.Mixture`: training (stream or map) and validation.

The training loader's position is ``(epoch, batches consumed on this rank in the epoch)``; it is
part of the checkpoint, and a resumed run on the same layout (loader, world size, workers,
micro-batch) yields exactly the batches the uninterrupted run would have. On another layout the
position carries over as the same fraction of the epoch, with a warning.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from slurmvla.config.data import DataConfig
from slurmvla.data.datasets import EpisodeStream, EpochSampler, MapDataset, ValidationDataset
from slurmvla.data.mixture import Mixture
from slurmvla.launch.preempt import ignore_stop_signals

log = logging.getLogger("slurmvla")


@atexit.register
def _end_workers_at_exit() -> None:
    """Data workers ignore the stop signals (slurmvla.launch.preempt.ignore_stop_signals). A loader still
    alive at exit (an exception's traceback holds it) would hang the process: multiprocessing's own exit
    sends its daemonic children SIGTERM and waits for them. Registered after it, this runs first and ends
    them: first as the loader itself would (its workers finish on their own), then, for any left, by PID
    with SIGKILL. A loader shut down normally has no children left."""
    import gc

    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if multiprocessing.active_children():
        gc.unfreeze()  # objects alive when a worker was forked are frozen (slurmvla.garbage_collector), the loader too
        for obj in gc.get_objects():
            if type(obj) is _MultiProcessingDataLoaderIter:
                obj._shutdown_workers()
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(timeout=5)


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to ``device`` (non-blocking from pinned memory); strings stay."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class TrainData:
    def __init__(self, mixture: Mixture, cfg: DataConfig, batch_size: int, rank: int, world_size: int,
                 seed: int, pin_memory: bool = False):
        self.mixture, self.cfg, self.batch_size = mixture, cfg, batch_size
        self.rank, self.world_size = rank, world_size
        workers = cfg.num_workers
        common = dict(batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=4 if workers > 0 else None,
                      # Its own generator: starting workers must not draw from the global RNG, or a
                      # resumed run (which starts its workers at another step) would diverge.
                      generator=torch.Generator().manual_seed(seed),
                      # SLURM's SIGTERM / USR2 reach every process of the step: a worker must outlive
                      # them until the trainer has saved (torch's workers die of any SIGTERM).
                      worker_init_fn=ignore_stop_signals)
        if cfg.loader == "stream":
            self.stream = EpisodeStream(mixture, batch_size, rank, world_size, workers)
            self.batches_per_epoch = self.stream.batches_per_epoch
            # Persistent workers read the position from shared memory at each epoch's start.
            self.loader = DataLoader(self.stream, persistent_workers=workers > 0, **common)
        else:
            self.dataset = MapDataset(mixture, cfg.episode_cache_size)
            if len(self.dataset) // world_size < batch_size:
                raise ValueError(
                    f"the training data has {len(self.dataset)} samples per epoch: fewer than one micro-batch of "
                    f"{batch_size} per rank for {world_size} ranks; lower trainer.global_batch_size"
                )
            self.sampler = EpochSampler(len(self.dataset), seed, rank, world_size)
            self.batches_per_epoch = len(self.dataset) // world_size // batch_size
            self.loader = DataLoader(self.dataset, sampler=self.sampler, drop_last=True,
                                     persistent_workers=workers > 0, **common)

    @property
    def layout(self) -> dict:
        return {"loader": self.cfg.loader, "world_size": self.world_size, "num_workers": self.cfg.num_workers,
                "batch_size": self.batch_size, "batches_per_epoch": self.batches_per_epoch}

    def iterate(self, epoch: int, batches: int) -> Iterator[dict]:
        """The epoch's batches from position ``batches`` on."""
        if self.cfg.loader == "stream":
            self.stream.set_position(epoch, batches)
        else:
            self.sampler.set_position(epoch, batches * self.batch_size)
        return iter(self.loader)

    def close(self) -> None:
        """End the data workers now. Persistent workers otherwise live on until the loader is garbage, and a
        collection that finds it in a reference cycle closes its queues before the loader's own shutdown
        runs: that shutdown then waits torch's full timeout for each worker before killing it (seconds of
        a later run's start, in a process that trains again)."""
        iterator, self.loader._iterator = getattr(self.loader, "_iterator", None), None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def resume_position(self, saved: dict) -> int:
        """Batches into the epoch to resume at, from a checkpoint's data state."""
        layout = saved.get("layout", {})
        same = {k: layout.get(k) for k in ("loader", "world_size", "num_workers", "batch_size")} == \
            {k: self.layout[k] for k in ("loader", "world_size", "num_workers", "batch_size")}
        if same:
            return int(saved["batches_in_epoch"])
        fraction = saved["batches_in_epoch"] / max(1, layout.get("batches_per_epoch", 1))
        position = min(self.batches_per_epoch, int(round(fraction * self.batches_per_epoch)))
        log.warning("the data layout changed since the checkpoint (%s -> %s): resuming at the same fraction of the "
                    "epoch (%.3f), not at the exact next sample", layout, self.layout, fraction)
        return position


class _Padded(torch.utils.data.Dataset):
    """One rank's contiguous block of validation samples, padded (by repeating a sample) to the
    same length on every rank, so every rank runs the same number of forward passes (FSDP and
    ZeRO-3 gather parameters inside forward). ``num_real`` samples come first."""

    def __init__(self, dataset: ValidationDataset, indices: list[int], length: int):
        self.dataset, self.indices, self.length = dataset, indices, length
        self.num_real = len(indices)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        return self.dataset[self.indices[min(i, self.num_real - 1)] if self.num_real else 0]


def build_validation_loader(mixture: Mixture, cfg: DataConfig, batch_size: int, rank: int = 0,
                            world_size: int = 1, split: str = "val") -> DataLoader | None:
    """Every validation sample of the mixture once, in a fixed order (no shuffle, no drop_last),
    sharded across ranks in contiguous blocks (each rank decodes few episodes) and padded to equal
    length; ``loader.dataset.num_real`` says how many of a rank's samples are real. None when the
    split is empty. ``split="all"``: every sample the filters keep, not just the held-out episodes."""
    dataset = ValidationDataset(mixture, split)
    if len(dataset) == 0:
        return None
    per_rank = -(-len(dataset) // world_size)
    indices = list(range(rank * per_rank, min(len(dataset), (rank + 1) * per_rank)))
    return DataLoader(_Padded(dataset, indices, per_rank), batch_size=batch_size, shuffle=False, drop_last=False,
                      num_workers=min(cfg.num_workers, 1), worker_init_fn=ignore_stop_signals)
