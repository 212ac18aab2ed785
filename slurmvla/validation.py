"""One validation pass over the whole mixture, sharded across all ranks, reported per group.

Every rank runs the same number of forward passes over its contiguous, equally padded block of
validation samples (so FSDP / ZeRO-3 parameter gathers stay matched). The per-sample ``(sum,
count)`` of each loss component and the sample's provenance go to rank 0 in one gather of a dict;
rank 0 buckets them as Σsum / Σcount per group (never a mean of means), and the aggregate
``val/<metric>`` weights each dataset's mean by its mixture weight.

The trainer's validation loss; open-loop evaluation of a trained policy is the program
:mod:`slurmvla.evaluate`, which reports with :func:`bucket` and :func:`per_sample` from here.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from slurmvla.collectives import check_same_fields, gather_dict, gather_objects
from slurmvla.config.data import SAMPLE_MODES
from slurmvla.data.damaged import leave_out, pop_marks, say_skipped
from slurmvla.data.loader import to_device
from slurmvla.data.mixture import Mixture


@torch.no_grad()
def validate(policy: torch.nn.Module, loader, device: torch.device, mixture: Mixture,
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             should_stop: Callable[[], bool] | None = None,
             host_part: Callable[[dict], dict] | None = None) -> dict[str, float] | None:
    """Metrics on rank 0 (``val/...`` keys), None on the other ranks. Call it on every rank.

    Per-batch values stay on the device until the pass ends (one copy to the host, no sync per batch).
    ``should_stop``: asked before every batch (the trainer's rank-uniform stop agreement, a collective:
    every rank runs the same number of batches); when it says yes the pass ends and returns None.
    ``host_part``: the policy's work on the host batch before it moves (the trainer's, as for training)."""
    control_modes = mixture.control_modes
    was_training = policy.training
    policy.eval()
    columns: dict[str, list[torch.Tensor]] = defaultdict(list)
    substitutes: list[torch.Tensor] = []
    damaged: list[str] = []
    try:
        for i, batch in enumerate(loader):
            if should_stop is not None and should_stop():
                return None
            substitute, files = pop_marks(batch)
            substitutes.append(substitute)
            damaged += files
            if i == 0:  # the trainer's first-batch rule: a field some ranks lack stops all, naming it
                check_same_fields(batch.keys(), what="validation batch")
            batch = to_device(host_part(batch) if host_part is not None else batch, device)
            with autocast():
                out = policy(batch)
            for key, value in per_sample(out, batch, control_modes).items():
                columns[key].append(value)
    finally:
        policy.train(was_training)
    values = {k: torch.cat(v) for k, v in columns.items()}
    # Samples standing in for damaged episodes (data.on_damaged=skip) are left out of the metrics, and said.
    values, count = leave_out(values, torch.cat(substitutes), loader.dataset.num_real)
    everyone = gather_objects(damaged)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        say_skipped("validation", sorted({f for files in everyone for f in files}))
    gathered = gather_dict(values, count)
    if gathered is None:
        return None
    return bucket(gathered, mixture.names, control_modes, list(mixture.weights))


def per_sample(out: dict, batch: dict, control_modes: Sequence[str], dtype: torch.dtype = torch.float32,
               n: int | None = None) -> dict[str, torch.Tensor]:
    """The columns :func:`bucket` groups, for the first ``n`` samples of a batch (all by default), on its device:
    each loss component's per-sample ``<name>/sum`` and ``<name>/count`` in ``dtype``, and the provenance a
    group is read from (``dataset_index``, ``control_mode`` as a position in ``control_modes``, and ``mode``
    where samples carry one). Validation and the evaluator both collect through it, so their groups agree."""
    rows = slice(None, n)
    columns = {}
    for name, (s, c) in out["components"].items():
        columns[f"{name}/sum"], columns[f"{name}/count"] = s[rows].to(dtype), c[rows].to(dtype)
    columns["dataset_index"] = batch["dataset_index"][rows]
    columns["control_mode"] = torch.tensor([control_modes.index(m) for m in batch["control_mode"][rows]],
                                           device=batch["dataset_index"].device)
    if "mode" in batch:
        columns["mode"] = batch["mode"][rows]
    return columns


def bucket(values: dict[str, torch.Tensor], dataset_names: Sequence[str], control_modes: Sequence[str],
           weights: Sequence[float]) -> dict[str, float]:
    """Σsum / Σcount per dataset, per control mode (and per sample mode where samples carry one);
    groups with no counted element are left out (no NaN). ``val/<metric>``: the datasets' means
    weighted by their mixture weights (renormalised over datasets present); ``val/loss``: the sum
    of the components' aggregates."""
    components = sorted({k.split("/")[0] for k in values if k.endswith("/sum")})
    metrics: dict[str, float] = {"val/num_samples": float(len(values["dataset_index"]))}
    groupings = [("by_dataset", values["dataset_index"], dataset_names),
                 ("by_control_mode", values["control_mode"], control_modes)]
    if "mode" in values:
        groupings.append(("by_mode", values["mode"], SAMPLE_MODES))
    loss = 0.0
    for comp in components:
        s, c = values[f"{comp}/sum"], values[f"{comp}/count"]
        for label, index, names in groupings:
            for i, name in enumerate(names):
                sel = index == i
                total = float(c[sel].sum())
                if total > 0:
                    metrics[f"val/{label}/{name}/{comp}"] = float(s[sel].sum()) / total
        present = [(w, metrics[f"val/by_dataset/{n}/{comp}"]) for n, w in zip(dataset_names, weights)
                   if f"val/by_dataset/{n}/{comp}" in metrics]
        if present:
            norm = sum(w for w, _ in present)
            metrics[f"val/{comp}"] = sum(w * m for w, m in present) / norm
            loss += metrics[f"val/{comp}"]
    if any(f"val/{comp}" in metrics for comp in components):
        metrics["val/loss"] = loss
    return metrics
