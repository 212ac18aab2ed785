"""slurmvla.garbage_collector: the garbage collector paused through a program's start, frozen before a loader's fork,
and only what it froze handed back at a run's end."""

from __future__ import annotations

import gc

import pytest

from slurmvla import garbage_collector
from slurmvla.data import video


@pytest.fixture(autouse=True)
def _nothing_frozen():
    garbage_collector.thaw()  # what an earlier test's loader or program froze in this process
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.enable()


def test_a_runs_end_hands_back_what_a_fork_froze_and_leaves_a_callers_own_freeze():
    """The trainer's close thaws what a loader's fork froze, so the run's engine cycles can be collected; a
    process that froze its imports itself (tests/dist_driver.py: each later collection then skips them) keeps
    that freeze through a run without data workers."""
    gc.freeze()
    mine = gc.get_freeze_count()
    assert mine > 1000
    garbage_collector.thaw()  # nothing of the collector's froze anything: the freeze stays (less what refcounting freed
    assert gc.get_freeze_count() > mine // 2  # since, a handful; gc.unfreeze would leave 0)
    video._before_fork()
    garbage_collector.thaw()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # the caller's own again: a fork's freeze is handed back once, not at every later thaw
    again = gc.get_freeze_count()
    garbage_collector.thaw()
    assert gc.get_freeze_count() > again // 2


def test_a_start_runs_without_collections_and_leaves_what_it_built_frozen():
    collections = []

    def count(phase, info):
        if phase == "stop":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with garbage_collector.paused():
            assert not gc.isenabled()
            built = [[i] for i in range(50_000)]  # enough new containers for collections, were it on
        assert collections == [] and gc.isenabled()
        assert gc.get_freeze_count() >= len(built)
        gc.collect()
        assert collections, "the collector runs again"
    finally:
        gc.callbacks.remove(count)
    garbage_collector.thaw()
    assert gc.get_freeze_count() == 0


def test_a_start_that_fails_freezes_nothing_and_a_collector_left_off_stays_off():
    with pytest.raises(ValueError, match="bad value"), garbage_collector.paused():
        raise ValueError("bad value")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()  # the caller's choice: paused() neither turns it on nor freezes
    with garbage_collector.paused():
        pass
    assert not gc.isenabled() and gc.get_freeze_count() == 0
