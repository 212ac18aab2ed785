"""The property-based tests' settings (Hypothesis) and their tally: generated inputs at the boundaries a user or a
robot feeds (the server's request, the data files, the configuration), docs/testing.md#property-based-tests.

Two budgets, one test each per boundary (:data:`DEPTHS`):

- ``default``, in the suite: derandomized (the same inputs on every run and machine, so a failure is the code's,
  never the draw's), no example database, no deadline (the machines' speed varies); each boundary names its count.
- ``deep``, marked slow and run only with ``HYPOTHESIS_PROFILE=deep``: inputs drawn at random, many more of them,
  and the example database (``.hypothesis/``) so a failure found is tried first on the next run.

Each test counts what it tried and how each input ended (:class:`Tally`) and prints it (``pytest -s`` shows it):
the figures in docs/testing.md are those lines. Every failure a run found is fixed in the product and kept as an
explicit example (``examples=`` of :func:`run`), tried first by both budgets.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis.strategies import SearchStrategy

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "default")
# Generation that is slow (a server round trip, a dataset read per input) is the point here, not a problem.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("default", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=_QUIET)
settings.register_profile("deep", derandomize=False, deadline=None, print_blob=True, suppress_health_check=_QUIET)
settings.load_profile(PROFILE)

DEPTHS = [pytest.param("default"),
          pytest.param("deep", marks=[pytest.mark.slow, pytest.mark.skipif(
              PROFILE != "deep", reason="the deeper run: HYPOTHESIS_PROFILE=deep python -m pytest -m slow -s ...")])]


class Tally(collections.Counter):
    """How the inputs of one property run ended, by kind (``refused``, ``answered``, ``skipped``, ...)."""

    def line(self, name: str) -> str:
        parts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.items()))
        return f"{name}: {self.total()} inputs ({parts})"


def run(depth: str, strategy: SearchStrategy, check: Callable[[Any], None], budget: dict[str, int],
        examples: Iterable[Any] = ()) -> None:
    """``check`` on ``budget[depth]`` inputs drawn from ``strategy`` (after ``examples``, the failures found before),
    under the ``depth`` profile's settings."""
    test = given(strategy)(check)
    for value in examples:
        test = example(value)(test)
    settings(settings.get_profile(depth), max_examples=budget[depth])(test)()
