"""How a program reports a user's mistake: one line."""

from __future__ import annotations


def one_line(e: Exception) -> str:
    """An error as one line: OmegaConf's type errors span several ("Value 'x' could not be converted
    ... \\n full_key: serve.port ..."); keep the first, prefixed by the key it names."""
    lines = str(e).splitlines() or [type(e).__name__]
    key = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.strip().startswith("full_key:")), None)
    return f"{key}: {lines[0]}" if key else " ".join(ln.strip() for ln in lines)
