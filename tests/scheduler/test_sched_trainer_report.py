"""POST /v1/trainer/report: the trainer's demand turns the planner's flips on; an explicit
flip overrides them; the report's step figures become the planner's training speed."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, open_harness


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _fleet(harness, n: int = 3) -> list[FakeCell]:
    cells = [FakeCell(harness.client, f"c{i}") for i in range(n)]
    for c in cells:
        c.register()
        c.sync()
    return cells


def test_report_sets_the_training_side_of_the_snapshot(harness):
    _fleet(harness)
    r = harness.client.post("/v1/trainer/report", json={
        "batch_size": 8, "steps_in_progress": 0, "max_cells_per_step": 2,
        "step_s": 30.0, "sessions": 8, "tokens": 4096, "cells": 2})
    assert r.status_code == 200, r.text
    assert r.json()["train_rate_per_cell_s"] == pytest.approx(8 / 60.0)
    s = harness.ctl.snapshot()
    assert (s.batch_size, s.max_cells_per_step, s.train_step_s, s.tokens_per_step) == (8, 2, 30.0, 4096)
    assert s.train_rate_per_cell_s == pytest.approx(8 / 60.0) and s.staleness_bound == harness.ctl.cfg.staleness_bound
    assert all(c.inflight_tokens == 0 and not c.busy for c in s.cells)
    # a finished step must come whole
    bad = harness.client.post("/v1/trainer/report", json={
        "batch_size": 8, "steps_in_progress": 0, "max_cells_per_step": 2, "step_s": 30.0})
    assert bad.status_code == 422


def test_planner_flips_only_after_the_trainer_reports_and_explicit_flips_stay(harness):
    cells = _fleet(harness)
    ctl = harness.ctl
    assert ctl.cfg.auto_flip
    harness.tick()
    assert harness.client.get("/v1/flips").json()["flips"] == []  # no demand declared: no flips
    # an explicit flip to training: the planner leaves that cell there (busy) until flipped back
    r = harness.client.post("/v1/flips", json={"cell": "c0", "to": "training"})
    assert r.status_code == 202
    for _ in range(4):
        harness.tick()
        for c in cells:
            c.sync()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"
    harness.client.post("/v1/trainer/report", json={"batch_size": 8, "steps_in_progress": 0,
                                                    "max_cells_per_step": 1})
    s = ctl.snapshot()
    assert next(c for c in s.cells if c.cell_id == "c0").busy
    for _ in range(4):
        harness.tick()
        for c in cells:
            c.sync()
    assert harness.client.get("/v1/cells/c0").json()["state"] == "training"
    r = harness.client.post("/v1/flips", json={"cell": "c0", "to": "rollout"})
    assert r.status_code == 202 and "c0" not in ctl.flips.pinned_training
