"""Will a training configuration fit on a GPU, and how fast will it go: a plan before submitting.

    python -m slurmvla.plan [train overrides] --gpu h100-80gb [--nodes N] [--gpus-per-node G] [--compare] [--json OUT]
    python -m slurmvla.plan policy=pi05 precision=bf16 --gpu rtx4090-24gb
    python -m slurmvla.plan policy=pi05 precision=bf16 engine=fsdp_full --gpu h100-80gb --gpus-per-node 8 --compare
    python -m slurmvla.plan experiment=pi05_droid policy.stats_source=data --network h100-sxm-ib400 --nodes 1,2,4,8,16,64

Nothing is allocated and no GPU is needed. Per GPU (the worst rank): the model states, counted exactly from
the policy built on the meta device, by the engine's own memory rules; the activations of one micro-batch,
measured on fake tensors (an analytic ESTIMATE where a policy cannot run on them); the peak against the GPU's
memory less a reserve and a margin, and the largest micro-batch that fits. The step time is an ESTIMATE from
the FLOPs counted at an assumed utilization. With several node counts (or ``--network``): every engine's step
time, samples/s and scaling on that many nodes, from the collectives each step issues (counted exactly) timed
on the network's links, with the recommended engine and shard degree (ESTIMATES). What each figure means and
how well it holds: docs/plan.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
from pathlib import Path
from typing import Any

from slurmvla.cli import ArgumentParser, program
from slurmvla.compose import compose, group_options
from slurmvla.config import Config
from slurmvla.errors import boundary
from slurmvla.planner import PlanError
from slurmvla.planner.gpus import DEFAULT_MARGIN, DEFAULT_UTILIZATION, GPU, GPUS
from slurmvla.planner.network import NETWORKS, load_network
from slurmvla.planner.recompute_choice import AUTO, choose
from slurmvla.planner.report import format_comparison, format_plan, format_scaling


def run(overrides: list[str], gpu: GPU, nodes: int, gpus_per_node: int, compare: bool = False,
        margin: float = DEFAULT_MARGIN, utilization: float = DEFAULT_UTILIZATION) -> tuple[list[dict[str, Any]], str]:
    """The plan of the configuration the overrides compose, or (``compare``) of every engine that can run on
    this many GPUs; and the configured engine's name."""
    from slurmvla.planner.fit import compare_engines, plan_engine, planner_for  # torch: after the arguments

    cfg = compose(overrides)

    def plan(c: Config) -> dict[str, Any]:
        # policy.gradient_checkpointing=auto: the setting training would choose on this GPU, planned, and why.
        choice = None
        if getattr(c.policy, "gradient_checkpointing", None) == AUTO:
            choice = choose(c, gpu, nodes, gpus_per_node, margin)
            c = choice.setting.apply(c)
        r = plan_engine(planner_for(c), c, gpu, nodes, gpus_per_node, margin, utilization)
        if choice is not None:
            r["auto_recompute"] = choice.line()
        return r

    if not compare:
        return [plan(cfg)], cfg.engine.name
    rows = []
    # An engine's file in conf/engine/ where it has one (an engine without is its schema's defaults); the
    # name last, over an engine.name among the overrides.
    files = group_options("engine")
    for name in compare_engines(nodes * gpus_per_node):
        try:
            variant = compose([*overrides, *([f"engine={name}"] if name in files else []), f"engine.name={name}"])
            rows.append(plan(variant))
        except ValueError as e:  # e.g. zero3 refuses gradient checkpointing; hsdp degrees that do not multiply
            rows.append({"engine": name, "refused": f"refused: {str(e).splitlines()[0]}"})
    return rows, cfg.engine.name


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.plan"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="train overrides (key=value), as python -m slurmvla.train takes them")
    parser.add_argument("--gpu", default="h100-80gb", help=f"the GPU model: one of {list(GPUS)} (default h100-80gb)")
    parser.add_argument("--nodes", default="1",
                        help="nodes (default 1), or a comma-separated list of node counts: the scaling table")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (default 1; with --network, the network's)")
    parser.add_argument("--network", default=None,
                        help=f"the cluster's links for the scaling table: one of {list(NETWORKS)} or a YAML / JSON "
                             "file (docs/plan.md); default: the preset of --gpu's nodes")
    parser.add_argument("--compare", action="store_true", help="every engine side by side for this configuration")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--mfu", type=float, default=DEFAULT_UTILIZATION,
                        help="assumed fraction of the GPU's dense peak the step's FLOPs run at (default 0.4)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="fraction of the usable memory kept free for the allocator's fragmentation (default 0.05)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # PlanError, a config mistake (compose's one line), a batch that does not divide: one line, exit 2.
    with boundary():
        from slurmvla.planner.scaling import parse_nodes

        gpu = GPUS.get(args.gpu.lower())
        if gpu is None:
            raise PlanError(f"--gpu {args.gpu} is not a GPU the planner knows; choose one of {list(GPUS)}")
        nodes = parse_nodes(args.nodes)
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            raise PlanError(f"--gpus-per-node {args.gpus_per_node} is not valid; it must be >= 1")
        if not 0 < args.mfu <= 1:
            raise PlanError(f"--mfu {args.mfu} is not valid; it must be in (0, 1], e.g. 0.4")
        if not 0 <= args.margin < 1:
            raise PlanError(f"--margin {args.margin} is not valid; it must be in [0, 1), e.g. 0.05")
        if len(nodes) > 1 or args.network is not None:
            table, network = scaling(args, gpu, nodes)
            print(format_scaling(table))
            if args.json:
                args.json.write_text(json.dumps({"gpu": dataclasses.asdict(gpu), "network": dataclasses.asdict(network),
                                                 "scaling": table}, indent=2, default=str))
            return
        rows, configured = run(list(args.overrides), gpu, nodes[0], args.gpus_per_node or 1, args.compare,
                               args.margin, args.mfu)
    if args.compare:
        full = next((r for r in rows if "refused" not in r and r["engine"] == configured),
                    next((r for r in rows if "refused" not in r), None))
        if full is not None:
            print(format_plan(full), flush=True)
            print()
        print(f"all engines, {nodes[0] * (args.gpus_per_node or 1)} x {gpu.name}, "
              f"{' '.join(shlex.quote(o) for o in args.overrides) or 'defaults'}:")
        print(format_comparison(rows))
    else:
        print(format_plan(rows[0]))
    if args.json:
        args.json.write_text(json.dumps({"gpu": dataclasses.asdict(gpu), "plans": rows}, indent=2, default=str))


def scaling(args: argparse.Namespace, gpu: GPU, nodes: list[int]) -> tuple[dict[str, Any], Any]:
    """The scaling table on ``--network``'s nodes (by default the preset whose nodes carry ``--gpu``)."""
    from slurmvla.planner.scaling import scaling_table

    if args.network is None:
        presets = [n for n in NETWORKS.values() if n.gpu == gpu.name]
        if not presets:
            raise PlanError(f"--gpu {gpu.name}: no network preset has its nodes; give --network, one of {list(NETWORKS)} "
                            "or a file describing the cluster (docs/plan.md)")
        network = presets[0]
    else:
        network = load_network(args.network)
    if args.gpus_per_node is not None and args.gpus_per_node != network.gpus_per_node:
        network = dataclasses.replace(network, gpus_per_node=args.gpus_per_node)
    return scaling_table(list(args.overrides), gpu, network, nodes, args.mfu, args.margin), network


if __name__ == "__main__":
    main()
