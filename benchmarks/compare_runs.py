"""Two runs' closed-loop evaluations, episode by episode: the same seeds, successes and lengths, and how far the
returns are apart. Exits non-zero where an outcome differs.

    python benchmarks/compare_runs.py benchmarks/results/metaworld_labelled_4000/hammer-v3_s2 \\
        benchmarks/results/metaworld_labelled_4000_rerun/hammer-v3_s2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(a: str, b: str) -> int:
    differ = 0
    for path in sorted(Path(a).glob("rollout/*/rollout.json")):
        other = Path(b) / path.relative_to(a)
        if not other.is_file():
            print(f"{path.parent.name}: missing in {b}")
            differ += 1
            continue
        x, y = (json.loads(p.read_text())["episodes"] for p in (path, other))
        outcomes = [(e["seed"], e["success"], e["length"]) for e in x] == [(e["seed"], e["success"], e["length"]) for e in y]
        returns = [abs(e["return"] - f["return"]) for e, f in zip(x, y)]
        print(f"{path.parent.name}: {sum(e['success'] for e in x)} / {sum(e['success'] for e in y)} successes of {len(x)}, "
              f"outcomes {'equal' if outcomes else 'DIFFER'}, returns bit-equal on {returns.count(0.0)} of {len(x)} "
              f"(largest difference {max(returns):.1e})")
        differ += not outcomes
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
