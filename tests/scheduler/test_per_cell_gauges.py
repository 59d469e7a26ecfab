"""Per-cell gauges are written through cached children, and only when their value moves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from scheduler.control.reconcile import PerCellGauges


def test_cached_children_write_what_labels_would():
    reg = CollectorRegistry()
    g = Gauge("g", "a gauge", ["cell"], registry=reg)
    c = Counter("c", "a counter", ["cell", "state"], registry=reg)
    per = PerCellGauges()
    calls = []
    real = g.labels
    g.labels = lambda *a: (calls.append(a), real(*a))[1]  # count the lookups
    for value in (3, 3, 5):
        per.set(g, "cell-0", value)
    per.child(c, "cell-0", "rollout").inc(0.5)
    per.child(c, "cell-0", "rollout").inc(0.25)
    assert reg.get_sample_value("g", {"cell": "cell-0"}) == 5
    assert reg.get_sample_value("c_total", {"cell": "cell-0", "state": "rollout"}) == 0.75
    assert calls == [("cell-0",)]  # one lookup, then the cached child
