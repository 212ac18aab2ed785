"""Check a policy against the contract on the CPU, before a job is submitted.

    python -m slurmvla.policy.check [train overrides] [--only NAME ...] [--deadline-s 180]
    python -m slurmvla.policy.check policy=custom policy.target=my_pkg.MyPolicy '+policy.kwargs={hidden: 64}'

Builds the configured policy (built-in or plug-in) on a batch from the configured data, runs every
check below and prints one line per check: pass / fail / skipped, the measured figure, and what to
fix. Exits 1 when a check fails, 2 on a configuration error. Multi-rank checks run gloo ranks under
torchrun with a deadline: a hang is reported as a failure, never waited out.

1. output contract: ``loss`` is a finite scalar with a graph; ``components`` are per-sample ``(sum,
   count)`` pairs that equal those of each sample run alone; ``sample_actions`` gives
   ``[B, action_horizon, action_dim]``.
2. shard invariance: the loss and the gradients of a batch equal the mean of its two halves' (what
   makes every world size train the same model).
3. wrap units: units exist, belong to the policy, no parameter in two units or registered twice.
4. fsdp safety: on 2 ranks under FSDP2 (``fsdp_full``), loss and gradients match the unwrapped
   policy on the whole batch (catches a layer that reaches into another unit's weights, DTensor /
   tensor mixing).
5. zero-3 construction: the policy builds and takes an optimizer step under DeepSpeed ZeRO-3 on 2
   ranks (skipped without DeepSpeed).
6. rank-divergent inputs: one rank's batch lacks the optional instruction tokens; the ranks either
   agree (one collective) or all stop with an error naming the field, within the deadline.
7. gradient checkpointing: on and off give the same gradients (skipped when the policy has no
   ``gradient_checkpointing`` switch).
8. determinism: two builds with one seed have equal weights, and seeded forwards are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import default_collate

from slurmvla.config import Config
from slurmvla.data.prepare import INFERENCE_KEYS, inference_fields

CHECKS = ("output contract", "shard invariance", "wrap units", "fsdp safety", "zero-3 construction",
          "rank-divergent inputs", "gradient checkpointing", "determinism")
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


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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

    def build(self, seed: int = 0) -> torch.nn.Module:
        from slurmvla.policy import build_policy

        seed_all(seed)
        policy = build_policy(self.cfg.policy, self.stats)
        policy.train()
        return policy

    def loss_and_grads(self, policy: torch.nn.Module, batch: dict, seed: int = 1) -> tuple[torch.Tensor, dict]:
        policy.zero_grad(set_to_none=True)
        seed_all(seed)
        loss = policy(batch)["loss"]
        loss.backward()
        return loss.detach(), flat_grads(policy)


# -- single-process checks -----------------------------------------------------------------------

def check_output_contract(s: Subject) -> Result:
    name = CHECKS[0]
    policy = s.build()
    seed_all(1)
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
        seed_all(1)
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
    name = CHECKS[1]
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
    name = CHECKS[2]
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
    name = CHECKS[6]
    policy = s.build()
    if not hasattr(policy, "gradient_checkpointing"):
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
    name = CHECKS[7]
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


# -- multi-rank checks (torchrun, gloo, a deadline) -----------------------------------------------

def run_ranks(s: Subject, mode: str, deadline_s: float, nproc: int = 2, grace_s: float = 5.0) -> dict[int, dict | None]:
    """Run ``slurmvla.policy.check_ranks`` in ``mode`` on ``nproc`` gloo ranks; each rank's result
    (None: it reported nothing in time). Once a rank has reported an error, the others get
    ``grace_s`` to report theirs before the job is killed (a peer blocked in a collective would
    otherwise wait for the deadline)."""
    with tempfile.TemporaryDirectory(prefix="slurmvla-check-") as tmp:
        tmp = Path(tmp)
        torch.save({"batch": s.batch, "stats": s.stats}, tmp / "inputs.pt")
        spec = {"mode": mode, "overrides": s.overrides, "inputs": str(tmp / "inputs.pt"), "out": str(tmp),
                "timeout_s": max(10, int(deadline_s / 2))}
        (tmp / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", "-m", "slurmvla.policy.check_ranks", str(tmp / "spec.json")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        t0, first_error = time.monotonic(), None
        try:
            while proc.poll() is None:
                results = _read(tmp, nproc)
                if first_error is None and any(r and "error" in r for r in results.values()):
                    first_error = time.monotonic()
                if time.monotonic() - t0 > deadline_s or (first_error and time.monotonic() - first_error > grace_s):
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
        results = _read(tmp, nproc)
        if all(r is None for r in results.values()) and proc.returncode not in (None, 0, -signal.SIGKILL):
            results[0] = {"error": "the ranks did not start: " + log.strip()[-600:]}
        return results


def _silent(results: dict[int, dict | None], deadline_s: float) -> str:
    """Why some ranks gave no result: still blocked at the deadline, or torn down while blocked."""
    silent = [r for r, v in results.items() if v is None]
    done = [r for r, v in results.items() if v is not None]
    if done:
        return (f"ranks {silent} gave no result: blocked in a collective that ranks {done} never joined (a hang, "
                f"cut short when the job ended or at the {deadline_s:.0f}s deadline)")
    return f"no rank gave a result within {deadline_s:.0f}s (a hang)"


def _read(folder: Path, nproc: int) -> dict[int, dict | None]:
    out = {}
    for r in range(nproc):
        f = folder / f"rank{r}.json"
        try:
            out[r] = json.loads(f.read_text()) if f.is_file() else None
        except json.JSONDecodeError:
            out[r] = None  # being written
    return out


def _errors(results: dict[int, dict | None]) -> list[str]:
    return [f"rank {r}: {res['error']}" for r, res in results.items() if res and "error" in res]


def _failed_ranks(name: str, results: dict[int, dict | None], deadline_s: float, fix: str) -> Result | None:
    """A failing result when a rank raised or gave nothing; None when every rank reported figures."""
    errors = _errors(results)
    if errors:
        return Result(name, "fail", "; ".join(errors)[:600], fix)
    if any(r is None for r in results.values()):
        return Result(name, "fail", _silent(results, deadline_s), fix)
    return None


def check_fsdp(s: Subject, deadline_s: float) -> Result:
    name = CHECKS[3]
    results = run_ranks(s, "fsdp", deadline_s)
    fix = ("a layer's forward must use only its own parameters (a unit's weights are sharded outside its forward): "
           "move the computation into the module that owns the weights; keep statistics as buffers, not parameters")
    failed = _failed_ranks(name, results, deadline_s, fix)
    if failed:
        return failed
    loss_gap = max(r["loss_rel"] for r in results.values())
    grad_gap = max(r["grad_rel"] for r in results.values())
    figure = f"2 ranks, fsdp_full: loss {loss_gap:.1e}, gradients {grad_gap:.1e} relative from the unwrapped policy"
    if max(loss_gap, grad_gap) > TOLERANCE:
        return Result(name, "fail", figure, fix)
    return Result(name, "pass", figure)


def check_zero3(s: Subject, deadline_s: float) -> Result:
    name = CHECKS[4]
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return Result(name, "skipped", "DeepSpeed is not installed (pip install 'slurmvla[deepspeed]')")
    results = run_ranks(s, "zero3", deadline_s)
    fix = ("under ZeRO-3 a parameter is an empty partition unless its module is running or it is reached as an "
           "attribute: do not iterate self.parameters() (or read .data / .shape of a stored reference) in forward; "
           "register such weights with deepspeed.zero.register_external_parameter, or compute it in the owning module")
    failed = _failed_ranks(name, results, deadline_s, fix)
    if failed:
        return failed
    r0 = results[0]
    gap = max(r["loss_rel"] for r in results.values())
    if gap > TOLERANCE:
        return Result(name, "fail", f"2 ranks, zero3: the loss differs from the unwrapped policy's by {gap:.1e} relative "
                      f"({r0['loss']:.6f})", fix)
    if not r0["changed"]:
        return Result(name, "fail", "one optimizer step left every weight unchanged", fix)
    return Result(name, "pass", f"2 ranks, zero3 (every parameter partitioned): loss {gap:.1e} relative from the "
                  f"unwrapped policy, one optimizer step moved the weights (max |Δ| {r0['max_change']:.1e})")


def check_divergent(s: Subject, deadline_s: float) -> Result:
    name = CHECKS[5]
    present = [f for f in OPTIONAL_FIELDS if f in s.batch]
    if not present:
        return Result(name, "skipped", f"the policy's samples have no optional fields ({list(OPTIONAL_FIELDS)})")
    results = run_ranks(s, "divergent", deadline_s)
    fix = ("decide optional branches on every rank alike: slurmvla.collectives.agree({'text': 'text' in batch}, "
           "fields=batch.keys()) settles them in one collective and names a field missing on some ranks")
    if all(r is not None and r.get("ok") for r in results.values()):
        return Result(name, "pass", f"rank 1 without {present}: the ranks agreed and finished")
    errors = _errors(results)
    if len(errors) == len(results) and all(any(f in e for f in present) for e in errors):
        return Result(name, "pass", f"rank 1 without {present}: every rank stopped naming the field "
                      f"({errors[0][:160]})")
    if any(r is None for r in results.values()):
        return Result(name, "fail", f"rank 1 without {present}: {_silent(results, deadline_s)}", fix)
    return Result(name, "fail", f"rank 1 without {present}: {'; '.join(errors)[:400] or 'ranks disagreed'}", fix)


def run_checks(s: Subject, only: list[str] | None = None, deadline_s: float = 180.0,
               report: Callable[[Result], None] | None = None) -> list[Result]:
    table: dict[str, Callable[[], Result]] = {
        CHECKS[0]: lambda: check_output_contract(s),
        CHECKS[1]: lambda: check_shard_invariance(s),
        CHECKS[2]: lambda: check_wrap_units(s),
        CHECKS[3]: lambda: check_fsdp(s, deadline_s),
        CHECKS[4]: lambda: check_zero3(s, deadline_s),
        CHECKS[5]: lambda: check_divergent(s, deadline_s),
        CHECKS[6]: lambda: check_gradient_checkpointing(s),
        CHECKS[7]: lambda: check_determinism(s),
    }
    results = []
    for name in only or CHECKS:
        try:
            result = table[name]()
        except Exception as e:  # a policy that raises fails the check; the message says where
            result = Result(name, "fail", f"{type(e).__name__}: {e}"[:600], "see the error above")
        results.append(result)
        if report:
            report(result)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train overrides (key=value), e.g. policy=custom policy.target=...")
    parser.add_argument("--only", nargs="+", choices=CHECKS, metavar="CHECK", help=f"run only these: {list(CHECKS)}")
    parser.add_argument("--deadline-s", type=float, default=180.0, help="per multi-rank check (default 180)")
    args = parser.parse_args(argv)

    from slurmvla.compose import compose

    overrides = [*args.overrides, "logging.wandb.mode=disabled", "data.num_workers=0", "precision=fp32"]
    t0 = time.monotonic()
    try:
        subject = Subject(compose(overrides), overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"checking {subject.cls.__module__}.{subject.cls.__qualname__} on {len(subject.batch['actions'])} samples of "
          f"{subject.cfg.data.resolved_root}", flush=True)
    results = run_checks(subject, args.only, args.deadline_s, report=lambda r: print(r.line(), flush=True))
    failed = [r.check for r in results if r.status == "fail"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed or skipped in {time.monotonic() - t0:.0f}s"
          + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
