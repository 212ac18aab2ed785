"""Real-time chunking in closed loop: success and smoothness of each execution mode as the inference delay grows.
A policy trained with training-time RTC (policy.rtc_training) answers rtc by its clean prefix, any other flow
policy by guidance: run this once per policy to compare them.

    python benchmarks/rtc.py RUN_DIR [--modes sync async rtc] [--delays 0 1 2 4 8] [--episodes 100] [overrides ...]

``RUN_DIR``: a trained policy (a run directory, checkpoint or exported file) of a simulated task, e.g.
``bash scripts/sim_demo.sh policy=keypoints_flow``'s (the pick task), or an ``experiment=metaworld`` run's (the
episodes run in the run's ``rollout.env`` and ``rollout.task``). The policy is loaded once and served on
127.0.0.1; for each mode and delay d (control steps the arm keeps executing, or holds in sync, while a request is
outstanding) the same episodes run on seeds from ``--first-seed`` (no demonstration used them: the recorders'
seeds are far below).
Prints per row: success rate with its 95 % Wilson interval, mean episode length, the mean / max action jump
|a_t - a_(t-1)| at chunk switches and within chunks, and the mean steps held. ``--json OUT`` keeps every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurmvla.inference.build import build_server  # noqa: E402
from slurmvla.inference.closed_loop import replan_of, require_sim, run_served, summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--modes", nargs="+", default=["sync", "async", "rtc"])
    parser.add_argument("--delays", nargs="+", type=int, default=[0, 1, 2, 4, 8])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=200_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides (serve.*, rollout.replan_steps=...)")
    args = parser.parse_intermixed_args()
    require_sim()
    server = build_server(args.source, [*args.overrides, "serve.host=127.0.0.1", "serve.port=0"], environ={})
    base = server.policy.loaded.cfg.rollout
    meta = server.policy.metadata()
    offered = meta.get("execution_modes", ["sync", "async"])
    # How this policy answers rtc: inference-time guidance, or (trained with policy.rtc_training) its clean prefix.
    method = meta.get("rtc", {}).get("method")
    rows = []
    replan = base.replan_steps or ", ".join(
        f"{m} {replan_of(dataclasses.replace(base, execution=m), meta['action_horizon'])}" for m in args.modes)
    print(f"{args.source}: replan_steps {replan}, {args.episodes} episodes per row from seed "
          f"{args.first_seed}; modes the server offers: {offered}" + (f" (rtc by {method})" if method else ""),
          flush=True)
    print(f"{'mode':>5} {'d':>2} {'k':>2}  {'success (95% CI)':>22}  {'length':>6}  {'switch jump mean/max':>21}  "
          f"{'within jump mean/max':>21}  {'held':>5}  {'wall s':>6}", flush=True)
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    for mode in args.modes:
        if mode not in offered:
            print(f"{mode:>5}: not offered by this server (policy {server.policy.loaded.cfg.policy.name})", flush=True)
            continue
        for d in args.delays:
            cfg = dataclasses.replace(base, execution=mode, delay_steps=d, delay="fixed", videos=0,
                                      episodes=args.episodes, first_seed=args.first_seed)
            start = time.perf_counter()
            s = summarize(run_served(server, cfg, seeds, None), time.perf_counter() - start)
            row = {"mode": mode, "rtc_method": method if mode == "rtc" else None, "delay": d, **{k.removeprefix("rollout/"): v for k, v in s.items() if k != "episodes"}}
            rows.append(row)
            print(f"{mode:>5} {d:>2} {row['replan_steps']:>2}  {row['success_rate']:.2f} ({row['success_ci95_low']:.2f}-"
                  f"{row['success_ci95_high']:.2f}) {row['successes']:>3}/{row['episodes']:<3}  "
                  f"{row['mean_length']:6.1f}  {row['switch_jump_mean']:10.3f}/{row['switch_jump_max']:<10.3f}  "
                  f"{row['within_jump_mean']:10.3f}/{row['within_jump_max']:<10.3f}  {row['mean_hold_steps']:5.1f}  "
                  f"{row['wall_s']:6.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"source": args.source, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
