"""A cell moved into an RL job whose trainer publishes while the move is under way (the version
host catch-up, docs/JOBS.md "Each job's version lineage"): it loads the job's CURRENT version,
never the one current when the move began, and no session of the job is placed on it before it
serves that version; a scheduler restarted while a move loads finishes it, one whose cell went
down is undone. Fake cells whose loads the test completes by hand."""

from __future__ import annotations

from sched_fakes import FakeCell, Harness

SOURCE = {"host": "127.0.0.1", "port": 29999, "namespace": "versions"}


class SlowLoader(FakeCell):
    """A cell that has a version only when the test says so (`version = v`): a role's version
    is not taken on the spot, as a real cell fetching it from the version host."""

    def handle(self, cmd: dict) -> None:
        if cmd["type"] == "set_role":
            cmd = {**cmd, "version": None}
        super().handle(cmd)


def _setup(tmp_path) -> tuple[Harness, list[FakeCell], dict, dict]:
    h = Harness(str(tmp_path / "s.sqlite"))
    h.ctl.jobs.auto_move = False  # moves by hand
    cells = [SlowLoader(h.client, f"c{i}", max_running=4) for i in range(3)]
    for c in cells:
        c.register(), c.sync()
    assert h.client.post("/v1/jobs", json={"name": "beta", "model": "toy"}).status_code == 201
    h.client.put("/v1/trainer/version-host", json={"host": SOURCE["host"], "port": SOURCE["port"]})
    tb = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "trainer", "job": "beta"}).json()["token"]}
    ab = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "agent", "job": "beta"}).json()["token"]}
    return h, cells, tb, ab


def _publish(h, v: int, tb: dict) -> None:
    r = h.client.post("/v1/versions", json={"version": v, "source": SOURCE}, headers=tb)
    assert r.status_code == 201, r.text


def _loads(c: FakeCell) -> list[int]:
    return [cmd["version"] for cmd in c.commands if cmd["type"] == "load_version"]


def _rounds(h, cells, n: int = 5) -> None:
    for _ in range(n):
        for c in cells:
            c.sync()
        h.clock.advance(0.3)
        h.tick()


def _until(h, cells, move_id: str, state: str, rounds: int = 40) -> None:
    for _ in range(rounds):
        if h.ctl.store.jobs.get_move(move_id).state == state:
            return
        _rounds(h, cells, 1)
    raise AssertionError(h.ctl.store.jobs.get_move(move_id).to_api())


def test_a_moved_cell_catches_up_to_its_new_jobs_current_version_before_serving_it(tmp_path):
    h, cells, tb, ab = _setup(tmp_path)
    c0, c1, c2 = cells
    try:
        _publish(h, 1, tb)  # beta holds no cell yet: nobody to tell
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}).json()["id"]
        h.tick()
        _publish(h, 2, tb)  # published while c1 drains
        _until(h, cells, mid, "loading")
        assert h.ctl.store.jobs.job_of("cell", "c1") == "beta"
        _rounds(h, cells)
        assert 2 in _loads(c1) and 1 not in _loads(c1)  # beta's current version, not the one before
        _publish(h, 3, tb)  # and another while it loads
        fut = h.complete({"prompt_ids": [9, 9], "max_tokens": 2}, session="b1", headers=ab)
        c1.version = 2  # it got the version it was first told: beta's current is 3 now
        _rounds(h, cells, 8)
        assert _loads(c1)[-1] == 3 and h.ctl.store.jobs.get_move(mid).state == "loading"
        assert h.client.get("/v1/cells/c1").json()["state"] != "rollout"
        assert not c1.held and not c0.held and not c2.held  # beta's session went nowhere meanwhile
        if fut.done():  # refused for want of a beta cell (never placed on one without its version)
            assert fut.result().status_code in (429, 503), fut.result().text
        c1.version = 3
        _until(h, cells, mid, "done")
        view = h.client.get("/v1/cells/c1").json()
        assert (view["state"], view["version"], view["job"]) == ("rollout", 3, "beta")
        # control: the same job's session now lands on c1, at beta's version
        fut2 = h.complete({"prompt_ids": [9, 9], "max_tokens": 2}, session="b2", headers=ab)
        for _ in range(200):
            c1.sync()
            if c1.held or fut2.done():
                break
        assert c1.held, fut2.done() and fut2.result().text
        assert not c0.held and not c2.held
        assert _loads(c0) == [] and _loads(c2) == []  # default's cells were never told of beta's versions
    finally:
        h.close()


def test_a_restart_mid_move_finishes_a_loading_move_and_undoes_one_whose_cell_went(tmp_path):
    h, cells, tb, _ = _setup(tmp_path)
    c0, c1, c2 = cells
    _publish(h, 1, tb)
    loading = h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}).json()["id"]
    _until(h, cells, loading, "loading")
    draining = h.client.post("/v1/jobs/beta/cells", json={"cell": "c2"}).json()["id"]
    h.tick()
    assert h.ctl.store.jobs.get_move(draining).state == "draining"
    h.close()
    h = Harness(h.db_path)  # restarted: both moves are read from the store
    for c in cells:
        c.client = h.client
    try:
        for _ in range(40):  # c2 is gone: its lease runs out, no sync of it again
            for c in (c0, c1):
                c.sync()
            h.clock.advance(0.5)
            h.tick()
            if h.ctl.store.jobs.get_move(draining).state == "undone":
                break
        assert h.ctl.store.jobs.get_move(draining).state == "undone"
        assert h.ctl.store.jobs.job_of("cell", "c2") == "default"  # never reassigned
        assert h.ctl.store.jobs.get_move(loading).state == "loading"  # c1 has not loaded beta's version yet
        for _ in range(20):  # the restarted scheduler tells it beta's version again
            if 1 in _loads(c1):
                break
            _rounds(h, [c0, c1], 1)
        assert _loads(c1) == [1] and h.ctl.store.jobs.get_move(loading).state == "loading"
        c1.version = 1
        _until(h, [c0, c1], loading, "done")
        view = h.client.get("/v1/cells/c1").json()
        assert (view["state"], view["version"], view["job"]) == ("rollout", 1, "beta")
    finally:
        h.close()
