"""SLURM hostlist expressions: ``n[1-3,5],gpu-a[01-02]`` -> n1 n2 n3 n5 gpu-a01 gpu-a02."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(expr: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"invalid nodelist {expr!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"invalid nodelist {expr!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"invalid nodelist {expr!r}: unclosed '['")
    parts.append(expr[start:])
    return parts


def _expand_one(item: str, expr: str) -> list[str]:
    """One host pattern, possibly with several bracket groups (``r[1-2]n[3-4]``)."""
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        if not item or any(c in item for c in "[], "):
            raise ValueError(f"invalid nodelist {expr!r}: bad host name {item!r}")
        return [item]
    head, body, tail = item[: m.start()], m.group(1), item[m.end() :]
    values: list[str] = []
    for piece in body.split(","):
        r = _RANGE.match(piece)
        if r is None:
            raise ValueError(f"invalid nodelist {expr!r}: bad range {piece!r} in [{body}]")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"invalid nodelist {expr!r}: range {piece!r} runs backwards")
        width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return [f"{head}{v}{rest}" for v in values for rest in _expand_one(tail, expr)] if tail else [f"{head}{v}" for v in values]


def expand_nodelist(expr: str) -> list[str]:
    expr = expr.strip()
    if not expr:
        raise ValueError("invalid nodelist '': empty")
    hosts: list[str] = []
    for item in _split_top_level(expr):
        hosts.extend(_expand_one(item.strip(), expr))
    return hosts
