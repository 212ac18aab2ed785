"""The programs' command line: their argument parser and the name each is run by.

Foundation (docs/architecture.md): argparse only, nothing of the composition (Hydra) or of torch, so a program
reads its arguments (and answers ``--help``) before it loads anything. A program then runs its work inside
:func:`slurmvla.errors.boundary`, the one error boundary beside this module (its exit-code rule is there).
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from slurmvla.errors import USAGE


def program(module: str) -> str:
    """A program's name as its user types it: ``python -m slurmvla.X``, or the console script that started it
    (``slurmvla-serve``); argparse's default would be the file's name (``serve.py``), which runs nothing."""
    started = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return started if started.startswith("slurmvla-") else f"python -m {module}"


class ArgumentParser(argparse.ArgumentParser):
    """The programs' command-line parser: a usage mistake (an unknown flag, a missing argument, a value of the
    wrong type) prints one ``error:`` line, as every other mistake does, and exits 2 (``errors.USAGE``). Each program names
    itself with ``prog=program("slurmvla.X")``."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(USAGE, f"error: {message} (--help lists the arguments)\n")
