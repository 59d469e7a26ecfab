"""A restarted scheduler rebuilds from the same SQLite file and the cells' re-sync."""

from __future__ import annotations

from sched_fakes import FakeCell, Harness, hand_over, pump, until_held


def _setup(tmp_path, n_requests: int = 3):
    h = Harness(str(tmp_path / "s.sqlite"))
    cells = [FakeCell(h.client, f"c{i}", max_running=4) for i in range(3)]
    for c in cells:
        c.register(), c.sync()
    for i in range(n_requests):
        h.complete({"prompt_ids": [i], "max_tokens": 8}, session=f"s{i}")
    for _ in range(500):
        for c in cells:
            c.sync()
        if sum(len(c.held) for c in cells) >= n_requests:
            break
    for c in cells:
        c.step(2), c.sync()
    if not cells[0].held:  # make sure the flipping cell has work to move
        fut = h.complete({"prompt_ids": [99], "max_tokens": 8}, session="extra")
        until_held(cells[0], fut)
        cells[0].step(2), cells[0].sync()
    return h, cells


def _restart(h: Harness, cells: list[FakeCell]) -> Harness:
    h.close()
    h2 = Harness(h.db_path)
    for c in cells:
        c.client = h2.client
    return h2


def _all_finished(h: Harness) -> None:
    counts = h.ctl.store.owners.count_requests()
    assert set(counts) == {"finished"}, counts
    for sid in [r[0] for r in h.ctl.store.execute("SELECT id FROM sessions").fetchall()]:
        sess = h.client.get(f"/v1/sessions/{sid}").json()
        assert sum(sess["loss_mask"]) == 8, (sid, sess["loss_mask"])


def test_restart_mid_drain_completes_the_flip_once(tmp_path):
    h, cells = _setup(tmp_path)
    c0 = cells[0]
    fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
    h.tick()
    for c in cells:
        c.sync()
    assert c0.migrations_out
    h = _restart(h, cells)
    try:
        h.tick()
        assert not h.ctl.ready  # inventory not rebuilt: nothing active yet
        for c in cells:
            c.sync()
        h.tick()
        assert h.ctl.ready
        for mid in list(c0.migrations_out):  # copies that were under way finish against the new process
            dst = next(c for c in cells[1:] if any(x.get("migration_id") == mid for x in c.commands))
            hand_over(c0, dst, mid)
        for _ in range(4):
            h.tick()
            for c in cells:
                c.sync()
        flip = h.client.get(f"/v1/flips/{fid}").json()
        assert flip["state"] == "done"
        assert [s for s, *_ in flip["history"]].count("draining") == 1
        assert 'cellflip_flips_total{outcome="done"} 1.0' in h.client.get("/metrics").text
        pump(cells, rounds=20, harness=h)
        _all_finished(h)
    finally:
        h.close()


def test_restart_with_a_silent_cell_fails_its_flip_and_replaces_its_requests(tmp_path):
    h, cells = _setup(tmp_path)
    c0 = cells[0]
    fid = h.client.post("/v1/flips", json={"cell": "c0", "to": "training"}).json()["id"]
    h.tick()
    h = _restart(h, cells)
    try:
        alive = cells[1:]
        for c in alive:
            c.sync()
        h.tick()
        assert not h.ctl.ready  # c0 has not come back yet; the grace is one lease
        for _ in range(3):
            h.clock.advance(2.0)
            for c in alive:
                c.sync()
        h.tick()
        assert h.ctl.ready
        assert h.client.get("/v1/cells/c0").json()["state"] == "down"
        flip = h.client.get(f"/v1/flips/{fid}").json()
        assert flip["state"] == "failed" and "cell lost" in flip["reason"]
        assert c0.sync(expect=409)["reason"] == "fenced"
        pump(alive, rounds=30, harness=h)
        _all_finished(h)
    finally:
        h.close()


def test_pending_flip_survives_restart(tmp_path):
    h, cells = _setup(tmp_path, n_requests=1)
    r = h.client.post("/v1/flips", json={"cell": "c2", "to": "training"}, headers={"Idempotency-Key": "once"})
    fid = r.json()["id"]
    h = _restart(h, cells)
    try:
        replay = h.client.post("/v1/flips", json={"cell": "c2", "to": "training"}, headers={"Idempotency-Key": "once"})
        assert replay.status_code == 202 and replay.json()["id"] == fid
        for _ in range(4):
            for c in cells:
                c.sync()
            h.tick()
            for mid in list(cells[2].migrations_out):
                dst = next(c for c in cells[:2] if any(x.get("migration_id") == mid for x in c.commands))
                hand_over(cells[2], dst, mid)
        assert h.client.get(f"/v1/flips/{fid}").json()["state"] == "done"
        assert len(h.client.get("/v1/flips").json()["flips"]) == 1
        pump(cells, rounds=20, harness=h)
        _all_finished(h)
    finally:
        h.close()


LEGACY_TOKENS = """
CREATE TABLE tokens(
  session_id TEXT NOT NULL, idx INTEGER NOT NULL, token_id INTEGER NOT NULL,
  loss_mask INTEGER NOT NULL, logprob REAL, version INTEGER, truncated INTEGER NOT NULL,
  old_logprob REAL, provenance TEXT, PRIMARY KEY(session_id, idx)) WITHOUT ROWID;
"""


def test_store_from_before_added_columns_opens_with_their_defaults(tmp_path):
    """A store an older scheduler wrote (tables without the columns added since) is upgraded
    in place when opened: its rows read back with the new columns' defaults, and writes work."""
    import re
    import sqlite3

    from scheduler.store import ADDED_COLUMNS, SCHEMA, Store
    from scheduler.store.fleet import FlipRow

    old = SCHEMA
    for table, column, decl in ADDED_COLUMNS:
        old, n = re.subn(rf",\s*{column} {re.escape(decl)}(?=\s*[,)])", "", old)
        assert n == 1, (table, column)
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript(old)
    conn.execute("INSERT INTO flips VALUES ('f1','c0','training','done',NULL,NULL,2,0,1,1.0,2.0,'[]')")
    conn.executescript(LEGACY_TOKENS)  # the per-token layout, before `epoch` and `cell` were added
    conn.execute("INSERT INTO tokens VALUES ('s0',0,7,1,-0.5,0,0,NULL,NULL)")
    conn.commit()
    conn.close()

    store = Store(db)
    flip = store.fleet.get_flip("f1")
    assert (flip.migrated, flip.recomputed, flip.kv_store) == (2, 1, 0)
    with store.tx():
        store.fleet.put_flip(FlipRow("f2", "c1", "training", "done", kv_store=3))
    store.close()
    again = Store(db)  # a second open adds nothing twice
    assert again.fleet.get_flip("f2").kv_store == 3 and again.fleet.get_flip("f1").kv_store == 0
    assert again.sessions.epochs("s0") == [(0, None)]  # a token stored before epochs were recorded
    assert again.sessions.read("s0") == [(7, 1, -0.5, 0, 0, None, None)]  # converted to chunks on open
    again.close()
