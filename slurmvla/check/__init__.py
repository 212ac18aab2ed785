"""Check a policy against the contract on the CPU, before a job is submitted.

    python -m slurmvla.check [train overrides] [--only NAME ...] [--deadline-s 180]
    python -m slurmvla.check policy=custom policy.target=my_pkg.MyPolicy '+policy.kwargs={hidden: 64}'

Builds the configured policy (built-in or plug-in) on a batch from the configured data, runs every
check below and prints one line per check: pass / fail / skipped, the measured figure, and what to
fix. Exits 1 when a check fails, 2 on a configuration error. Multi-rank checks run gloo ranks under
torchrun with a deadline: a hang is reported as a failure, never waited out. The single-process
checks are ``slurmvla.check.subject``; the multi-rank ones are here, beside the ranks they start
(``slurmvla.check.ranks``), because each rank shards the policy with an engine.

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
6. rank-divergent inputs: one rank's samples all lack an instruction (same fields, other values); the ranks
   run the same collectives and finish within the deadline.
7. gradient checkpointing: on and off give the same gradients (skipped when the policy has no
   ``gradient_checkpointing`` switch).
8. determinism: two builds with one seed have equal weights, and seeded forwards are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from slurmvla.check.subject import (
    CHECKS,
    FSDP_SAFETY,
    OPTIONAL_FIELDS,
    RANK_DIVERGENT_INPUTS,
    SINGLE_PROCESS,
    TOLERANCE,
    ZERO3_CONSTRUCTION,
    Result,
    Subject,
    rank_result_file,
)
from slurmvla.cli import ArgumentParser, program
from slurmvla.errors import FAILED, Failure, exit_code, exit_with

# -- multi-rank checks (torchrun, gloo, a deadline) -----------------------------------------------

class RankJobs:
    """The multi-rank checks' ranks: every mode a run needs goes to one torchrun job (``slurmvla.check.ranks``),
    run one after another in the same processes, since starting them and importing torch and DeepSpeed costs
    more than a check. ``get(mode)`` gives each rank's result in that mode (None: it reported nothing in
    time). Each mode has ``deadline_s`` of its own, counted from when the one before it finished. Once a rank
    has reported an error, the others get ``grace_s`` to report theirs before the job is killed (a peer
    blocked in a collective would otherwise wait for the deadline); the modes after a failed or silent one
    then run in a job of their own, so one check's hang costs no other check its result."""

    def __init__(self, s: Subject, modes: list[str], deadline_s: float, nproc: int = 2, grace_s: float = 5.0):
        self.s, self.deadline_s, self.nproc, self.grace_s = s, deadline_s, nproc, grace_s
        self.pending = list(modes)
        self.results: dict[str, dict[int, dict | None]] = {}

    def get(self, mode: str) -> dict[int, dict | None]:
        if mode not in self.results and mode not in self.pending:
            self.pending.append(mode)
        while mode not in self.results:  # each job gives at least its first mode a result
            self._run(list(self.pending))
        return self.results[mode]

    def _run(self, modes: list[str]) -> None:
        """One job for ``modes``: those that finished on every rank, and the one it stopped in, get their
        results; the ones it never reached stay pending."""
        with tempfile.TemporaryDirectory(prefix="slurmvla-check-") as tmp:
            tmp = Path(tmp)
            torch.save({"batch": self.s.batch, "stats": self.s.stats}, tmp / "inputs.pt")
            spec = {"modes": modes, "overrides": self.s.overrides, "inputs": str(tmp / "inputs.pt"), "out": str(tmp),
                    "timeout_s": max(10, int(self.deadline_s / 2))}
            (tmp / "spec.json").write_text(json.dumps(spec))
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
            proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     f"--nproc_per_node={self.nproc}", "-m", "slurmvla.check.ranks",
                                     str(tmp / "spec.json")],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            current, since, first_error = 0, time.monotonic(), None
            try:
                while proc.poll() is None:
                    results = self._read(tmp, modes[current])
                    if all(r is not None and "error" not in r for r in results.values()) and current + 1 < len(modes):
                        current, since, first_error = current + 1, time.monotonic(), None
                        continue
                    if first_error is None and any(r and "error" in r for r in results.values()):
                        first_error = time.monotonic()
                    if time.monotonic() - since > self.deadline_s or \
                            (first_error and time.monotonic() - first_error > self.grace_s):
                        break
                    time.sleep(0.2)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                log, _ = proc.communicate()
            for i, mode in enumerate(modes):
                results = self._read(tmp, mode)
                reached = i <= current or any(r is not None for r in results.values())
                if not reached:
                    break
                if all(r is None for r in results.values()) and proc.returncode not in (None, 0, -signal.SIGKILL):
                    results[0] = {"error": "the ranks did not start: " + log.strip()[-600:]}
                self.results[mode] = results
                self.pending.remove(mode)
                if any(r is None or "error" in r for r in results.values()):
                    break  # the modes after it run in a job of their own

    def _read(self, folder: Path, mode: str) -> dict[int, dict | None]:
        out = {}
        for r in range(self.nproc):
            f = rank_result_file(folder, mode, r)
            try:
                out[r] = json.loads(f.read_text()) if f.is_file() else None
            except json.JSONDecodeError:
                out[r] = None  # being written
        return out


def _silent(results: dict[int, dict | None], deadline_s: float) -> str:
    """Why some ranks gave no result: still blocked at the deadline, or torn down while blocked."""
    silent = [r for r, v in results.items() if v is None]
    done = [r for r, v in results.items() if v is not None]
    if done:
        return (f"ranks {silent} gave no result: blocked in a collective that ranks {done} never joined (a hang, "
                f"cut short when the job ended or at the {deadline_s:.0f}s deadline)")
    return f"no rank gave a result within {deadline_s:.0f}s (a hang)"


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


def check_fsdp(s: Subject, jobs: RankJobs) -> Result:
    name, deadline_s = FSDP_SAFETY, jobs.deadline_s
    results = jobs.get("fsdp")
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


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def check_zero3(s: Subject, jobs: RankJobs) -> Result:
    name, deadline_s = ZERO3_CONSTRUCTION, jobs.deadline_s
    if not _deepspeed_installed():
        return Result(name, "skipped", "DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    results = jobs.get("zero3")
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


def _divergent_applies(s: Subject) -> bool:
    return any(f in s.batch for f in OPTIONAL_FIELDS)


def check_divergent(s: Subject, jobs: RankJobs) -> Result:
    """Every rank's batch has the same fields (the trainer checks that on the first batch and stops every
    rank naming a field some lack); what still differs between ranks is their values. A policy that
    decides on its local values whether a sharded unit runs (``if batch["text_mask"].any(): ...``) asks
    for an all-gather on some ranks only: a hang after hours, when one rank draws a batch without
    instructions."""
    name, deadline_s = RANK_DIVERGENT_INPUTS, jobs.deadline_s
    if not _divergent_applies(s):
        return Result(name, "skipped", f"the policy's samples have no instruction tokens ({list(OPTIONAL_FIELDS)})")
    results = jobs.get("divergent")
    fix = ("run the same modules on every rank whatever the batch holds: mask what a sample lacks (e.g. zero its "
           "tokens' attention) instead of branching on this rank's values")
    what = "rank 1's samples all without an instruction"
    if all(r is not None and r.get("ok") for r in results.values()):
        gap = max(r["loss_rel"] for r in results.values())
        return Result(name, "pass", f"{what}: the ranks ran the same collectives and finished (loss {gap:.1e} "
                      "relative from one process)")
    if any(r is None for r in results.values()):
        return Result(name, "fail", f"{what}: {_silent(results, deadline_s)}", fix)
    return Result(name, "fail", f"{what}: {'; '.join(_errors(results))[:400] or 'ranks disagreed'}", fix)


MULTI_RANK: dict[str, Callable[[Subject, RankJobs], Result]] = {
    FSDP_SAFETY: check_fsdp, ZERO3_CONSTRUCTION: check_zero3, RANK_DIVERGENT_INPUTS: check_divergent,
}
# The mode each multi-rank check runs its ranks in, in the order one job runs them (DeepSpeed's last: its
# ZeRO-3 construction patches module creation while it builds), and whether the check runs any.
MODES: dict[str, tuple[str, Callable[[Subject], bool]]] = {
    FSDP_SAFETY: ("fsdp", lambda s: True), RANK_DIVERGENT_INPUTS: ("divergent", _divergent_applies),
    ZERO3_CONSTRUCTION: ("zero3", lambda s: _deepspeed_installed()),
}


def run_checks(s: Subject, only: list[str] | None = None, deadline_s: float = 180.0,
               report: Callable[[Result], None] | None = None) -> list[Result]:
    names = only or CHECKS
    jobs = RankJobs(s, [mode for name, (mode, applies) in MODES.items() if name in names and applies(s)], deadline_s)
    results = []
    for name in names:
        try:
            result = SINGLE_PROCESS[name](s) if name in SINGLE_PROCESS else MULTI_RANK[name](s, jobs)
        except Exception as e:  # a policy that raises fails the check; the message says where
            result = Result(name, "fail", f"{type(e).__name__}: {e}"[:600], "see the error above")
        results.append(result)
        if report:
            report(result)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.check"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train overrides (key=value), e.g. policy=custom policy.target=...")
    parser.add_argument("--only", nargs="+", choices=CHECKS, metavar="CHECK", help=f"run only these: {list(CHECKS)}")
    parser.add_argument("--deadline-s", type=float, default=180.0, help="per multi-rank check (default 180)")
    args = parser.parse_args(argv)

    t0 = time.monotonic()
    try:
        subject = Subject.checked(args.overrides)
        subject.build()  # a policy that cannot be built is said once, not as a failure of every check
    except ValueError as e:  # a user's mistake (2), or a dataset file that cannot be read (a DataError: 1)
        exit_with(e, exit_code(e))
    except Exception as e:  # the policy's own constructor failed: its error, once
        exit_with(Failure(f"building the policy raised {type(e).__name__}: {e}"), FAILED)
    print(f"checking {subject.cls.__module__}.{subject.cls.__qualname__} on {len(subject.batch['actions'])} samples of "
          f"{subject.cfg.data.resolved_root}", flush=True)
    results = run_checks(subject, args.only, args.deadline_s, report=lambda r: print(r.line(), flush=True))
    failed = [r.check for r in results if r.status == "fail"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed or skipped in {time.monotonic() - t0:.0f}s"
          + (f"; failed: {failed}" if failed else ""))
    sys.exit(1 if failed else 0)

