"""python -m slurmvla.table: a sweep's closed-loop evaluations as the published protocol reports them (the mean of
each run's best 5 evaluations, then mean ± std over seeds), against figures computed by hand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurmvla.table import main

# 3D Diffusion Policy's published Meta-World rows: data beside the results they are compared with, not code.
PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "metaworld_labelled_4000" / "published.json"


def write_run(root, name: str, task: str, seed: int, rates: dict[int, float], policy: str = "keypoints_flow",
              final: float | None = None):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(
        f"policy:\n  name: custom\n  size: {policy}\ntrainer:\n  seed: {seed}\nrollout:\n  env: metaworld\n  task: {task}\n")
    for step, rate in rates.items():
        folder = run / "rollout" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / "rollout.json").write_text(json.dumps({"step": step, "rollout/success_rate": rate, "rollout/episodes": 20}))
    if final is not None:  # python -m slurmvla.rollout RUN rollout.episodes=100 --out RUN/rollout/final
        folder = run / "rollout" / "final"
        folder.mkdir(parents=True)
        (folder / "rollout.json").write_text(json.dumps({"step": max(rates), "rollout/success_rate": final,
                                                         "rollout/episodes": 100}))
    return run


def test_each_run_counts_its_best_five_evaluations_and_seeds_give_mean_and_std(tmp_path, capsys):
    sweep = tmp_path / "multirun"
    # Seed 0: seven evaluations; the best five are 0.9, 0.8, 0.7, 0.6, 0.5 -> 70 %; its last is 0.5.
    # The final checkpoints on 100 episodes: 0.42 and 0.30 -> 36 +- 6 %.
    write_run(sweep, "0", "hammer-v3", 0, {100: 0.1, 200: 0.5, 300: 0.9, 400: 0.6, 500: 0.8, 600: 0.7, 700: 0.5},
              final=0.42)
    # Seed 1: three evaluations (fewer than five: all of them) -> (0.2 + 0.4 + 0.3) / 3 = 30 %; last 0.3.
    write_run(sweep, "1", "hammer-v3", 1, {100: 0.2, 200: 0.4, 300: 0.3}, final=0.30)
    write_run(sweep, "2", "button-press-v3", 0, {100: 1.0})
    # Two seeds, one with its final checkpoint on 100 episodes: that one alone, said so.
    write_run(sweep, "4", "disassemble-v3", 0, {100: 0.2}, final=0.5)
    write_run(sweep, "5", "disassemble-v3", 1, {100: 0.4})
    (sweep / "multirun.yaml").write_text("not a run\n")
    (sweep / "3").mkdir()  # a job that never wrote its config: no run
    main([str(sweep), "--no-plot", "--published", str(PUBLISHED)])
    table = json.loads((sweep / "table.json").read_text())
    rows = {r["task"]: r for r in table["rows"]}
    assert rows["hammer-v3"]["seeds"] == [0, 1]
    assert rows["hammer-v3"]["best"] == pytest.approx([50.0, 20.0])  # mean of 70 and 30, population std
    assert rows["hammer-v3"]["final"] == pytest.approx([40.0, 10.0])  # 50 and 30
    assert rows["hammer-v3"]["final_checkpoint"]["success"] == pytest.approx([36.0, 6.0])
    assert rows["button-press-v3"]["best"] == pytest.approx([100.0, 0.0])
    assert rows["button-press-v3"]["final_checkpoint"] is None
    text = (sweep / "table.md").read_text()
    assert ("| hammer-v3 | keypoints_flow | 0,1 | 50.0 ± 20.0 | 40.0 ± 10.0 | 36.0 ± 6.0 (100 episodes) | 15 ± 6 "
            "| 76 ± 4 |") in text
    assert "| button-press-v3 | keypoints_flow | 0 | 100.0 ± 0.0 | 100.0 ± 0.0 | - | 99 ± 1 | - |" in text
    assert ("| disassemble-v3 | keypoints_flow | 0,1 | 30.0 ± 10.0 | 30.0 ± 10.0 | 50.0 ± 0.0 (100 episodes, 1 of 2 "
            "seeds) | 43 ± 7 | 69 ± 4 |") in text
    # The mean over hammer and disassemble (button-press, the sanity task, left out), per seed then over seeds:
    # best 5: seed 0 (70 + 20) / 2 = 45, seed 1 (30 + 40) / 2 = 35 -> 40 +- 5; last: 35 and 35 -> 35 +- 0;
    # final checkpoints: seed 0 (42 + 50) / 2 = 46, seed 1 has none on disassemble; published (15 + 43) / 2,
    # (76 + 69) / 2.
    [mean] = table["means"]
    assert mean["tasks"] == ["disassemble-v3", "hammer-v3"] and mean["seeds"] == [0, 1]
    assert mean["best"] == pytest.approx([40.0, 5.0]) and mean["final"] == pytest.approx([35.0, 0.0])
    assert ("| mean of 2 tasks | keypoints_flow | 0,1 | 40.0 ± 5.0 | 35.0 ± 0.0 | 46.0 ± 0.0 (100 episodes, 1 of 2 "
            "seeds) | 29.0 | 72.5 |") in text
    assert text in capsys.readouterr().out
    assert "Published: 3D Diffusion Policy (Ze et al., RSS 2024), Table XVIII; Meta-World v2 tasks." in text
    # The file in the sweep's own folder is read without --published (the committed results' command); without
    # either, the table has no published columns.
    shutil.copy(PUBLISHED, sweep / "published.json")
    main([str(sweep), "--no-plot", "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "table.md").read_text() == text
    (sweep / "published.json").unlink()
    main([str(sweep), "--no-plot", "--out", str(tmp_path / "bare")])
    bare = (tmp_path / "bare" / "table.md").read_text()
    assert "DP3" not in bare and "Published" not in bare
    assert "| hammer-v3 | keypoints_flow | 0,1 | 50.0 ± 20.0 | 40.0 ± 10.0 | 36.0 ± 6.0 (100 episodes) |\n" in bare


def test_the_mean_over_tasks_counts_only_the_seeds_every_task_has(tmp_path):
    sweep = tmp_path / "multirun"
    write_run(sweep, "a0", "hammer-v3", 0, {100: 0.6}, final=0.5)
    write_run(sweep, "a1", "hammer-v3", 1, {100: 0.2}, final=0.1)  # seed 1 has no assembly run: not in the mean
    write_run(sweep, "b0", "assembly-v3", 0, {100: 0.2}, final=0.3)
    write_run(sweep, "c0", "assembly-v3", 0, {100: 0.9}, policy="small")  # one task: no mean for this policy
    main([str(sweep), "--no-plot", "--reference", "none"])
    [mean] = json.loads((sweep / "table.json").read_text())["means"]
    assert mean["policy"] == "keypoints_flow" and mean["seeds"] == [0] and mean["published"] == {}
    assert mean["best"] == pytest.approx([40.0, 0.0]) and mean["final_checkpoint"]["success"] == pytest.approx([40.0, 0.0])
    assert "| mean of 2 tasks | keypoints_flow | 0 | 40.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 (100 episodes) |" in (
        sweep / "table.md").read_text()


def test_mistakes_are_one_line_naming_the_value(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "slurmvla.table", *args], capture_output=True, text=True)

    (tmp_path / "bad.json").write_text('{"dp3": {"rows": {}}}')
    for args, message in (([str(tmp_path / "nowhere")], "is not a folder"),
                          ([str(tmp_path)], "holds no run with a closed-loop evaluation"),
                          ([str(tmp_path), "--published", str(PUBLISHED), "--reference", "dp4"],
                           "--reference='dp4' is not valid; choose one of ['dp3', 'none']"),
                          ([str(tmp_path), "--reference", "dp3"], "--reference='dp3' is not valid; choose one of ['none'] "
                                                                  "(no published figures are given"),
                          ([str(tmp_path), "--published", str(tmp_path / "none.json")], "is not a file"),
                          ([str(tmp_path), "--published", str(tmp_path / "bad.json")], "is not a published-figures file"),
                          ([str(tmp_path), "--best", "0"], "--best=0 must be at least 1")):
        done = run(*args)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)


MT50_PUBLISHED = PUBLISHED.parents[1] / "mt50" / "published.json"


def write_suite_run(root, name: str, seed: int, groups_by_step: dict[int, dict[str, tuple[int, int]]]):
    """A run over MT50 (rollout.env=mt50): each evaluation's rollout.json reports its groups' successes/episodes."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(
        f"policy:\n  name: keypoints_flow\ntrainer:\n  seed: {seed}\nrollout:\n  env: mt50\n  task: null\n")
    for step, groups in groups_by_step.items():
        folder = run / "rollout" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        wins, n = sum(w for w, _ in groups.values()), sum(e for _, e in groups.values())
        (folder / "rollout.json").write_text(json.dumps({
            "step": step, "rollout/success_rate": wins / n, "rollout/episodes": n,
            "groups": {g: {"successes": w, "episodes": e, "success_rate": w / e} for g, (w, e) in groups.items()}}))
    return run


def test_a_suite_run_is_reported_per_group_and_averaged_over_groups_as_mt50_is(tmp_path):
    sweep = tmp_path / "mt50"
    # Seed 0's last evaluation: easy 210/280 = 75 %, medium 44/110 = 40 %, hard 18/60 = 30 %, very hard 10/50 = 20 %:
    # the MT50 average is the mean of the groups, 41.25 %, not the 282/500 = 56.4 % of its episodes.
    write_suite_run(sweep, "s0", 0, {1000: {"easy": (100, 280), "medium": (10, 110), "hard": (0, 60), "very_hard": (0, 50)},
                                     2000: {"easy": (210, 280), "medium": (44, 110), "hard": (18, 60), "very_hard": (10, 50)}})
    # Seed 1: easy 70 %, medium 30 %, hard 20 %, very hard 40 % -> 40 %.
    write_suite_run(sweep, "s1", 1, {2000: {"easy": (196, 280), "medium": (33, 110), "hard": (12, 60), "very_hard": (20, 50)}})
    main([str(sweep), "--no-plot", "--best", "1", "--published", str(MT50_PUBLISHED)])
    table = json.loads((sweep / "table.json").read_text())
    rows = {r["task"]: r for r in table["rows"]}
    assert set(rows) == {"easy", "medium", "hard", "very_hard"} and rows["easy"]["seeds"] == [0, 1]
    assert rows["easy"]["final"] == pytest.approx([72.5, 2.5])
    assert rows["very_hard"]["final"] == pytest.approx([30.0, 10.0])
    [mean] = table["means"]
    assert mean["groups"] and sorted(mean["tasks"]) == sorted(rows)
    assert mean["final"] == pytest.approx([40.625, 0.625])  # 41.25 and 40.0
    # SmolVLA (0.45B)'s published groups average to its published 57.3.
    assert mean["published"]["SmolVLA (0.45B)"] == pytest.approx(57.325)
    text = (sweep / "table.md").read_text()
    assert "| mean of 4 groups | keypoints_flow | 0,1 |" in text and "| easy | keypoints_flow | 0,1 |" in text
    assert "| 82.5 |" in text  # a published figure without a spread
