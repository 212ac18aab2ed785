"""One error boundary for every program.

A user's mistake (a bad value, option, file or command line: a ``ValueError``) is one ``error:`` line on stderr
and exit code 2. A failure of what the run stands on (a disk that filled, a peer that stopped answering, a
dataset file that cannot be read: a :class:`Failure`) is one line and exit code 1. Anything else is the
project's own bug and keeps its traceback. Every program's ``main`` runs its work inside :func:`boundary`.

One exit-code rule (:func:`exit_code`): the error's class decides, never the moment it is found. A
:class:`Failure` exits 1 even where it is a ``ValueError`` too: ``slurmvla.data.DataError`` (a damaged or
incomplete dataset file) exits 1 whether start-up or a data loader worker mid-run reads it first, as
``python -m slurmvla.inspect --scan`` does when it finds one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import NoReturn

USAGE = 2  # the user's command, option, value or file is wrong
FAILED = 1  # the disk, a peer or a file failed while the program ran

# OmegaConf's and Hydra's context lines under their message: the key is kept (as a prefix), the rest dropped.
CONTEXT = ("full_key:", "reference_type=", "object_type=", "Set the environment variable HYDRA_FULL_ERROR")


class Failure(RuntimeError):
    """Not a mistake in the command and not a bug: something the run stands on failed. The message names
    what (the path, the rank) and what to do."""


def one_line(error: BaseException | str) -> str:
    """``error`` as one line: an error's own :meth:`line` when it has one (an error re-raised from a worker
    carries the worker's traceback), else its message's lines joined, without OmegaConf's context lines,
    prefixed by the ``full_key`` they name."""
    if isinstance(error, BaseException) and callable(getattr(error, "line", None)):
        return error.line()
    text = str(error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    kept = [ln for ln in lines if not ln.startswith(CONTEXT)]
    body = kept[0] if len(kept) == 1 else "; ".join(ln.rstrip(".") for ln in kept)
    body = body or text.strip() or type(error).__name__
    return f"{key}: {body}" if key and isinstance(error, BaseException) and not body.startswith(key) else body


def exit_with(error: BaseException, code: int) -> NoReturn:
    """Say ``error`` in one line and exit with ``code``. Its traceback is dropped first: its frames may hold
    a data loader, whose workers would otherwise keep the exit waiting."""
    print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
    error.__traceback__ = None
    sys.exit(code)


def exit_code(error: BaseException) -> int:
    """The one rule: a :class:`Failure` (a ``DataError`` too) exits ``FAILED`` (1), a user's mistake ``USAGE`` (2)."""
    return FAILED if isinstance(error, Failure) else USAGE


@contextlib.contextmanager
def boundary(mistakes: tuple[type[BaseException], ...] = (ValueError,)) -> Iterator[None]:
    """A program's work: a :class:`Failure` exits 1, ``mistakes`` (default ``ValueError``) exit 2, each as one
    line (:func:`exit_code`); anything else passes with its traceback."""
    try:
        yield
    except (Failure, *mistakes) as e:
        exit_with(e, exit_code(e))
