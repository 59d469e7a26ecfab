"""A sync's writes are three statements, not a few per batch: its chunk rows (built straight from
the batches' columns, `tokenpack.sampled_rows`) in one multi-row INSERT, the request counts and the
sessions' lengths each as one `UPDATE ... FROM (VALUES ...)` (`store.base.update_by_key`)."""

from __future__ import annotations

from array import array

import pytest
from sched_fakes import FakeCell, open_harness, until_held

from scheduler.store import Store
from scheduler.store import base as store_base
from scheduler.store.tokenpack import sampled_chunks, sampled_rows


@pytest.fixture
def harness(tmp_path):
    yield from open_harness(tmp_path)


@pytest.fixture
def store(tmp_path):
    s = Store(str(tmp_path / "s.sqlite"))
    with s.tx():
        s.executemany("INSERT INTO sessions(id, state, length, segment_starts, created_at) VALUES (?, 'open', ?, '[0]', 0)",
                      [(f"s{k}", k) for k in range(900)])
    yield s
    s.close()


def _lengths(store) -> dict[str, int]:
    return dict(store.execute("SELECT id, length FROM sessions").fetchall())


def test_update_by_key_sets_each_row_its_own_value_over_several_statements(store, monkeypatch):
    monkeypatch.setattr(store_base, "VALUES_ROWS", 7)  # 850 rows: many statements, one short last one
    rows = [(f"s{k}", 10_000 + 3 * k) for k in range(850)] + [("nobody", 5)]
    with store.tx():
        store_base.update_by_key(store, "sessions", "id", ("length",), rows)
    got = _lengths(store)
    assert all(got[f"s{k}"] == 10_000 + 3 * k for k in range(850))
    assert all(got[f"s{k}"] == k for k in range(850, 900))  # the rows not named keep their value
    assert "nobody" not in got  # an unknown key adds nothing
    # negative control: the same check fails on a store where one row was left behind
    with store.tx():
        store.execute("UPDATE sessions SET length = 1 WHERE id = 's3'")
    assert not all(_lengths(store)[f"s{k}"] == 10_000 + 3 * k for k in range(850))


def test_update_by_key_sets_the_shared_terms_and_refuses_a_repeated_key(store):
    with store.tx():
        store_base.update_by_key(store, "sessions", "id", ("length",), [("s1", 7), ("s2", 8)], "reward = ?", (0.5,))
    assert store.execute("SELECT id, length, reward FROM sessions WHERE reward IS NOT NULL ORDER BY id").fetchall() == [
        ("s1", 7, 0.5), ("s2", 8, 0.5)]
    before = _lengths(store)
    with pytest.raises(ValueError, match="twice"), store.tx():
        store_base.update_by_key(store, "sessions", "id", ("length",), [("s5", 1), ("s6", 2), ("s5", 3)])
    assert _lengths(store) == before  # refused before anything was written


def _chunk_rows(*args) -> list[tuple]:
    return [c.row() for c in sampled_chunks(*args)]


@pytest.mark.parametrize("columns", [
    (array("i", [5, 6, 7]), array("d", [-0.5, -0.25, 0.0]), array("i", [3, 3, 3]), array("B", [0, 0, 0])),
    (array("i", [5, 6, 7]), array("d", [-0.5, -0.25, 0.0]), array("i", [3, 3, 3]), array("B", [0, 1, 0])),
    ((5, 6, 7), (-0.5, -0.25, -1.0), (3, 3, 3), (False, False, True)),
    ((5, 6, 7, 8), (-0.5, -0.25, -1.0, -2.0), (3, 3, 4, 4), (False, True, False, False)),  # two versions: two rows
])
def test_sampled_rows_are_the_chunks_rows(columns):
    args = ("sess", 40, *columns, 2, "cell-a")
    want = _chunk_rows(*args)
    assert sampled_rows(*args) == want
    # negative control: a batch of another version gives other rows
    ids, lps, vs, tr = columns
    assert sampled_rows("sess", 40, ids, lps, tuple(v + 1 for v in vs), tr, 2, "cell-a") != want


def test_sampled_rows_refuse_columns_of_unequal_lengths():
    with pytest.raises(ValueError, match="unequal"):
        sampled_rows("sess", 0, array("i", [1, 2]), array("d", [-0.5]), array("i", [0, 0]), array("B", [0, 0]), 1, "c")


def _start(harness, n: int) -> tuple[FakeCell, list[str]]:
    c = FakeCell(harness.client, "c1", max_running=n)
    c.register()
    c.sync()
    futs = [harness.complete({"prompt_ids": [1], "max_tokens": 50}, session=f"s{k}") for k in range(n)]
    for k, f in enumerate(futs, 1):
        until_held(c, f, count=k)
    by_session = {h.session_id: rid for rid, h in c.held.items()}
    return c, [by_session[f"s{k}"] for k in range(n)]


def _writes(sql: str) -> int:
    return int(sql.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE", "REPLACE"))


class _Count:
    """Writing statements run on the store (an `executemany` counts once per row); reads are
    not counted (the harness's waiting completions read from other threads meanwhile)."""

    def __init__(self, store, monkeypatch) -> None:
        self.n = 0
        run, many = store.execute, store.executemany

        def execute(sql, params=()):
            self.n += _writes(sql)

            return run(sql, params)

        def executemany(sql, rows):
            rows = list(rows)
            self.n += len(rows) * _writes(sql)

            return many(sql, rows)
        monkeypatch.setattr(store, "execute", execute)
        monkeypatch.setattr(store, "executemany", executemany)


def test_a_sync_of_32_batches_writes_in_three_statements(harness, monkeypatch):
    c, rids = _start(harness, 4)  # 4 requests, 8 batches each, every batch continuing the one before
    count = _Count(harness.ctl.store, monkeypatch)
    c.pending_tokens += [{"request_id": rid, "epoch": 1, "start": 2 * b, "records": [[100 + b, -0.5, 0, False]] * 2,
                          "finish_reason": None} for b in range(8) for rid in rids]
    assert c.sync()["rejected"] == []
    ran = count.n
    owners, sessions = harness.ctl.store.owners, harness.ctl.store.sessions
    assert all(owners.get_request(rid).num_generated == 16 for rid in rids)
    assert all(sessions.length(f"s{k}") == 17 for k in range(4))
    assert sessions.token_ids("s0") == [1] + [100 + b for b in range(8) for _ in range(2)]
    # the 32 chunk rows, the requests' counts and the sessions' lengths: one statement each
    assert ran == 3, ran
    assert harness.ctl.store.execute("SELECT COUNT(*) FROM token_chunks WHERE loss_mask = 1").fetchone()[0] == 32
    # negative control: the counter counts a row-by-row write as one statement a row
    before = count.n
    harness.ctl.store.executemany("UPDATE requests SET num_generated=num_generated WHERE id=?", [(r,) for r in rids])
    assert count.n - before == len(rids)


def test_for_tokens_reads_what_the_two_reads_did(harness):
    _, rids = _start(harness, 3)
    store = harness.ctl.store
    ids = [*rids, "nope", rids[0]]  # an unknown id and a repeated one
    reqs, lengths = store.owners.for_tokens(ids)
    bare = store.owners.get_requests(ids, params=False)
    assert set(reqs) == set(bare) == set(rids)
    assert all(reqs[r] == bare[r] for r in rids)
    assert lengths == store.sessions.lengths([r.session_id for r in bare.values()]) == {"s0": 1, "s1": 1, "s2": 1}
    # negative control: a row that moved on since is no longer equal
    store.owners.set_num_generated(rids[0], 5)
    assert store.owners.get_requests([rids[0]], params=False)[rids[0]] != reqs[rids[0]]


def test_a_sync_looks_up_only_its_batches_versions(harness):
    """The versions a cell may tag tokens with are looked up for the sync's batches' versions,
    not read whole (the store keeps every version ever published)."""
    from scheduler.store.fleet import VersionRow

    store, trust = harness.ctl.store, harness.ctl.trust
    with store.tx():
        for v in range(1, 6):
            store.fleet.put_version(VersionRow(v, "retired", 0.0))
    assert store.fleet.published_among([0, 3, 5, 9, True, 1 << 70]) == {3, 5} | (
        {0} if store.fleet.get_version(0) else set())
    assert store.fleet.published_among(range(-2000, 2000)) == {v.v for v in store.fleet.list_versions()}
    trust.told["cx"] = {7}
    assert trust.servable_among("cx", [3, 7, 8]) == {3, 7}
    assert trust.servable_among("cx", [3, 7, 8]) == trust.servable_by("cx") & {3, 7, 8}
    # negative control: a version never published nor told is not servable
    assert 8 not in trust.servable_by("cx")


@pytest.mark.parametrize("truncated", [False, True])
def test_packed_columns_decode_to_the_records_sent(truncated):
    from scheduler.contract.records import TokenRecords

    sent = TokenRecords.of([(7 + k, -0.125 * k, 3, truncated and k == 2) for k in range(5)]).packed()
    got = TokenRecords.unpack(sent.wire())
    assert got == sent and all(type(c) is array for c in got.columns)
    assert got.logprobs.tobytes() == sent.logprobs.tobytes()  # bit for bit
    # negative controls: a column one item short, or not base64, is refused and names the column
    short = {**sent.wire(), "versions": TokenRecords.of([(1, 0.0, 3, False)] * 4).packed().wire()["versions"]}
    with pytest.raises(ValueError, match="versions holds 16 bytes"):
        TokenRecords.unpack(short)
    with pytest.raises(ValueError, match="logprobs is not base64"):
        TokenRecords.unpack({**sent.wire(), "logprobs": "@@@@"})
