"""A state no cell and no checkpoint holds is lost for good: the step raises `StateLost` at
once (the trainer stops with the reason) instead of retrying it as a failed step."""

from __future__ import annotations

import pytest

from cells.training.coordinator import StateLost, StepFailed
from cells.transport.store import StoreHost
from tests.training.cluster import coordinator, learner, trajectories


def _coordinator_whose_source_raises(monkeypatch, exc: Exception):
    host = StoreHost()
    lrn = learner()
    coord = coordinator(lrn, host.address, max_attempts=3)
    calls = []
    monkeypatch.setattr(coord, "_assign", lambda *a, **k: calls.append("assign"))
    monkeypatch.setattr(coord, "_acks", lambda *a, **k: {})

    def source(*a, **k):
        raise exc

    monkeypatch.setattr(coord, "_source", source)
    monkeypatch.setattr(coord, "_failed", lambda prefix, cells: list(cells[:1]))
    return host, coord, trajectories(lrn, groups=1), calls


def test_state_lost_is_not_retried(monkeypatch):
    host, coord, trajs, calls = _coordinator_whose_source_raises(monkeypatch, StateLost("nothing holds it"))
    with pytest.raises(StateLost, match="nothing holds it"):
        coord.update(trajs, ["a", "b", "c"], next_version=lambda: 2)
    assert calls == ["assign"]  # one attempt, no retry on fewer cells
    host.close()


def test_other_failures_are_retried(monkeypatch):
    """The negative control: any other error in an attempt is a failed step, retried without
    the cell it blames until none is left."""
    host, coord, trajs, calls = _coordinator_whose_source_raises(monkeypatch, RuntimeError("rank gone"))
    with pytest.raises(StepFailed):
        coord.update(trajs, ["a", "b", "c"], next_version=lambda: 2)
    assert calls == ["assign"] * 3
    host.close()
