"""A closed-loop sweep's evaluations gathered into one table and one plot, beside published rows where given.

    python -m slurmvla.table SWEEP_DIR [--out DIR] [--best 5] [--published FILE] [--reference NAME]

``SWEEP_DIR`` holds the runs of one sweep (a Hydra multirun's ``multirun/<date>/<time>/``, or any folder of run
directories): each run's ``config.resolved.yaml`` says its task (``rollout.env`` / ``rollout.task``), policy and
seed (``trainer.seed``), and its periodic closed-loop evaluations (``trainer.rollout_every_steps``) are its
``rollout/step_N/rollout.json``. Per run, as 3D Diffusion Policy reports (Ze et al., RSS 2024): the mean of its
``--best`` best evaluations; beside it the last evaluation (the final checkpoint's), and the final checkpoint's
evaluation on more episodes where the run has one (``RUN/rollout/final/rollout.json``, from ``python -m
slurmvla.rollout RUN rollout.episodes=100 rollout.first_seed=200000 --out RUN/rollout/final``: seeds the periodic
evaluations never drew). Per task and policy: the mean and standard deviation over seeds, in percent, beside the
published figures; per policy, the mean over its tasks (per seed that every task has, then over
those seeds; the sanity task button-press left out). Writes
``table.md`` (the rows and the commands' facts), ``table.json`` and ``success.png`` (success against training step,
one panel per task, every seed, the published figure drawn in) into ``--out`` (default ``SWEEP_DIR``).

    python -m slurmvla.train -m experiment=metaworld rollout.task=assembly-v3,hammer-v3 trainer.seed=0,1,2 \\
        trainer.rollout_every_steps=500 hydra/launcher=submitit_slurm
    python -m slurmvla.table multirun/2026-11-28/21-00-00

The published figures are data, not code: ``SWEEP_DIR/published.json`` when it is there, else ``--published FILE``
(e.g. ``benchmarks/results/metaworld_labelled_4000/published.json``, 3D Diffusion Policy's Meta-World rows). The
file maps a reference's name to its ``source`` (said under the table) and its ``rows``: a row's name -> task ->
``[mean, std]`` in percent. ``--reference`` picks one of its references (default: the first), ``none`` leaves them out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from slurmvla.cli import ArgumentParser, program
from slurmvla.errors import boundary

# Tasks that check the set-up rather than the policy (the paper's own sanity row): left out of the mean over tasks.
SANITY = frozenset({"button-press-v3"})
TABLE, JSON, PLOT = "table.md", "table.json", "success.png"
# The published figures beside a sweep's runs, read from the sweep's own folder when no --published names a file.
PUBLISHED = "published.json"
# A run's final checkpoint evaluated on more episodes than the periodic evaluations: RUN/FINAL/rollout.json.
FINAL = Path("rollout") / "final"


def read_run(run: Path) -> list[dict] | None:
    """One run's task, policy, seed and evaluations (step -> success rate), or None for a folder that is no run. A
    run over a suite of tasks (``rollout.env=mt50``: its summaries report ``groups``) counts once per group, the
    group standing for the task, as the MT50 table reports it."""
    from omegaconf import OmegaConf

    config = run / "config.resolved.yaml"
    if not config.is_file():
        return None
    cfg = OmegaConf.load(config)
    summaries = {int(s["step"]): s for s in (json.loads(p.read_text()) for p in sorted(run.glob("rollout/step_*/rollout.json")))}
    final = json.loads((run / FINAL / "rollout.json").read_text()) if (run / FINAL / "rollout.json").is_file() else None
    policy = str(cfg.policy.get("size") or cfg.policy.get("name"))
    seed = int(cfg.trainer.seed)
    groups = list(dict.fromkeys(g for s in [*summaries.values(), final or {}] for g in s.get("groups", {})))

    def rate(summary: dict, group: str | None) -> dict | None:
        if group is None:
            return {"success_rate": float(summary["rollout/success_rate"]), "episodes": int(summary["rollout/episodes"])}
        if group not in summary.get("groups", {}):
            return None
        g = summary["groups"][group]
        return {"success_rate": float(g["success_rate"]), "episodes": int(g["episodes"])}

    runs = []
    for group in groups or [None]:
        evaluations = {step: r for step, s in sorted(summaries.items()) if (r := rate(s, group)) is not None}
        last = None if final is None else rate(final, group)
        task = group or cfg.rollout.get("task") or cfg.rollout.get("env", "pick")
        runs.append({"run": str(run), "task": str(task), "policy": policy, "seed": seed, "evaluations": evaluations,
                     "final": None if last is None else {"step": int(final["step"]), **last},
                     **({"suite": str(cfg.rollout.env)} if group else {})})
    return runs


def runs_of(sweep: Path) -> list[dict]:
    """Every run under ``sweep`` (its own folder included), with at least one evaluation; a suite's run once per
    group."""
    found = [read_run(p.parent) for p in sorted(sweep.rglob("config.resolved.yaml"))]
    return [r for runs in found if runs is not None for r in runs if r["evaluations"]]


def best_mean(rates: list[float], best: int) -> float:
    """The mean of the ``best`` highest rates (all of them when there are fewer)."""
    top = sorted(rates, reverse=True)[:best]
    return sum(top) / len(top)


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and the population standard deviation (as the paper's ± over 3 seeds), in the values' units."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def gather(runs: list[dict], best: int = 5) -> list[dict]:
    """One row per (task, policy): per seed the best-``best`` mean, the last evaluation and the final checkpoint's
    evaluation on more episodes (where the run has one), then each over seeds (percent; the last over the seeds
    that have one, None where none has)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["policy"]), []).append(r)
    rows = []
    for (task, policy), members in sorted(groups.items()):
        members.sort(key=lambda r: r["seed"])
        per_seed = [{"seed": r["seed"],
                     "best": 100 * best_mean([e["success_rate"] for e in r["evaluations"].values()], best),
                     "final": 100 * r["evaluations"][max(r["evaluations"])]["success_rate"],
                     "final_step": max(r["evaluations"]), "evaluations": len(r["evaluations"]),
                     "episodes": r["evaluations"][max(r["evaluations"])]["episodes"],
                     "final_checkpoint": None if r["final"] is None else {
                         "success": 100 * r["final"]["success_rate"], "episodes": r["final"]["episodes"],
                         "step": r["final"]["step"]}} for r in members]
        finals = [s["final_checkpoint"] for s in per_seed if s["final_checkpoint"] is not None]
        rows.append({"task": task, "policy": policy, **({"suite": members[0]["suite"]} if "suite" in members[0] else {}),
                     "seeds": [s["seed"] for s in per_seed], "per_seed": per_seed,
                     "best": mean_std([s["best"] for s in per_seed]), "final": mean_std([s["final"] for s in per_seed]),
                     "final_checkpoint": None if not finals else {
                         "success": mean_std([f["success"] for f in finals]), "seeds": len(finals),
                         "episodes": sorted({f["episodes"] for f in finals})}})
    return rows


def over_tasks(rows: list[dict], reference: dict | None) -> list[dict]:
    """Per policy with two or more tasks (the sanity tasks left out): the mean over its tasks, per seed that every
    one of them has (a seed missing on one task is no seed of the mean), then mean ± std over those seeds; the
    final checkpoints' mean over the seeds whose every task has one; the published rows' mean over the same tasks
    where they cover them all. None of it where no seed is on every task."""
    ref = reference["rows"] if reference else {}
    means = []
    for policy in sorted({r["policy"] for r in rows}):
        members = [r for r in rows if r["policy"] == policy and r["task"] not in SANITY]
        if len(members) < 2:
            continue
        by_seed = [{s["seed"]: s for s in r["per_seed"]} for r in members]
        seeds = sorted(set.intersection(*(set(b) for b in by_seed)))
        if not seeds:
            continue
        per_seed = []
        for seed in seeds:
            runs = [b[seed] for b in by_seed]
            finals = [r["final_checkpoint"] for r in runs]
            per_seed.append({"seed": seed, "best": sum(r["best"] for r in runs) / len(runs),
                             "final": sum(r["final"] for r in runs) / len(runs),
                             "final_checkpoint": None if None in finals else {
                                 "success": sum(f["success"] for f in finals) / len(finals),
                                 "episodes": sorted({f["episodes"] for f in finals})}})
        checkpoints = [s["final_checkpoint"] for s in per_seed if s["final_checkpoint"] is not None]
        tasks = [r["task"] for r in members]
        means.append({"policy": policy, "tasks": tasks, "seeds": seeds, "per_seed": per_seed,
                      "groups": bool(members[0].get("suite")),
                      "best": mean_std([s["best"] for s in per_seed]), "final": mean_std([s["final"] for s in per_seed]),
                      "final_checkpoint": None if not checkpoints else {
                          "success": mean_std([c["success"] for c in checkpoints]), "seeds": len(checkpoints),
                          "episodes": sorted({e for c in checkpoints for e in c["episodes"]})},
                      "published": {name: sum(values[t][0] for t in tasks) / len(tasks)
                                    for name, values in ref.items() if all(t in values for t in tasks)}})
    return means


def markdown(rows: list[dict], ref: dict | None, best: int, means: list[dict] = ()) -> str:
    names = list(ref["rows"]) if ref else []
    head = ["task", "policy", "seeds", f"best {best} (mean ± std, %)", "last evaluation (mean ± std, %)",
            "final checkpoint, more episodes (mean ± std, %)", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        published = []
        for name in names:
            value = ref["rows"][name].get(row["task"])
            published.append("-" if not value else f"{value[0]}" if value[1] is None else f"{value[0]} ± {value[1]}")
        lines.append("| " + " | ".join([
            row["task"], row["policy"], ",".join(map(str, row["seeds"])),
            f"{row['best'][0]:.1f} ± {row['best'][1]:.1f}", f"{row['final'][0]:.1f} ± {row['final'][1]:.1f}",
            _final_cell(row["final_checkpoint"], len(row["seeds"])), *published]) + " |")
    for mean in means:
        published = [f"{mean['published'][name]:.1f}" if name in mean["published"] else "-" for name in names]
        lines.append("| " + " | ".join([
            f"mean of {len(mean['tasks'])} {'groups' if mean.get('groups') else 'tasks'}", mean["policy"], ",".join(map(str, mean["seeds"])),
            f"{mean['best'][0]:.1f} ± {mean['best'][1]:.1f}", f"{mean['final'][0]:.1f} ± {mean['final'][1]:.1f}",
            _final_cell(mean["final_checkpoint"], len(mean["seeds"])), *published]) + " |")
    if means:
        lines += ["", "The means over tasks (over a suite's groups, each group's rate over its tasks' episodes, as the "
                  "MT50 table averages): per seed that every task has, then mean ± std over those seeds; "
                  f"{', '.join(sorted(SANITY))} (a sanity check) left out."]
    if ref:
        lines += ["", f"Published: {ref['source']}."]
    return "\n".join(lines) + "\n"


def _final_cell(final: dict | None, seeds: int) -> str:
    """e.g. ``12.0 ± 0.0 (100 episodes)``; the seeds counted when not every seed has one; ``-`` when none has."""
    if final is None:
        return "-"
    mean, std = final["success"]
    episodes = "/".join(map(str, final["episodes"]))
    of = f", {final['seeds']} of {seeds} seeds" if final["seeds"] < seeds else ""
    return f"{mean:.1f} ± {std:.1f} ({episodes} episodes{of})"


def plot(runs: list[dict], rows: list[dict], out: Path, reference: dict | None) -> Path:
    """Success rate against training step, one panel per task, one line per (policy, seed), the published
    figures as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    cols = min(4, len(tasks))
    fig, axes = plt.subplots(math.ceil(len(tasks) / cols), cols, figsize=(3.2 * cols, 2.6 * math.ceil(len(tasks) / cols)),
                             squeeze=False)
    ref = reference["rows"] if reference else {}
    for ax, task in zip(axes.flat, tasks):
        for r in (r for r in runs if r["task"] == task):
            steps = list(r["evaluations"])
            ax.plot(steps, [100 * e["success_rate"] for e in r["evaluations"].values()], marker=".", lw=1,
                    label=f"{r['policy']} seed {r['seed']}")
        for k, (name, values) in enumerate(ref.items()):
            if task in values:
                ax.axhline(values[task][0], color=f"C{7 + k}", ls="--", lw=1, label=name)
        ax.set_title(task, fontsize=8)
        ax.set_ylim(-2, 102)
        ax.set_xlabel("training step", fontsize=7)
        ax.set_ylabel("success %", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.legend(fontsize=5)
    for ax in list(axes.flat)[len(tasks):]:
        ax.axis("off")
    fig.tight_layout()
    path = out / PLOT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_published(path: Path) -> dict[str, dict]:
    """A published-figures file (the module docstring): reference name -> ``{"source", "rows"}``, checked."""
    try:
        published = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--published={str(path)!r} does not read as JSON ({e})") from None
    ok = isinstance(published, dict) and published and all(
        isinstance(r, dict) and isinstance(r.get("source"), str) and isinstance(r.get("rows"), dict)
        and all(isinstance(v, dict) and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], (int, float))
                                            for x in v.values())
                for v in r["rows"].values()) for r in published.values())
    if not ok:
        raise ValueError(f"--published={str(path)!r} is not a published-figures file: "
                         '{"<reference>": {"source": "...", "rows": {"<row>": {"<task>": [mean, std or null], ...}}}}')
    return published


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=program("slurmvla.table"), description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a folder of run directories (a Hydra multirun's multirun/<date>/<time>/)")
    parser.add_argument("--out", help="where table.md, table.json and success.png go (default: SWEEP)")
    parser.add_argument("--best", type=int, default=5, help="evaluations averaged per run, the best ones (default 5)")
    parser.add_argument("--published", help=f"a file of published figures to put beside it (default: SWEEP/{PUBLISHED} "
                        "when it exists)")
    parser.add_argument("--reference", help="which reference of the published file (default: its first), or none")
    parser.add_argument("--no-plot", action="store_true", help="write the table only (no matplotlib needed)")
    args = parser.parse_args(argv)
    with boundary():
        sweep = Path(args.sweep).expanduser()
        if not sweep.is_dir():
            raise ValueError(f"SWEEP={args.sweep!r} is not a folder")
        if args.best < 1:
            raise ValueError(f"--best={args.best} must be at least 1")
        published_file = Path(args.published).expanduser() if args.published else sweep / PUBLISHED
        if args.published and not published_file.is_file():
            raise ValueError(f"--published={args.published!r} is not a file")
        published = read_published(published_file) if published_file.is_file() else {}
        reference = None if args.reference == "none" else args.reference or next(iter(published), None)
        if reference is not None and reference not in published:
            where = f"the references of {published_file}" if published else (
                f"no published figures are given: {sweep / PUBLISHED} or --published FILE")
            raise ValueError(f"--reference={args.reference!r} is not valid; choose one of {[*published, 'none']} "
                             f"({where})")
        runs = runs_of(sweep)
        if not runs:
            raise ValueError(f"{sweep} holds no run with a closed-loop evaluation (RUN/config.resolved.yaml beside "
                             "RUN/rollout/step_N/rollout.json: train with trainer.rollout_every_steps=N)")
        rows = gather(runs, args.best)
        out = Path(args.out).expanduser() if args.out else sweep
        out.mkdir(parents=True, exist_ok=True)
        chosen = published[reference] if reference is not None else None
        means = over_tasks(rows, chosen)
        (out / TABLE).write_text(markdown(rows, chosen, args.best, means))
        (out / JSON).write_text(json.dumps({"best": args.best, "reference": reference, "rows": rows, "means": means,
                                            "runs": runs}, indent=1) + "\n")
        written = [out / TABLE, out / JSON]
        if not args.no_plot:
            written.append(plot(runs, rows, out, chosen))
    print((out / TABLE).read_text(), end="")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
