"""The scheduler's GC policy: freezes what is alive on its period, and runs the scheduled full
collection, which reclaims a cycle made since and is timed."""

from __future__ import annotations

import gc
import weakref

from scheduler.contract.gcpolicy import GcPolicy


class Node:
    def __init__(self) -> None:
        self.other = self


def test_freeze_then_scheduled_full_collection_reclaims_cycles():
    now = [0.0]
    pauses: list[float] = []
    policy = GcPolicy(lambda: now[0], pauses.append, freeze_every_s=10.0, full_every_s=100.0)
    try:
        policy.step()  # the first step freezes
        assert gc.get_freeze_count() > 0
        cycle = Node()
        ref = weakref.ref(cycle)
        now[0] = 15.0
        policy.step()  # frozen with everything else alive
        del cycle
        gc.collect()
        assert ref() is not None  # frozen: the automatic collections leave it
        now[0] = 50.0
        policy.step()  # 35 s since the freeze: frozen again, no full collection yet
        assert pauses == [] and ref() is not None
        now[0] = 101.0
        policy.step()  # the scheduled full collection
        assert ref() is None and len(pauses) == 1 and pauses[0] >= 0.0
    finally:
        gc.unfreeze()


def test_a_cell_defers_the_full_collection_while_busy_at_most_max_defer():
    now = [0.0]
    pauses: list[float] = []
    policy = GcPolicy(lambda: now[0], pauses.append, freeze_every_s=10.0, full_every_s=100.0, max_defer_s=50.0)
    try:
        policy.step(idle=False)
        now[0] = 120.0
        policy.step(idle=False)  # due, but requests are in flight: deferred
        assert pauses == []
        now[0] = 130.0
        policy.step(idle=True)  # idle now: collected
        assert len(pauses) == 1
        now[0] = 290.0
        policy.step(idle=False)  # due again 60 s ago, past the 50 s it may wait: collected though busy
        assert len(pauses) == 2
    finally:
        gc.unfreeze()


def test_long_pauses_are_logged_once_per_process(caplog):
    import logging

    from scheduler.contract.gcpolicy import log_long_pauses

    before = list(gc.callbacks)
    try:
        log_long_pauses(logging.getLogger("t"), threshold_s=0.0)
        log_long_pauses(logging.getLogger("t"), threshold_s=0.0)  # a second agent in the process
        assert sum(getattr(cb, "logs_long_pauses", False) for cb in gc.callbacks) == 1
        with caplog.at_level(logging.WARNING, logger="t"):
            gc.collect()
        assert len([r for r in caplog.records if "garbage collection" in r.getMessage()]) == 1
    finally:
        gc.callbacks[:] = before


def test_the_scheduler_raises_the_young_threshold_and_keeps_it():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, *before[1:])
        GcPolicy(lambda: 0.0).step()  # a cell's policy: the collector's thresholds are left alone
        assert gc.get_threshold()[0] == 700
        policy = GcPolicy(lambda: 0.0, young_threshold=50_000)
        policy.step()
        assert gc.get_threshold() == (50_000, *before[1:])
        gc.set_threshold(700, *before[1:])  # something else reset it: the next step restores it
        policy.step()
        assert gc.get_threshold()[0] == 50_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
