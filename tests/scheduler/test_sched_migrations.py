"""Migration commit/abort: the ownership compare-and-set and its races."""

from __future__ import annotations

import pytest
from sched_fakes import flip_holder, hand_over, open_harness, pump


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


def _migrating(harness, max_tokens: int = 12):
    """a holds one request with 2 synced + 1 unsynced tokens; a flip to training issues a KV migration a -> b."""
    a, b, fut = flip_holder(harness, max_tokens)
    a.step(1)  # decoding goes on during the copy rounds; this token is not synced yet
    out = [c for c in a.commands if c["type"] == "migrate_out"]
    into = [c for c in b.commands if c["type"] == "migrate_in"]
    assert len(out) == 1 and len(into) == 1 and out[0]["migration_id"] == into[0]["migration_id"]
    assert out[0]["dest_cell"] == "b" and into[0]["src_cell"] == "a" and into[0]["reserve_tokens"] >= 4
    return a, b, fut, out[0]["request_id"], out[0]["migration_id"]


def _req(harness, rid):
    return harness.ctl.store.owners.get_request(rid)


def test_commit_moves_owner_and_is_idempotent(harness):
    a, b, fut, rid, mid = _migrating(harness)
    tail = a.held[rid].tokens[2:]
    assert hand_over(a, b, mid) == 2
    r = _req(harness, rid)
    assert (r.cell_id, r.epoch, r.state, r.num_generated) == ("b", 2, "running", 3)
    again = b.commit(mid, rid, 1, 2, tail, 3)
    assert again.status_code == 200 and again.json() == {"epoch": 2}
    late = a.abort_migration(mid)
    assert late.status_code == 409 and late.json()["reason"] == "committed"
    a.pending_tokens = [{"request_id": rid, "epoch": 1, "start": 3, "records": [[5, -1.0, 0, False]], "finish_reason": None}]
    assert rid in a.sync()["rejected"]
    pump([a, b], until=fut, harness=harness)
    out = fut.result(timeout=60).json()
    assert len(out["token_ids"]) == 12
    text = harness.client.get("/metrics").text
    assert 'cellflip_migrations_total{outcome="committed",path="kv"} 1.0' in text


def _history(harness, rid):
    """The store's token history of the request (faultkit's checker input) and its verdict."""
    from faultkit.checker import check_token_epochs

    st = harness.ctl.store
    r = st.owners.get_request(rid)
    rows = st.execute("SELECT id, request_id, src, dst, epoch, state, commit_tokens FROM migrations").fetchall()
    migs = {m[0]: {"request": m[1], "src": m[2], "dst": m[3], "epoch": m[4], "state": m[5], "commit_tokens": m[6]}
            for m in rows}
    epochs = st.sessions.epochs(r.session_id, r.base)
    reqs = {rid: {"session": r.session_id, "base": r.base}}
    return migs, epochs, check_token_epochs(reqs, migs, {r.session_id: epochs})


def test_the_store_records_each_tokens_epoch_and_the_commit_point(harness):
    a, b, fut, rid, mid = _migrating(harness)
    assert hand_over(a, b, mid) == 2
    migs, epochs, vio = _history(harness, rid)
    assert migs[mid]["commit_tokens"] == 3 and migs[mid]["epoch"] == 1
    assert [e for _, e in epochs] == [1, 1, 2]  # two synced by a at epoch 1, the tail under the commit's 2
    pump([a, b], until=fut, harness=harness)
    migs, epochs, vio = _history(harness, rid)
    assert len(epochs) == 12 and [e for _, e in epochs[3:]] == [2] * 9 and vio == []
    assert harness.ctl.store.execute("SELECT COUNT(*) FROM foreign_batches").fetchone()[0] == 0  # the fence held


def test_with_the_fence_off_the_store_history_shows_the_zombies_tokens(harness, monkeypatch):
    from scheduler.control import ingest

    a, b, fut, rid, mid = _migrating(harness)
    assert hand_over(a, b, mid) == 2
    monkeypatch.setattr(ingest, "CANARY_NO_FENCING", True)  # the fault campaign's canary
    a.pending_tokens = [{"request_id": rid, "epoch": 1, "start": 3, "records": [[5, -1.0, 0, False]],
                         "finish_reason": None}]
    assert a.sync()["rejected"] == []  # the stale owner's token is stored
    _, epochs, vio = _history(harness, rid)
    assert epochs[3][1] == 1
    assert len(vio) == 1 and "store's token history" in vio[0] and mid in vio[0]
    a.pending_tokens = [{"request_id": rid, "epoch": 1, "start": 3, "records": [[5, -1.0, 0, False]],
                         "finish_reason": None}]
    assert a.sync()["rejected"] == []  # an exact duplicate adds no token, but the store saw who sent it
    from faultkit.checker import check_foreign_batches

    rows = harness.ctl.store.execute("SELECT request_id, cell_id, epoch, owner, owner_epoch, start, count, new"
                                     " FROM foreign_batches ORDER BY at").fetchall()
    assert [r[1:] for r in rows] == [("a", 1, "b", 2, 3, 1, 1), ("a", 1, "b", 2, 3, 1, 0)]
    keys = ("request", "cell", "epoch", "owner", "owner_epoch", "start", "count", "new")
    vio = check_foreign_batches([dict(zip(keys, r)) for r in rows])
    assert len(vio) == 2 and all("a@1 while b@2 owned it" in v for v in vio)


@pytest.mark.parametrize("canary", [False, True])
def test_a_fenced_cells_tokens_reach_the_store_only_with_the_fence_off(harness, monkeypatch, canary):
    """The canary lets a zombie's last batch in before it is told it is fenced (as a scheduler
    without the fence would), so the store's own history can show the split; the real
    scheduler refuses the batch and stores nothing."""
    from scheduler.control import cellsync, ingest

    a, b, fut, rid, mid = _migrating(harness)
    assert hand_over(a, b, mid) == 2
    monkeypatch.setattr(ingest, "CANARY_NO_FENCING", canary)
    monkeypatch.setattr(cellsync, "CANARY_NO_FENCING", canary)
    a.incarnation = "a-before-restart"  # a newer incarnation registered meanwhile: this one is fenced
    a.pending_tokens = [{"request_id": rid, "epoch": 1, "start": 3, "records": [[5, -1.0, 0, False]],
                         "finish_reason": None}]
    assert a.sync(expect=409)["reason"] == "stale_incarnation"
    _, epochs, vio = _history(harness, rid)
    foreign = harness.ctl.store.execute("SELECT cell_id, epoch, new FROM foreign_batches").fetchall()
    if canary:
        assert epochs[3][1] == 1 and foreign == [("a", 1, 1)]
        assert len(vio) == 1 and "store's token history" in vio[0]
    else:
        assert len(epochs) == 3 and foreign == [] and vio == []


def test_abort_before_commit_keeps_source_owner(harness):
    a, b, fut, rid, mid = _migrating(harness)
    r = b.abort_migration(mid, "could not reserve")
    assert r.status_code == 200 and r.json()["state"] == "aborted"
    assert b.abort_migration(mid).status_code == 200  # idempotent
    a.sync()
    assert any(c["type"] == "cancel_migration" and c["migration_id"] == mid for c in a.commands)
    req = _req(harness, rid)
    assert (req.cell_id, req.epoch, req.state) == ("a", 1, "running")
    h = a.held[rid]
    late = b.commit(mid, rid, 1, h.synced, h.tokens[h.synced:], len(h.tokens))
    assert late.status_code == 409 and late.json()["reason"] == "aborted"
    assert a.sync()["rejected"] == []  # the source keeps decoding at epoch 1


def test_stale_epoch_wrong_party_and_fenced_destination(harness):
    a, b, fut, rid, mid = _migrating(harness)
    h = a.held[rid]
    wrong = a.commit(mid, rid, 1, h.synced, [], h.synced)
    assert wrong.status_code == 409 and wrong.json()["reason"] == "not_destination"
    assert harness.client.post("/internal/v1/migrations/nope/commit", json={
        "cell_id": "b", "incarnation": b.incarnation, "request_id": rid, "epoch": 1, "num_tokens": 1}).status_code == 404
    zombie_inc, b.incarnation = b.incarnation, "b-old"
    assert b.commit(mid, rid, 1, h.synced, [], h.synced).json()["reason"] == "fenced"
    b.incarnation = zombie_inc
    stale = b.commit(mid, rid, 0, h.synced, h.tokens[h.synced:], len(h.tokens))
    assert stale.status_code == 409 and stale.json()["reason"] == "stale_epoch"
    assert harness.ctl.store.owners.get_migration(mid).state == "aborted"
    assert _req(harness, rid).state == "running"


def test_gap_is_retryable_and_mismatch_aborts(harness):
    a, b, fut, rid, mid = _migrating(harness)
    h = a.held[rid]
    gap = b.commit(mid, rid, 1, 3, [[9, -1.0, 0, False]], 4)  # token 2 is missing
    assert gap.status_code == 409 and gap.json()["reason"] == "gap"
    assert harness.ctl.store.owners.get_migration(mid).state == "pending"
    bad = [[h.tokens[1][0] + 1, -1.0, 0, False]] + h.tokens[2:]
    mismatch = b.commit(mid, rid, 1, 1, bad, 3)
    assert mismatch.status_code == 409 and mismatch.json()["reason"] == "mismatch"
    assert harness.ctl.store.owners.get_migration(mid).state == "aborted"
    assert "cellflip_retokenization_drift_total 1.0" in harness.client.get("/metrics").text


def test_pending_migration_times_out(harness):
    a, b, fut, rid, mid = _migrating(harness)
    harness.clock.advance(4.0)
    a.sync(), b.sync()
    harness.ctl.ctx.mig_cfg = harness.ctl.ctx.mig_cfg.model_copy(update={"transfer_timeout_s": 0.5})
    harness.tick()
    assert harness.ctl.store.owners.get_migration(mid).state == "aborted"
    a.sync(), b.sync()
    for c in (a, b):
        assert any(x["type"] == "cancel_migration" and x["migration_id"] == mid for x in c.commands)


def test_source_death_mid_migration_reprefills_and_commit_fails(harness):
    a, b, fut, rid, mid = _migrating(harness)
    h = a.held[rid]
    harness.clock.advance(3.0)
    b.sync()
    harness.clock.advance(3.0)
    b.sync()
    harness.tick()  # a's lease is gone
    late = b.commit(mid, rid, 1, h.synced, h.tokens[h.synced:], len(h.tokens))
    assert late.status_code == 409 and late.json()["reason"] == "aborted"
    b.sync()
    assert any(c["type"] == "start" and c["request_id"] == rid and c["epoch"] == 2 for c in b.commands)
    flip = harness.client.get("/v1/flips").json()["flips"][0]
    assert flip["state"] == "failed" and "cell lost" in flip["reason"]
    pump([b], until=fut)
    assert len(fut.result(timeout=60).json()["token_ids"]) == 12


def test_integrity_check_catches_a_broken_invariant(harness):
    a, b, fut, rid, mid = _migrating(harness)
    assert harness.client.portal.call(harness.ctl.check_integrity) == []
    store = harness.ctl.store
    store.execute("UPDATE migrations SET state='aborted' WHERE id=?", (mid,))
    problems = harness.client.portal.call(harness.ctl.check_integrity)
    assert problems and "migrating" in problems[0]
    store.execute("UPDATE migrations SET state='pending' WHERE id=?", (mid,))
