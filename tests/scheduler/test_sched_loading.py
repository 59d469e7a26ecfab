"""A freshly registered cell serves only the current version (or one within the staleness
bound): until its fetch completes it is `loading` and gets no request."""

from __future__ import annotations

import pytest
from sched_fakes import FakeCell, Harness, publish, pump


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(**sched) -> Harness:
        h = Harness(str(tmp_path / f"l{len(made)}.sqlite"), **sched)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()



def _state(h: Harness, cell: str) -> str:
    return h.client.get(f"/v1/cells/{cell}").json()["state"]


def _loads(c: FakeCell) -> list[dict]:
    return [cmd for cmd in c.commands if cmd["type"] == "load_version"]


def test_fresh_cell_loads_the_current_version_before_serving(make):
    h = make()
    a = FakeCell(h.client, "a")
    a.register()
    a.sync()
    publish(h, 5)
    a.sync()
    a.version = 5  # a joined the broadcast
    a.sync()
    h.tick()
    b = FakeCell(h.client, "b", version=0)  # random initial weights, never published
    b.register()
    b.sync()
    assert _state(h, "b") == "loading"
    cell = h.client.get("/v1/cells/b").json()
    assert "fetching the current one" in cell["history"][-1][2]
    h.tick()  # catch_up tells it to fetch version 5
    b.sync()
    assert [(x["version"], x["mode"]) for x in _loads(b)] == [(5, "fetch")]
    # nothing is placed on a loading cell
    fut = h.complete({"prompt_ids": [1, 2], "max_tokens": 2}, session="s")
    pump([a, b], until=fut)
    assert fut.result(timeout=60).status_code == 200
    assert not any(cmd["type"] == "start" for cmd in b.commands)
    b.version = 5  # the fetch completed
    b.sync()
    assert _state(h, "b") == "rollout"


def test_a_version_within_the_staleness_bound_is_served_at_once(make):
    h = make(staleness_bound=1)
    publish(h, 1)
    publish(h, 2)
    ok = FakeCell(h.client, "ok", version=1)  # one published version behind: within the bound
    ok.register()
    ok.sync()
    assert _state(h, "ok") == "rollout"
    publish(h, 3)
    old = FakeCell(h.client, "old", version=1)  # two behind now
    old.register()
    old.sync()
    assert _state(h, "old") == "loading"


def test_without_a_published_version_a_fresh_cell_serves_at_once(make):
    h = make()
    c = FakeCell(h.client, "c", version=0)
    c.register()
    c.sync()
    assert _state(h, "c") == "rollout"
