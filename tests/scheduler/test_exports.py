"""Weight exports through the API: the scheduler asks a verified live cell holding the version
(never the trainer), refuses what it cannot do before sending anything, and reports the
cell's answer; the cell writes below its export root and refuses a path that leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cells.agent.commands import Commands
from cells.engine.embedded import EmbeddedEngine
from scheduler.contract.config import parse_config
from scheduler.contract.protocol import ExportCmd
from tests.scheduler.sched_fakes import FakeCell, Harness
from tests.scheduler.storecheck import store_dump


@pytest.fixture
def h(tmp_path):
    harness = Harness(str(tmp_path / "sched.sqlite"), min_rollout_cells=1)
    yield harness
    harness.close()


def _fleet(h, n: int) -> list[FakeCell]:
    cells = [FakeCell(h.client, f"cell-{i}", headers=h.auth("cell")) for i in range(n)]
    for c in cells:
        c.register(), c.sync()
    return cells


def test_an_export_goes_to_a_cell_holding_the_version_and_reports_its_answer(h):
    a, b = _fleet(h, 2)
    b.versions_held = [0, 1]
    b.sync()
    trainer = h.auth("trainer")
    assert h.client.post("/v1/versions", json={"version": 1}, headers=trainer).status_code == 201
    r = h.client.post("/v1/versions/1/exports", json={"path": "qwen/v1", "dtype": "bfloat16"}, headers=trainer)
    assert r.status_code == 202, r.text
    ex = r.json()
    assert ex["cell"] == "cell-1" and ex["state"] == "pending"  # the one that holds version 1
    a.sync(), b.sync()
    cmds = [c for c in b.commands if c["type"] == "export"]
    assert [(c["export_id"], c["version"], c["path"], c["dtype"]) for c in cmds] == [(ex["id"], 1, "qwen/v1", "bfloat16")]
    assert not [c for c in a.commands if c["type"] == "export"]
    b.events.append({"type": "exported", "export_id": ex["id"], "version": 1, "ok": True,
                     "path": "/x/runs/exports/qwen/v1", "bytes": 123, "seconds": 0.5})
    b.sync()
    got = h.client.get(f"/v1/exports/{ex['id']}", headers=trainer).json()
    assert (got["state"], got["written_to"], got["bytes"]) == ("done", "/x/runs/exports/qwen/v1", 123)
    # another cell's answer for it changes nothing
    a.events.append({"type": "exported", "export_id": ex["id"], "version": 1, "ok": False, "reason": "x"})
    a.sync()
    assert h.client.get(f"/v1/exports/{ex['id']}", headers=trainer).json()["state"] == "done"


@pytest.mark.parametrize("version,body,status,reason", [
    (7, {"path": "v7"}, 404, None),  # no such version
    (1, {"path": "v1"}, 409, "version_not_held"),  # published, held by no cell
    (0, {"path": "../etc"}, 422, None),
    (0, {"path": "/abs/v0"}, 422, None),
    (0, {"path": "a/./b"}, 422, "bad_export_path"),
    (0, {"path": "v0", "dtype": "float16"}, 422, None),
])
def test_what_no_cell_could_do_is_refused_before_anything_is_sent(h, version, body, status, reason):
    (a,) = _fleet(h, 1)
    trainer = h.auth("trainer")
    assert h.client.post("/v1/versions", json={"version": 1}, headers=trainer).status_code == 201
    a.sync()
    before = store_dump(h.db_path)
    r = h.client.post(f"/v1/versions/{version}/exports", json=body, headers=trainer)
    assert r.status_code == status, r.text
    if reason:
        assert r.json()["reason"] == reason
    a.sync()
    assert not [c for c in a.commands if c["type"] == "export"]
    assert store_dump(h.db_path) == before
    assert h.client.get("/v1/exports/exp-nope", headers=trainer).status_code == 404


def test_an_export_whose_cell_goes_down_fails_with_the_reason(h):
    (a,) = _fleet(h, 1)
    trainer = h.auth("trainer")
    ex = h.client.post("/v1/versions/0/exports", json={"path": "v0"}, headers=trainer).json()
    h.client.portal.call(lambda: h.ctl.membership.fence("cell-0", "test"))
    got = h.client.get(f"/v1/exports/{ex['id']}", headers=trainer).json()
    assert got["state"] == "failed" and "went down" in got["reason"]


def _agent(tmp_path, engine):
    cfg = parse_config({"cells": {"export_root": str(tmp_path / "exports"),
                                  "engine": {"type": "embedded", "model": {"preset": "toy"}}}})
    events: list[dict] = []
    moves = SimpleNamespace(migrate_out=None, migrate_in=None, cancel=None)
    return SimpleNamespace(engine=engine, cfg=cfg, moves=moves, events_append=lambda e: events.append(e.to_dict())), events


def _wait(events: list[dict], n: int) -> None:
    import time
    for _ in range(3000):
        if len(events) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"no export answer: {events}")


def test_a_cell_writes_a_held_version_below_its_root_and_refuses_a_path_that_leaves_it(tmp_path):
    engine = EmbeddedEngine(parse_config({"cells": {"engine": {"type": "embedded",
                                                              "model": {"preset": "toy"}}}}).cells.engine)
    agent, events = _agent(tmp_path, engine)
    cmds = Commands(agent)
    cmds.export(ExportCmd(1, "exp-a", 0, "toy/v0"))
    _wait(events, 1)
    assert events[0]["ok"] and events[0]["path"] == str((tmp_path / "exports" / "toy" / "v0").resolve())
    served = engine.score([1, 2, 3, 4, 5])
    back = EmbeddedEngine(parse_config({"cells": {"engine": {"type": "embedded", "model": {
        "preset": None, "path": events[0]["path"]}}}}).cells.engine).score([1, 2, 3, 4, 5])
    assert torch.equal(served, back)
    (tmp_path / "exports" / "link").symlink_to(tmp_path)  # a symlink out of the root
    cmds.export(ExportCmd(2, "exp-b", 0, "link/v0"))
    cmds.export(ExportCmd(3, "exp-c", 5, "toy/v5"))  # not held
    cmds.export(ExportCmd(4, "exp-d", 0, "toy/v0"))  # exists: never overwritten
    _wait(events, 4)
    why = {e["export_id"]: e["reason"] for e in events if not e["ok"]}
    assert "leaves the export root" in why["exp-b"] and "not held" in why["exp-c"] and "never overwrites" in why["exp-d"]
    assert not (tmp_path / "v0").exists()
