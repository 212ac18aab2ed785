"""What one training forward keeps for the backward, by tensor shape: the plan's fake step against a real step on
this machine's device, the same configuration and micro-batch (world 1), to find where the plan's activations
differ from a GPU's (benchmarks/plan_vs_measured.py gives the totals; this, the tensors behind them).

    python benchmarks/saved_tensors.py policy=pi05 precision=bf16 trainer.compile=true \\
        policy.gradient_checkpointing=false --micro 16                                      # on a GPU
    python benchmarks/saved_tensors.py policy=pi05_tiny trainer.compile=true policy.gradient_checkpointing=false

Every tensor autograd saves during the forward (eager nodes and compiled regions alike, through
``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters and buffers left out, grouped by
(shape, dtype): how many and how many GiB on each side, the groups whose bytes differ most first. The plan fills
the prompt to policy.max_text_len; here it is planned at the real batch's own prompt length, so the shapes match.
The real side runs one forward + backward first (a compiled step compiles there), then the forward it measures.
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch

from slurmvla.compose import compose
from slurmvla.planner.fit import planner_for
from slurmvla.planner.model_states import model_states
from slurmvla.trainer import Trainer

GiB = 2**30


class SavedByShape:
    """Bytes autograd keeps for the backward while inside, per (shape, dtype) of the first tensor seen on each
    storage; storages of ``known`` tensors (parameters, buffers) never count."""

    def __init__(self, known):
        self.known = {t.untyped_storage()._cdata for t in known}
        self.seen: set[int] = set()
        self.groups: collections.Counter = collections.Counter()
        self.counts: collections.Counter = collections.Counter()

    @property
    def bytes(self) -> int:
        return sum(self.groups.values())

    def __enter__(self) -> SavedByShape:
        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st._cdata not in self.known and st._cdata not in self.seen:
                self.seen.add(st._cdata)
                key = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                self.groups[key] += st.nbytes()
                self.counts[key] += 1
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.hooks.__exit__(*exc)


def real_side(base: list[str], micro: int) -> tuple[SavedByShape, int | None]:
    """The saved tensors of a real forward at ``micro`` on this machine's device, and the batch's prompt length."""
    from max_micro_batch import prompt_length, tile  # a sibling script

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(compose([*base, f"trainer.global_batch_size={micro}"]), run_dir)
        try:
            batch = trainer._next_batch()
            batch = tile(batch, micro) if len(batch["actions"]) != micro else batch
            prompt = prompt_length(batch)
            trainer.model.train()
            with trainer.engine.autocast():
                out = trainer.model(batch)
            trainer.engine.backward(out["loss"])  # a compiled step compiles its backward here too
            del out
            trainer.optimizer.zero_grad(set_to_none=True)
            known = [*trainer.policy.parameters(), *trainer.policy.buffers()]
            with SavedByShape(known) as saved, trainer.engine.autocast():
                out = trainer.model(batch)
            del out
        finally:
            trainer.close()
    return saved, prompt


def plan_side(base: list[str], micro: int, prompt: int | None) -> SavedByShape:
    extra = [f"policy.max_text_len={prompt}"] if prompt else []
    cfg = compose([*base, f"trainer.global_batch_size={micro}", *extra])
    planner = planner_for(cfg)
    step = planner._step(on_meta=not planner.compiled(cfg))  # the compiled layers trace on fake tensors
    compute = model_states(cfg, planner.tensors, 1, 1).compute
    with SavedByShape([*step.policy.parameters(), *step.policy.buffers()]) as saved:
        step.run(micro, compute, cfg.precision == "bf16", compiled=planner.compiled(cfg))
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, default=4, help="the micro-batch (default 4)")
    parser.add_argument("--top", type=int, default=20, help="groups shown (default 20)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = ["logging.wandb.mode=disabled", "trainer.progress_bar=false", "checkpoint.resume=false",
            "data.num_workers=0", f"trainer.device={device}", *args.overrides]
    real, prompt = real_side(base, args.micro)
    plan = plan_side(base, args.micro, prompt)
    where = torch.cuda.get_device_name() if device == "cuda" else "this CPU"
    print(f"saved for the backward, micro-batch {args.micro}, {' '.join(args.overrides)}; plan (fake tensors) "
          f"against {where}{f', prompt {prompt} tokens' if prompt else ''}")
    total = {"plan": plan.bytes, "real": real.bytes}
    print(f"total: plan {total['plan'] / GiB:.3f} GiB in {sum(plan.counts.values())} tensors, real "
          f"{total['real'] / GiB:.3f} GiB in {sum(real.counts.values())} ({total['plan'] / max(total['real'], 1) - 1:+.1%})")
    keys = sorted(set(plan.groups) | set(real.groups), key=lambda k: -abs(plan.groups[k] - real.groups[k]))
    print(f"{'shape':>30s} {'dtype':>9s} {'plan n':>7s} {'plan GiB':>9s} {'real n':>7s} {'real GiB':>9s} {'diff GiB':>9s}")
    for k in keys[: args.top]:
        diff = plan.groups[k] - real.groups[k]
        print(f"{str(list(k[0])):>30s} {k[1]:>9s} {plan.counts[k]:7d} {plan.groups[k] / GiB:9.4f} {real.counts[k]:7d} "
              f"{real.groups[k] / GiB:9.4f} {diff / GiB:+9.4f}")


if __name__ == "__main__":
    main()
