"""`cellflip up --rl-jobs`'s API steps in-process (cells/rl_jobs_up.py): jobs created with the
admin token, each job's agent and trainer tokens bound to it, and a job's trainer client seeing
its own job's cells only; a job that exists already is a clear error."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from cells.rl_jobs import JobsFileError, parse_jobs
from cells.rl_jobs_up import create_jobs, mint_tokens
from cells.trainer.client import TrainerClient
from tests.scheduler.sched_fakes import FakeCell, Harness

JOBS = parse_jobs({"jobs": [{"name": "job-a", "seed": 0, "min_cells": 1},
                            {"name": "job-b", "seed": 1, "task": {"p_pair": 0.6}, "min_cells": 1}]})


def _trainer_client(h: Harness, token: str) -> TrainerClient:
    c = TrainerClient("http://testserver", token)
    c.http.close()
    c.http = TestClient(h.app, headers={"Authorization": f"Bearer {token}"})
    return c


def test_jobs_created_tokens_bound_and_each_trainer_sees_its_own_cells(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    try:
        cells = [FakeCell(h.client, f"c{i}") for i in range(2)]
        for c in cells:
            c.register()
        create_jobs(h.client, JOBS, "/warm")
        view = {j["name"]: j for j in h.client.get("/v1/jobs").json()["jobs"]}
        assert view["job-b"]["settings"] == {"seed": 1, "task": {"p_pair": 0.6}} and view["job-a"]["min_cells"] == 1
        with pytest.raises(JobsFileError, match="exists in this store already"):
            create_jobs(h.client, JOBS, "/warm")
        tokens = {j.name: mint_tokens(h.client, j.name) for j in JOBS.jobs}
        assert tokens["job-a"]["trainer"] != tokens["job-b"]["trainer"]
        listed = {t["name"]: t["job"] for t in h.client.get("/v1/tokens").json()["tokens"]}
        assert listed["job-a-agent"] == listed["job-a-trainer"] == "job-a" and listed["job-b-agent"] == "job-b"
        h.ctl.store.jobs.assign("cell", "c1", "job-b")  # as a move's reassignment records it
        a, b = (_trainer_client(h, tokens[n]["trainer"]) for n in ("job-a", "job-b"))
        assert (a.job(), b.job()) == ("job-a", "job-b")
        assert [c["id"] for c in b.cells()] == ["c1"] and a.cells() == []  # c0 is still default's
        admin = _trainer_client(h, h.client.headers["Authorization"].split()[1])
        assert admin.job() is None and {c["id"] for c in admin.cells()} == {"c0", "c1"}  # bound to none: all
    finally:
        h.close()


def test_the_local_fleet_runs_on_the_schedulers_own_planning(tmp_path):
    """`cellflip up --rl-jobs` leaves the flips to the scheduler (`auto_flip` on): a job's trainer
    learns it from its report's answer and waits for its job's planner instead of flipping."""
    from cells.rl_jobs_up import serve_from
    from cells.trainer.step_cells import StepCells

    raw = {"cells": {"engine": {"model": {"preset": "toy", "output_id_ranges": [[1, 2]]}}},
           "scheduler": {"auto_flip": False}}
    serve_from(raw, tmp_path)
    assert raw["scheduler"]["auto_flip"] is True
    assert raw["cells"]["engine"]["model"] == {"path": str(tmp_path.resolve()), "output_id_ranges": [[1, 2]]}
    for auto in (True, False):  # control: a fleet without the planner's flips has the trainer flip
        h = Harness(str(tmp_path / f"s{auto}.sqlite"), auto_flip=auto)
        try:
            create_jobs(h.client, JOBS, "/warm")
            client = _trainer_client(h, mint_tokens(h.client, "job-a")["trainer"])
            steps = StepCells(client, batch_size=8, train_cells=1, choice="busiest", emit=lambda e: None)
            steps.declare(1)
            assert steps.planner_flips is auto
            assert h.ctl.rates.trainer("job-a").demand.batch_size == 8  # the job's own demand
        finally:
            h.close()


class _Fleet:
    """What `assign_cells` takes of `cells.localcluster.Cluster`, over a Harness and fake cells."""

    def __init__(self, h: Harness, cells: list[FakeCell]) -> None:
        self.h, self.fakes, self.http = h, cells, h.client

    def cells(self) -> list[dict]:
        return self.http.get("/v1/cells").json()["cells"]

    def wait(self, probe, timeout_s: float, what: str, every: float = 0.5):
        for _ in range(200):
            for c in self.fakes:
                c.sync()
            self.h.clock.advance(0.3)
            self.h.tick()
            got = probe()
            if got is not None:
                return got
        raise AssertionError(f"never: {what}")


def test_cells_are_assigned_though_the_division_moves_one_meanwhile(tmp_path):
    from cells.rl_jobs_up import assign_cells

    h = Harness(str(tmp_path / "s.sqlite"))
    try:
        cells = [FakeCell(h.client, f"c{i}") for i in range(4)]
        for c in cells:
            c.register(), c.sync()
        jobs = parse_jobs({"jobs": [{"name": "job-a", "seed": 0, "min_cells": 2},
                                    {"name": "job-b", "seed": 1, "min_cells": 2}]})
        create_jobs(h.client, jobs, "/warm")
        h.ctl.jobs.moves.start("c0", "job-b", "the planner's division of the fleet")  # began first
        held = assign_cells(_Fleet(h, cells), jobs)
        assert sorted(held["job-a"]) == ["c1", "c2"] and sorted(held["job-b"]) == ["c0", "c3"]
        moves = [m.to_api() for m in h.ctl.store.jobs.list_moves()]
        assert len(moves) == 4 and all(m["state"] == "done" for m in moves)  # no cell asked for twice
    finally:
        h.close()
