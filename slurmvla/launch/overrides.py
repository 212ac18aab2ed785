"""``EXTRA_TAIL_OVERRIDES``: Hydra overrides from the environment, split like a shell would.

The string is data, never code: it is split with ``shlex`` (POSIX quoting, so ``key='a b'`` and
``key="x y"`` are one override each) and nothing in it is expanded or executed: ``$(...)``,
backticks and ``;`` reach Hydra as literal text. The wrappers call this module instead of
``eval``-ing the string, and it travels as an environment variable, so it survives ``bash
wrapper.sh`` (a child process), unlike a bash array.

    python -m slurmvla.launch.overrides            # prints the overrides NUL-separated, for bash
"""

from __future__ import annotations

import os
import shlex
import sys

ENV_NAME = "EXTRA_TAIL_OVERRIDES"


def split_overrides(text: str | None) -> list[str]:
    if not text or not text.strip():
        return []
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError as e:
        raise ValueError(f"{ENV_NAME} cannot be split ({e}): {text!r}") from None


def main() -> None:
    try:
        parts = split_overrides(os.environ.get(ENV_NAME))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write("".join(f"{p}\0" for p in parts))


if __name__ == "__main__":
    main()
