"""`cellflip jobs`: lists each job with its cells, versions and demand; creates, deletes and
moves through the scheduler's API (here a TestClient in place of the network)."""

from __future__ import annotations

import httpx
import pytest

from cells.cli import main
from tests.scheduler.sched_fakes import FakeCell, Harness


@pytest.fixture
def harness(tmp_path, monkeypatch):
    h = Harness(str(tmp_path / "sched.sqlite"))
    h.ctl.jobs.auto_move = False

    def request(method, url, json=None, headers=None, timeout=None):
        return h.client.request(method, url.removeprefix("http://sched"), json=json, headers=headers)

    monkeypatch.setattr(httpx, "request", request)
    yield h
    h.close()


def test_jobs_list_create_move_delete(harness, capsys):
    h = harness
    for i in range(2):
        c = FakeCell(h.client, f"c{i}")
        c.register(), c.sync()
    admin = h.auth("admin")["Authorization"].split()[1]
    tok = h.db_path + ".admin"
    with open(tok, "w") as f:
        f.write(admin)
    base = ["--scheduler", "http://sched", "--token-file", tok]
    assert main(["jobs", *base, "create", "math", "--model", "toy", "--min-cells", "1", "--weight", "2",
                 "--settings", '{"max_sessions": 4}']) == 0
    assert main(["jobs", *base, "move", "c1", "math"]) == 0
    h.tick()
    assert main(["jobs", *base]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = lines[-4] if lines[-1].startswith("move") else lines[-3]
    assert header.split()[:4] == ["name", "state", "model", "min"]
    rows = {ln.split()[0]: ln.split() for ln in lines if ln.split() and ln.split()[0] in ("default", "math")}
    assert rows["math"][1:6] == ["active", "toy", "1", "-", "2"]
    assert rows["default"][6] == "c0,c1"  # c1 is still draining out of default
    assert "c1 default -> math" in out
    assert main(["jobs", *base, "set", "math", "--settings", '{"min_rollout_cells": 1, "staleness_policy": "correct"}']) == 0
    assert h.client.get("/v1/jobs/math").json()["settings"] == {"max_sessions": 4, "min_rollout_cells": 1,
                                                                 "staleness_policy": "correct"}
    for bad, why in (('{"staleness_policy": "keep"}', "422"), ("[1]", "JSON object"), ("{nope", "not JSON")):
        with pytest.raises(SystemExit, match=why):
            main(["jobs", *base, "set", "math", "--settings", bad])
    assert h.client.get("/v1/jobs/math").json()["settings"]["staleness_policy"] == "correct"  # unchanged
    assert main(["jobs", *base, "delete", "math"]) == 0
    with pytest.raises(SystemExit, match="404"):
        main(["jobs", *base, "delete", "nope"])
