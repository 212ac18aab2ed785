"""The policy checks that need no engine and no second process (``python -m slurmvla.check``'s single-process half).

:class:`Subject` is the policy under check, composed from the user's overrides, with a batch of real samples;
each ``check_*`` function returns a :class:`Result`. The multi-rank checks (FSDP2, ZeRO-3, rank-divergent inputs)
shard the policy with an engine on gloo ranks: :mod:`slurmvla.check` starts them, :mod:`slurmvla.check.ranks` is
one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import default_collate

from slurmvla.config import Config
from slurmvla.data.prepare import INFERENCE_KEYS, inference_fields
from slurmvla.seeding import seed_everything

# The checks by name: what --only takes, what a result line prints and what a caller picks.
OUTPUT_CONTRACT = "output contract"
SHARD_INVARIANCE = "shard invariance"
WRAP_UNITS = "wrap units"
FSDP_SAFETY = "fsdp safety"
ZERO3_CONSTRUCTION = "zero-3 construction"
RANK_DIVERGENT_INPUTS = "rank-divergent inputs"
GRADIENT_CHECKPOINTING = "gradient checkpointing"
DETERMINISM = "determinism"
# The order they run and print in (docs/policies.md's table).
CHECKS = (OUTPUT_CONTRACT, SHARD_INVARIANCE, WRAP_UNITS, FSDP_SAFETY, ZERO3_CONSTRUCTION, RANK_DIVERGENT_INPUTS,
          GRADIENT_CHECKPOINTING, DETERMINISM)
# fp32 on the CPU: the same math in another summation order (a half batch, a sharded reduction)
# differs by ~1e-7 relative. 1e-5 leaves two orders of magnitude for that noise; the bugs these
# checks exist for (a denominator counted per shard, a missed all-gather) are off by 1e-2 or more.
TOLERANCE = 1e-5
# The optional fields a rank's batch may lack (a dataset without instructions in a mixture).
OPTIONAL_FIELDS = ("text", "text_mask")


@dataclass
class Result:
    check: str
    status: str  # pass | fail | skipped
    figure: str = ""
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:7s} {self.check:24s} {self.figure}"
        return text + (f"\n{'':32s}fix: {self.fix}" if self.status == "fail" and self.fix else "")


def rank_result_file(folder: Path, mode: str, rank: int) -> Path:
    """Where one rank of a multi-rank check (``slurmvla.check.ranks``) writes its result in ``mode``: the checker
    reads it, and the ranks wait for each other's before the next mode."""
    return folder / f"{mode}.rank{rank}.json"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 difference of ``a`` from ``b``."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def take(batch: dict, rows: slice | list[int]) -> dict:
    """The samples ``rows`` of a collated batch (tensors and lists alike)."""
    if isinstance(rows, slice):
        rows = list(range(*rows.indices(len(batch["actions"]))))
    index = torch.tensor(rows)
    return {k: v[index] if torch.is_tensor(v) else [v[i] for i in rows] for k, v in batch.items()}


def halves(batch: dict) -> tuple[dict, dict]:
    n = len(batch["actions"])
    return take(batch, slice(0, n // 2)), take(batch, slice(n // 2, n))


def flat_grads(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}


def grads_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        missing = sorted(set(b) ^ set(a))
        raise AssertionError(f"gradients exist for different parameters: {missing[:4]}")
    return rel(torch.cat([a[k].flatten() for k in sorted(a)]), torch.cat([b[k].flatten() for k in sorted(b)]))


# What every check runs under, whatever else the overrides say: no logging service, the data in this process, fp32.
CHECKED_AS = ("logging.wandb.mode=disabled", "data.num_workers=0", "precision=fp32")


class Subject:
    """The policy under check: its class, config, normalization statistics and a batch of real samples.

    The batch is four samples of two episodes: one at an episode's end (most of its action chunk
    masked) and three with full chunks, so its halves hold different numbers of valid elements."""

    def __init__(self, cfg: Config, overrides: list[str]):
        from slurmvla.data.mixture import Mixture
        from slurmvla.data.synthetic import ensure_sample_dataset
        from slurmvla.policy import policy_class
        from slurmvla.policy.stats import resolve_stats

        self.cfg, self.overrides = cfg, overrides
        ensure_sample_dataset(cfg.data)
        self.cls = policy_class(cfg.policy)
        self.spec = self.cls.sample_spec(cfg.policy)
        mixture = Mixture(cfg.data, self.spec, cfg.trainer.seed)
        self.cls.check_data(cfg.policy, mixture.features)
        self.stats = resolve_stats(cfg, mixture, announce=False)
        source = mixture.sources[0]
        a, b = (source.load_episode(int(e)) for e in source.index.episodes[:2])
        picks = [(a, len(a.state) - 2), (a, 0), (b, 1), (b, 2)]
        self.batch = default_collate([source.sample(ep, t, epoch=0) for ep, t in picks])

    @classmethod
    def checked(cls, overrides: list[str]) -> Subject:
        """The subject ``python -m slurmvla.check OVERRIDES`` checks (:data:`CHECKED_AS` added)."""
        from slurmvla.compose import compose

        overrides = [*overrides, *CHECKED_AS]
        return cls(compose(overrides), overrides)

    def build(self, seed: int = 0) -> torch.nn.Module:
        from slurmvla.policy import build_policy

        seed_everything(seed)
        policy = build_policy(self.cfg.policy, self.stats)
        policy.train()
        return policy

    def loss_and_grads(self, policy: torch.nn.Module, batch: dict, seed: int = 1) -> tuple[torch.Tensor, dict]:
        policy.zero_grad(set_to_none=True)
        seed_everything(seed)
        loss = policy(batch)["loss"]
        loss.backward()
        return loss.detach(), flat_grads(policy)


# -- single-process checks -----------------------------------------------------------------------

def check_output_contract(s: Subject) -> Result:
    name = OUTPUT_CONTRACT
    policy = s.build()
    seed_everything(1)
    out = policy(s.batch)
    b = len(s.batch["actions"])
    if not isinstance(out, dict) or "loss" not in out:
        return Result(name, "fail", f"forward returned {type(out).__name__} without 'loss'",
                      "return {'loss': scalar, 'components': {name: (per-sample sum, per-sample count)}}")
    loss = out["loss"]
    if not (torch.is_tensor(loss) and loss.ndim == 0 and loss.is_floating_point()):
        return Result(name, "fail", f"loss is {getattr(loss, 'shape', type(loss))}, not a floating scalar",
                      "reduce the loss to one value: the sum of per-element errors over a constant of the batch shape")
    if not torch.isfinite(loss) or loss.grad_fn is None:
        return Result(name, "fail", f"loss={float(loss)} (finite: {bool(torch.isfinite(loss))}, has a graph: "
                      f"{loss.grad_fn is not None})", "the loss must be finite and depend on the parameters")
    components = out.get("components")
    if not isinstance(components, dict) or not components:
        return Result(name, "fail", "no 'components' dict",
                      "add components: {name: (sum [B], count [B])} so validation can split a mixed batch")
    for key, pair in components.items():
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(torch.is_tensor(x) for x in pair)):
            return Result(name, "fail", f"components[{key!r}] is not a (sum, count) pair of tensors",
                          "give each component as (per-sample sum [B], per-sample count [B])")
        for what, x in zip(("sum", "count"), pair):
            if tuple(x.shape) != (b,):
                return Result(name, "fail", f"components[{key!r}] {what} has shape {list(x.shape)}, not [{b}] (one "
                              "value per sample)", "return per-sample sums and counts, not batch totals")
        if (pair[1] < 0).any() or pair[1].sum() <= 0:
            return Result(name, "fail", f"components[{key!r}] counts {pair[1].tolist()}",
                          "counts are the numbers of valid elements per sample (>= 0, not all zero)")
    worst = 0.0
    for i in range(b):
        seed_everything(1)
        alone = policy(take(s.batch, [i]))["components"]
        for key, (total, count) in components.items():
            worst = max(worst, rel(alone[key][0], total[i : i + 1]), rel(alone[key][1], count[i : i + 1]))
    if worst > TOLERANCE:
        return Result(name, "fail", f"a sample's (sum, count) in the batch differs from the sample alone by "
                      f"{worst:.1e} relative", "per-sample components must not depend on the other samples in the batch")
    policy.eval()
    try:
        with torch.no_grad():
            actions = policy.sample_actions(inference_fields(s.batch))
    except NotImplementedError as e:
        return Result(name, "fail", str(e), "implement sample_actions(batch) -> [B, action_horizon, action_dim]")
    except KeyError as e:
        return Result(name, "fail", f"sample_actions reads {e}, which an observation at inference time does not have "
                      f"(it has {list(INFERENCE_KEYS)})", "read only observations in sample_actions: the server and the "
                      "evaluator pass no actions, noise draws or provenance")
    want = (b, s.cfg.policy.action_horizon, s.cfg.policy.action_dim)
    if not torch.is_tensor(actions) or tuple(actions.shape) != want or not torch.isfinite(actions).all():
        return Result(name, "fail", f"sample_actions gave {getattr(actions, 'shape', type(actions))}, want {list(want)}"
                      " finite", "return the action chunk in the dataset's units")
    sums = {k: round(float(v[0].sum() / v[1].sum()), 4) for k, v in components.items()}
    return Result(name, "pass", f"loss {float(loss.detach()):.4f}; Σsum/Σcount {sums}; per-sample components match each "
                  f"sample alone to {worst:.1e}; sample_actions {list(want)}")


def check_shard_invariance(s: Subject) -> Result:
    name = SHARD_INVARIANCE
    policy = s.build()
    full_loss, full = s.loss_and_grads(policy, s.batch)
    first, second = halves(s.batch)
    la, ga = s.loss_and_grads(policy, first)
    lb, gb = s.loss_and_grads(policy, second)
    mean = {k: (ga[k] + gb[k]) / 2 for k in ga if k in gb}
    loss_gap, grad_gap = rel((la + lb) / 2, full_loss), grads_rel(mean, full)
    figure = f"loss {loss_gap:.1e}, gradients {grad_gap:.1e} relative from the mean of the two halves"
    if max(loss_gap, grad_gap) > TOLERANCE:
        counts = [int(h["action_mask"].sum()) for h in (first, second)]
        return Result(name, "fail", figure + f" (valid chunk steps per half: {counts})",
                      "divide the summed loss by a constant of the batch shape (e.g. pred.numel()), not by a count "
                      "of this batch's valid elements; draw training randomness in the data (sample_spec draws)")
    return Result(name, "pass", figure)


def check_wrap_units(s: Subject) -> Result:
    name = WRAP_UNITS
    policy = s.build()
    units = list(policy.wrap_units())
    if not units:
        return Result(name, "fail", "wrap_units() is empty: fsdp_full / fsdp_grad_op / hsdp cannot shard it",
                      "return the layers (one module per block) from wrap_units()")
    owned = {id(m) for m in policy.modules()}
    foreign = [type(u).__name__ for u in units if id(u) not in owned]
    if foreign:
        return Result(name, "fail", f"units not inside the policy: {foreign}", "return the policy's own sub-modules")
    seen: dict[int, int] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            if id(p) in seen and seen[id(p)] != i:
                pname = next(n for n, q in policy.named_parameters() if q is p)
                return Result(name, "fail", f"parameter {pname!r} is in units {seen[id(p)]} and {i} (a unit nested in "
                              "another, or a weight shared between units)",
                              "make units disjoint: list leaf blocks, not a block and its container")
            seen[id(p)] = i
    all_names = [n for n, _ in policy.named_parameters(remove_duplicate=False)]
    ids = [id(p) for _, p in policy.named_parameters(remove_duplicate=False)]
    if len(set(ids)) != len(ids):
        twice = sorted({n for n, p in zip(all_names, ids) if ids.count(p) > 1})
        return Result(name, "fail", f"parameters registered under two names: {twice[:4]}",
                      "a tied weight must live in one unit (or the root); register it once")
    trainable = [p for p in policy.parameters() if p.requires_grad]
    in_units = sum(p.numel() for p in trainable if id(p) in seen)
    total = sum(p.numel() for p in trainable)
    return Result(name, "pass", f"{len(units)} units hold {in_units:,} of {total:,} trainable parameters "
                  f"({total - in_units:,} in the root)")


def check_gradient_checkpointing(s: Subject) -> Result:
    name = GRADIENT_CHECKPOINTING
    policy = s.build()
    if policy.gradient_checkpointing is None:
        return Result(name, "skipped", "the policy has no gradient_checkpointing switch")
    policy.gradient_checkpointing = False
    loss_off, off = s.loss_and_grads(policy, s.batch)
    policy.gradient_checkpointing = True
    loss_on, on = s.loss_and_grads(policy, s.batch)
    missing = sorted(set(off) - set(on))
    if missing:
        return Result(name, "fail", f"with checkpointing on, {len(missing)} parameters get no gradient: {missing[:3]}",
                      "do not detach activations into a checkpointed segment; use use_reentrant=False")
    gap = max(rel(loss_on, loss_off), grads_rel(on, off))
    figure = f"gradients on vs off differ by {gap:.1e} relative"
    if gap > TOLERANCE:
        return Result(name, "fail", figure, "the recomputed segment must compute what the stored one did "
                      "(non-reentrant checkpointing, the same RNG state)")
    return Result(name, "pass", figure)


def check_determinism(s: Subject) -> Result:
    name = DETERMINISM
    a, b = s.build(seed=0), s.build(seed=0)
    sa, sb = a.state_dict(), b.state_dict()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    if differ:
        return Result(name, "fail", f"two builds with one seed differ in {differ[:3]}",
                      "initialise from torch's seeded RNG only (every rank must build the same weights)")
    la, ga = s.loss_and_grads(a, s.batch)
    lb, gb = s.loss_and_grads(b, s.batch)
    again, _ = s.loss_and_grads(a, s.batch)
    same = torch.equal(la, lb) and torch.equal(la, again) and ga.keys() == gb.keys() and \
        all(torch.equal(ga[k], gb[k]) for k in ga)
    if not same:
        return Result(name, "fail", f"seeded forwards differ: loss {float(la)!r} / {float(lb)!r} / {float(again)!r}",
                      "draw randomness from torch's seeded generator (or from the sample: sample_spec draws), never "
                      "from a time- or OS-seeded source")
    return Result(name, "pass", f"weights, loss {float(la):.6f} and gradients bitwise equal across builds and calls")


SINGLE_PROCESS: dict[str, Callable[[Subject], Result]] = {
    OUTPUT_CONTRACT: check_output_contract, SHARD_INVARIANCE: check_shard_invariance, WRAP_UNITS: check_wrap_units,
    GRADIENT_CHECKPOINTING: check_gradient_checkpointing, DETERMINISM: check_determinism,
}

