"""A cell moves between RL jobs (scheduler/control/jobmoves.py): its live rollouts migrate to
its old job's other cells only, it is reassigned, loads, serves the new job; a scheduler
restarted mid-move finishes it. Fake cells (the data plane played by the test)."""

from __future__ import annotations

from sched_fakes import FakeCell, Harness, hand_over, pump

from scheduler.planner import placement


def _fleet(h, n: int = 3) -> list[FakeCell]:
    cells = [FakeCell(h.client, f"c{i}", max_running=4) for i in range(n)]
    for c in cells:
        c.register(), c.sync()
    return cells


def _settle(h, cells, move_id: str, rounds: int = 60) -> dict:
    """Sync, hand over migrations and tick until the move ends."""
    for _ in range(rounds):
        for c in cells:
            c.sync()
            for mid in list(c.migrations_out):
                dst = next((d for d in cells if d is not c and any(x.get("migration_id") == mid for x in d.commands)),
                           None)
                if dst is not None:  # else its migrate_in reaches the destination at its next sync
                    hand_over(c, dst, mid)
        h.clock.advance(0.3)
        h.tick()
        m = next(m for m in h.ctl.store.jobs.list_moves() if m.id == move_id)
        if m.state in ("done", "undone"):
            return m.to_api()
    raise AssertionError(f"move {move_id} did not end: {m.to_api()}")


def _setup(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    h.ctl.jobs.auto_move = False  # these tests move cells by hand
    cells = _fleet(h)
    assert h.client.post("/v1/jobs", json={"name": "beta", "model": "toy"}).status_code == 201
    return h, cells


def test_a_move_migrates_live_rollouts_within_their_job_only(tmp_path):
    h, (c0, c1, c2) = _setup(tmp_path)
    try:
        r = h.client.post("/v1/jobs/beta/cells", json={"cell": "c2"})
        assert r.status_code == 202, r.text
        assert _settle(h, [c0, c1, c2], r.json()["id"])["state"] == "done"
        assert h.ctl.store.jobs.job_of("cell", "c2") == "beta"
        assert h.client.get("/v1/cells/c2").json()["state"] == "rollout"
        assert {c["id"]: c["job"] for c in h.client.get("/v1/cells").json()["cells"]} == {
            "c0": "default", "c1": "default", "c2": "beta"}
        # default sessions go to default cells only; c2 is beta's
        futs = [h.complete({"prompt_ids": [i, i + 1], "max_tokens": 12}, session=f"s{i}") for i in range(3)]
        for _ in range(500):
            for c in (c0, c1, c2):
                c.sync()
            if sum(len(c.held) for c in (c0, c1, c2)) == 3 or any(f.done() for f in futs):
                break
        assert not any(f.done() for f in futs), [f.result().text for f in futs if f.done()]
        assert sum(len(c.held) for c in (c0, c1)) == 3 and not c2.held
        for c in (c0, c1):
            c.step(2), c.sync()
        # a beta session goes to beta's cell, by either route (new sessions: placed by their job)
        tb = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "agent", "job": "beta"}).json()["token"]}
        done = []
        for session in ("b1", None):  # one at a time: the harness's client pool holds 4 requests
            fut = h.complete({"prompt_ids": [9, 9], "max_tokens": 2}, session=session, headers=tb)
            for _ in range(500):
                c2.sync()
                if c2.held or fut.done():
                    break
            assert c2.held, (fut.done() and fut.result().text)
            pump([c2], until=fut)
            done.append(fut.result(timeout=60).json()["session_id"])
        assert {h.ctl.store.jobs.job_of("session", sid) for sid in done} == {"beta"}
        chat = h.pool.submit(h.client.post, "/v1/chat/completions", headers={**tb, "X-Session-Id": "cb"}, json={
            "model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        for _ in range(500):
            c2.sync()
            if c2.held or chat.done():
                break
        assert c2.held, chat.done() and chat.result().text
        pump([c2], until=chat)
        assert chat.result(timeout=60).status_code == 200 and h.ctl.store.jobs.job_of("session", "cb") == "beta"
        # negative control: the planner unrestricted would send c0's rollouts to idle c2
        snap = h.ctl.snapshot()
        reqs = [h.ctl.ownership.summarize(h.ctl.store.owners.get_request(rid)) for rid in c0.held]
        assert reqs, "c0 holds none of the rollouts"
        free = placement.choose_destinations(snap, "c0", reqs)
        assert "c2" in {d.cell_id for d in free if d is not None}
        kept = {rid: len(c0.held[rid].tokens) for rid in c0.held}
        r = h.client.post("/v1/jobs/beta/cells", json={"cell": "c0"})
        assert r.status_code == 202, r.text
        move = _settle(h, [c0, c1, c2], r.json()["id"])
        assert move["state"] == "done" and move["from"] == "default" and move["to"] == "beta"
        assert set(kept) <= set(c1.held)  # every live rollout of c0 went on on c1, its job's cell
        assert not c2.held and not c0.held
        assert all(len(c1.held[rid].tokens) >= n for rid, n in kept.items())
        pump([c0, c1, c2], until=futs, harness=h)
        for fut in futs:
            assert len(fut.result(timeout=60).json()["token_ids"]) == 12
        assert h.ctl.store.jobs.job_of("cell", "c0") == "beta"
        jobs = {j["name"]: j for j in h.client.get("/v1/jobs").json()["jobs"]}
        assert jobs["beta"]["cells"] == ["c0", "c2"] and jobs["default"]["cells"] == ["c1"]
        assert 'cellflip_job_moves_total{from_job="default",to_job="beta"} 2.0' in h.client.get("/metrics").text
    finally:
        h.close()


def test_move_guards(tmp_path):
    h, (c0, c1, c2) = _setup(tmp_path)
    try:
        assert h.client.post("/v1/jobs/beta/cells", json={"cell": "nope"}).status_code == 404
        assert h.client.post("/v1/jobs/default/cells", json={"cell": "c0"}).status_code == 422
        assert h.client.post("/v1/jobs/nojob/cells", json={"cell": "c0"}).status_code == 404
        assert h.client.post("/v1/jobs/beta/cells", json={"cell": "c0"}).status_code == 202
        again = h.client.post("/v1/jobs/beta/cells", json={"cell": "c0"})
        assert again.status_code == 409 and again.json()["reason"] == "move_in_progress"
        trainer = h.auth("trainer")
        assert h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}, headers=trainer).status_code == 403
    finally:
        h.close()


def test_restart_mid_move_finishes_it(tmp_path):
    h, cells = _setup(tmp_path)
    r = h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"})
    mid = r.json()["id"]
    h.tick()
    for c in cells:
        c.sync()
    assert h.ctl.store.jobs.get_move(mid).state == "draining"
    h.close()
    h = Harness(h.db_path)
    for c in cells:
        c.client = h.client
    try:
        assert _settle(h, cells, mid)["state"] == "done"
        assert h.ctl.store.jobs.job_of("cell", "c1") == "beta"
        assert h.client.get("/v1/cells/c1").json()["state"] == "rollout"
    finally:
        h.close()


def test_the_planner_divides_the_fleet_and_moves_a_cell(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    cells = _fleet(h)
    try:
        h.tick()
        assert h.ctl.jobs.targets == {"default": 3} and h.ctl.jobs.planned_moves == []  # one job: nothing moves
        assert h.client.post("/v1/jobs", json={"name": "beta", "model": "toy", "min_cells": 1}).status_code == 201
        h.clock.advance(2.0)
        h.tick()
        assert h.ctl.jobs.targets["beta"] >= 1
        moves = h.ctl.store.jobs.list_moves()
        assert len(moves) == 1 and moves[0].to_job == "beta"
        assert _settle(h, cells, moves[0].id)["state"] == "done"
    finally:
        h.close()


SOURCE = {"host": "127.0.0.1", "port": 29999, "namespace": "versions"}


def _loads(c: FakeCell) -> list[int]:
    return [cmd["version"] for cmd in c.commands if cmd["type"] == "load_version"]


def test_each_job_loads_and_activates_its_own_lineage(tmp_path):
    h, (c0, c1, c2) = _setup(tmp_path)
    try:
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c2"}).json()["id"]
        assert _settle(h, [c0, c1, c2], mid)["state"] == "done"
        h.client.put("/v1/trainer/version-host", json={"host": SOURCE["host"], "port": SOURCE["port"]})
        tb = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "trainer", "job": "beta"}).json()["token"]}
        r = h.client.post("/v1/versions", json={"version": 1, "source": SOURCE}, headers=tb)
        assert r.status_code == 201 and r.json()["receivers"] == ["c2"]  # beta's cells only
        r = h.client.post("/v1/versions", json={"version": 2, "source": SOURCE}, headers=h.auth("trainer"))
        assert r.status_code == 201 and sorted(r.json()["receivers"]) == ["c0", "c1"]
        # a job's lineage only: beta's next version is checked against beta's newest (1), not 2
        assert h.client.post("/v1/versions", json={"version": 3, "source": SOURCE}, headers=tb).status_code == 201
        for c in (c0, c1, c2):
            c.sync()
        assert (_loads(c0), _loads(c1), _loads(c2)) == ([2], [2], [1, 3])
        c0.version = c1.version = 2
        c2.version = 3
        for _ in range(3):
            for c in (c0, c1, c2):
                c.sync()
            h.clock.advance(1.0), h.tick()
        states = {v["version"]: v["state"] for v in h.client.get("/v1/versions").json()["versions"]}
        assert states[2] == "active" and states[3] == "active"  # each once its own job's cells serve it
        assert states[1] in ("retiring", "broadcasting", "retired")  # beta's older one, superseded
        # a cell moving into beta loads beta's version, never default's
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}).json()["id"]
        for _ in range(60):
            for c in (c0, c1, c2):
                c.sync()
                if c is c1 and 3 in _loads(c1):
                    c1.version = 3
            h.clock.advance(0.3), h.tick()
            if h.ctl.store.jobs.get_move(mid).state == "done":
                break
        assert h.ctl.store.jobs.get_move(mid).state == "done"
        assert _loads(c1) == [2, 3] and h.client.get("/v1/cells/c1").json()["version"] == 3
        assert _loads(c0) == [2]  # negative control: default's cell was never told of beta's versions
    finally:
        h.close()


def test_a_move_that_cannot_drain_or_whose_job_went_is_undone(tmp_path, monkeypatch):
    from scheduler.control import jobmoves

    h = Harness(str(tmp_path / "s.sqlite"), min_rollout_cells=2)
    h.ctl.jobs.auto_move = False
    cells = _fleet(h, 2)
    try:
        assert h.client.post("/v1/jobs", json={"name": "beta", "model": "toy"}).status_code == 201
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c0"}).json()["id"]
        h.tick()
        move = h.ctl.store.jobs.get_move(mid)
        assert move.state == "draining" and move.history[-1][0] == "waiting"  # min_rollout_cells holds it
        monkeypatch.setattr(jobmoves, "START_TIMEOUT_S", 0.0)
        h.clock.advance(1.0), h.tick()
        assert h.ctl.store.jobs.get_move(mid).state == "undone"
        assert h.ctl.store.jobs.job_of("cell", "c0") == "default"
        monkeypatch.setattr(jobmoves, "START_TIMEOUT_S", 60.0)
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}).json()["id"]
        assert h.client.delete("/v1/jobs/beta").status_code == 200
        h.clock.advance(1.0), h.tick()
        assert h.ctl.store.jobs.get_move(mid).state == "undone"
        for c in cells:
            c.sync()
    finally:
        h.close()


def test_a_jobs_trainer_flips_its_own_jobs_cells_only(tmp_path):
    h, (c0, c1, c2) = _setup(tmp_path)
    try:
        tb = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "trainer", "job": "beta"}).json()["token"]}
        r = h.client.post("/v1/flips", json={"to": "training", "count": 1}, headers=tb)
        assert r.status_code == 409 and r.json()["reason"] == "no_cells"  # beta holds no cell yet
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c2"}).json()["id"]
        assert _settle(h, [c0, c1, c2], mid)["state"] == "done"
        r = h.client.post("/v1/flips", json={"to": "training", "cell": "c0"}, headers=tb)
        assert r.status_code == 403 and r.json()["reason"] == "wrong_job"
        r = h.client.post("/v1/flips", json={"to": "training", "count": 1}, headers=h.auth("trainer"))
        assert r.status_code == 202 and r.json()["flips"][0]["cell"] in ("c0", "c1")  # default's own
    finally:
        h.close()


def test_each_jobs_trainer_has_its_own_version_host(tmp_path):
    """Two jobs' trainers register two hosts: each job's publishes are vouched by its own, a
    job's training cell is sent to its own trainer's; a job whose trainer registered none falls
    back to the fleet's."""
    h, (c0, c1, c2) = _setup(tmp_path)
    try:
        mid = h.client.post("/v1/jobs/beta/cells", json={"cell": "c2"}).json()["id"]
        assert _settle(h, [c0, c1, c2], mid)["state"] == "done"
        tb = {"Authorization": "Bearer " + h.client.post("/v1/tokens", json={"scope": "trainer", "job": "beta"}).json()["token"]}
        alpha, beta = {"host": "127.0.0.1", "port": 29001}, {"host": "127.0.0.1", "port": 29002}
        assert h.client.put("/v1/trainer/version-host", json=alpha, headers=h.auth("trainer")).status_code == 200
        # beta registered none yet: the fleet's host vouches (as before jobs had hosts)
        ok = h.client.post("/v1/versions", json={"version": 1, "source": {**alpha, "namespace": "v"}}, headers=tb)
        assert ok.status_code == 201, ok.text
        assert h.client.put("/v1/trainer/version-host", json=beta, headers=tb).status_code == 200
        r = h.client.post("/v1/versions", json={"version": 2, "source": {**alpha, "namespace": "v"}}, headers=tb)
        assert r.status_code == 422 and r.json()["reason"] == "source_not_vouched"  # the other job's host
        r = h.client.post("/v1/versions", json={"version": 2, "source": {**beta, "namespace": "v"}}, headers=tb)
        assert r.status_code == 201, r.text
        r = h.client.post("/v1/versions", json={"version": 3, "source": {**beta, "namespace": "v"}},
                          headers=h.auth("trainer"))
        assert r.status_code == 422  # and default's trainer may not name beta's
        # a move's drain sends the cell to the store of the job it moves to (it loads that job's
        # version through it), not to its own job's
        assert h.client.post("/v1/jobs/beta/cells", json={"cell": "c1"}).status_code == 202
        pump([c0, c1, c2], rounds=5, harness=h)
        roles = [cmd for cmd in c1.commands if cmd["type"] == "set_role" and cmd["role"] == "training"]
        assert roles and {k: roles[-1]["source"][k] for k in ("host", "port")} == beta, roles
        mid = next(m.id for m in h.ctl.store.jobs.list_moves(active_only=True) if m.cell_id == "c1")
        c1.version = 2  # it loads beta's newest
        assert _settle(h, [c0, c1, c2], mid)["state"] == "done"
        # default's one cell may train: its job keeps no rollout cell of its own (the fleet's floor
        # is still held by beta's)
        r = h.client.patch("/v1/jobs/default", json={"settings": {"min_rollout_cells": 0}})
        assert r.status_code == 200 and r.json()["trainer"]["min_rollout_cells"] == 0, r.text
        for cell, headers, want in ((c2, tb, beta), (c0, h.auth("trainer"), alpha)):
            flip = h.client.post("/v1/flips", json={"cell": cell.cell_id, "to": "training"}, headers=headers)
            assert flip.status_code == 202, flip.text
            pump([c0, c1, c2], rounds=5, harness=h)
            roles = [cmd for cmd in cell.commands if cmd["type"] == "set_role" and cmd["role"] == "training"]
            assert roles and {k: roles[-1]["source"][k] for k in ("host", "port")} == want, roles
    finally:
        h.close()
