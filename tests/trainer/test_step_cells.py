"""The trainer's report to the scheduler (cells/trainer/step_cells.py): the staleness bound's
admission rule engages through it, and with the planner flipping the trainer flips nothing
itself (the race that made its flips refused) and trains on the planner's cells."""

from __future__ import annotations

import threading
import time

import pytest

from cells.trainer.client import TrainerClient
from cells.trainer.step_cells import StepCells, StepFigures
from tests.scheduler.sched_fakes import FakeCell, Harness, pump


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(**sched) -> Harness:
        h = Harness(str(tmp_path / f"s{len(made)}.sqlite"), **sched)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


def _client(h: Harness) -> TrainerClient:
    client = TrainerClient("http://testserver", token="")
    client.http.close()
    client.http = h.client  # the app in-process; the TestClient sends the API token
    return client


def _cells(h: Harness, n: int) -> list[FakeCell]:
    cells = [FakeCell(h.client, f"c{i}") for i in range(n)]
    for c in cells:
        c.register()
        c.sync()
    return cells


def _session(h: Harness, cells: list[FakeCell], sid: str, finish: bool = True) -> int:
    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 2}, session=sid)
    pump(cells, until=fut)
    r = fut.result(timeout=60)
    if r.status_code == 200 and finish:
        h.client.post(f"/v1/sessions/{sid}/finish", json={"reward": 1.0, "group_id": "g"})
    return r.status_code


def test_admission_pauses_when_untrained_work_reaches_the_bound_through_the_trainers_report(make):
    # bound 1, batch 2: at most (1 + 1) x 2 = 4 sessions in flight or finished and not fetched
    h = make(staleness_bound=1)
    cells = _cells(h, 1)
    client, events = _client(h), []
    step = StepCells(client, batch_size=2, train_cells=1, choice="planner", emit=events.append)
    for sid in ("a", "b", "c", "d", "e"):
        assert _session(h, cells, sid) == 200  # no report yet: the rule has no unit, all pass
    client.trajectories(limit=64)  # fetched: the trainer holds them
    step.declare(0)  # Trainer.run declares the batch size before the agents start
    assert client.versions()["staleness"]["admission_limit"] == 4
    for sid in ("f", "g", "h", "i"):
        assert _session(h, cells, sid) == 200  # finished, not fetched: 1, 2, 3, 4
    assert _session(h, cells, "j") == 429  # a fifth would be trained more than 1 version late
    st = client.versions()["staleness"]
    assert st["admission_paused"] == 1 and st["bound"] == 1
    r = h.client.post("/v1/generate", json={"prompt_ids": [1], "max_tokens": 1}, headers={"X-Session-Id": "k"})
    assert r.status_code == 429 and r.json()["reason"] == "staleness_bound"
    # a step ends: the trainer reports it and fetches the next batch; admission opens again
    step.declare(0, StepFigures(step_s=3.0, sessions=4, tokens=40, cells=1))
    assert h.ctl.snapshot().tokens_per_step == 40 and h.ctl.snapshot().train_step_s == 3.0
    client.trajectories(limit=64)
    assert _session(h, cells, "l") == 200


def test_fetched_but_untrained_sessions_count_toward_the_bound(make):
    # bound 0, batch 2: limit 2. Fetching does not train: the trainer's buffer still counts.
    h = make(staleness_bound=0)
    cells = _cells(h, 1)
    client = _client(h)
    step = StepCells(client, batch_size=2, train_cells=1, choice="planner", emit=lambda e: None)
    step.declare(0)
    assert _session(h, cells, "a") == 200 and _session(h, cells, "b") == 200
    assert _session(h, cells, "c") == 429  # two finished, not fetched
    assert len(client.trajectories(limit=64)) == 2
    step.declare(1, untrained=2)  # fetched into the step's batch, not trained yet
    assert _session(h, cells, "d") == 429
    assert h.ctl.staleness.untrained_work() == 2
    step.declare(0, StepFigures(step_s=1.0, sessions=2, tokens=4, cells=1), untrained=0)  # trained
    assert h.ctl.staleness.untrained_work() == 0
    assert _session(h, cells, "e") == 200


def _pump_while(h: Harness, cells: list[FakeCell], thread: threading.Thread, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while thread.is_alive() and time.monotonic() < deadline:
        h.tick()
        for c in cells:
            c.sync()
        time.sleep(0.01)
    assert not thread.is_alive(), "the step never got its cells"


def test_with_the_planner_flipping_the_trainer_flips_nothing_and_trains_on_its_cells(make):
    h = make()
    assert h.ctl.cfg.auto_flip
    cells = _cells(h, 3)
    client, events = _client(h), []
    step = StepCells(client, batch_size=8, train_cells=2, choice="busiest", emit=events.append)
    step.declare(0)
    assert step.planner_flips
    h.tick(3)
    assert client.flips() == []  # no step running, no batch waiting: the planner flips nothing
    out: list = []
    t = threading.Thread(target=lambda: out.append(step.acquire()))
    t.start()
    _pump_while(h, cells, t)
    assert out == [[]] and step.own == [] and events == []  # no explicit flip, none refused
    group = step.group()
    assert len(group) == 2 and all(client.cells()[int(c[1:])]["state"] == "training" for c in group)
    assert {f["to"] for f in step.finished_flips()} == {"training"}
    # the step ends: the trainer flips nothing back, the planner returns the idle cells
    assert step.release(group) == []
    step.declare(0, StepFigures(step_s=5.0, sessions=8, tokens=100, cells=2))
    for _ in range(200):
        h.tick()
        for c in cells:
            c.sync()
        if all(c["state"] == "rollout" for c in client.cells()):
            break
    assert all(c["state"] == "rollout" for c in client.cells())
    assert {f["to"] for f in step.finished_flips()} == {"rollout"}


def test_without_the_planner_the_trainer_flips_its_cells_and_back(make):
    h = make(auto_flip=False)
    cells = _cells(h, 3)
    client, events = _client(h), []
    step = StepCells(client, batch_size=8, train_cells=2, choice="busiest", emit=events.append)
    out: list = []
    t = threading.Thread(target=lambda: out.append(step.acquire()))
    t.start()
    _pump_while(h, cells, t)
    assert not step.planner_flips and len(out[0]) == 2 and sorted(step.group()) == sorted(step.own)
    t = threading.Thread(target=lambda: out.append(step.release(step.group())))
    t.start()
    _pump_while(h, cells, t)
    assert [f["state"] for f in out[1]] == ["done", "done"]
    assert all(c["state"] == "rollout" for c in client.cells())


def test_at_the_end_of_the_run_every_training_cell_is_handed_back(make):
    h = make()
    cells = _cells(h, 3)
    client = _client(h)
    step = StepCells(client, batch_size=8, train_cells=2, choice="planner", emit=lambda rec: None)
    out: list = []
    t = threading.Thread(target=lambda: out.append(step.acquire()))
    t.start()
    _pump_while(h, cells, t)
    assert step.planner_flips and len(step.group()) == 2
    # the planner stops flipping, as if its next decision were late: hand_back alone must bring
    # its cells back (with it running, it may flip one back first and the count would race)
    h.ctl.ctx.cfg = h.ctl.ctx.cfg.model_copy(update={"auto_flip": False})
    t = threading.Thread(target=lambda: out.append(step.hand_back()))
    t.start()
    _pump_while(h, cells, t)
    assert [f["state"] for f in out[1]] == ["done", "done"]  # the planner's cells, flipped back explicitly
    assert all(c["state"] == "rollout" for c in client.cells())


def test_when_the_planner_gives_no_cell_one_explicit_flip_overrides_it(make):
    h = make()
    cells = _cells(h, 3)
    client, events = _client(h), []
    step = StepCells(client, batch_size=8, train_cells=2, choice="planner", emit=events.append)
    # training measured fast, nothing finished yet: the balance wants no training cell
    step.declare(0, StepFigures(step_s=1.0, sessions=8, tokens=100, cells=1))
    out: list = []
    t = threading.Thread(target=lambda: out.append(step.acquire()))
    t.start()
    _pump_while(h, cells, t)
    assert step.planner_flips and [f["state"] for f in out[0]] == ["done"]
    assert step.group() == step.own and len(step.own) == 1
    t = threading.Thread(target=lambda: out.append(step.release(step.group())))
    t.start()
    _pump_while(h, cells, t)
    assert [f["to"] for f in out[1]] == ["rollout"] and all(c["state"] == "rollout" for c in client.cells())


class _Racing:
    """A trainer client whose override flip is refused because the planner's own flip of the
    job's other cell began just before it (what a job's rollout floor then refuses)."""

    def __init__(self) -> None:
        self.training: list[str] = []
        self.planner_began = False

    def report_training(self, **kw) -> dict:
        return {"auto_flip": True}

    def flips(self, active: bool = False) -> list[dict]:
        if self.planner_began:  # the planner's flip, seen under way once, then done
            self.planner_began, self.training = False, ["c0"]
            return [{"to": "training"}]
        return []

    def cells(self) -> list[dict]:
        return [{"id": c, "state": "training" if c in self.training else "rollout", "inflight": n}
                for c, n in (("c0", 0), ("c1", 2))]

    def job(self) -> str:
        return "a"

    def flip(self, to: str, **kw) -> list[dict]:
        self.planner_began = True
        raise RuntimeError("409 min_rollout_cells: flipping c1 would leave job 'a' fewer than 1 rollout cells")


def test_an_override_refused_because_the_planner_flipped_meanwhile_waits_for_the_planners_cell(monkeypatch):
    from cells.trainer import step_cells

    monkeypatch.setattr(step_cells, "SETTLE_S", 0.05)
    events: list = []
    step = StepCells(_Racing(), batch_size=8, train_cells=1, choice="busiest", emit=events.append, poll_s=0.01)
    assert step.acquire() == []
    assert step.group() == ["c0"]  # the planner's cell: the step trains, it does not fail for want of one
    assert [e["event"] for e in events] == ["flip_refused"]
