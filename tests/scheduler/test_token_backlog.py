"""The scoring backlog kept per (session, version) by triggers (scheduler/store/tokenbuf.py
`token_backlog`): after every kind of write to the chunks (appends, rescoring, marking missing,
truncation, a session's deletion, a rolled-back savepoint) it equals a recount from the chunks,
and a store of chunks written before the backlog existed opens with it rebuilt."""

from __future__ import annotations

import random

import pytest

from scheduler.contract.records import TokenRecords
from scheduler.store import Store

_RECOUNT = ("SELECT session_id, COALESCE(version, -1), MIN(ufirst), MAX(ulast), SUM(unscored) FROM token_chunks"
            " WHERE unscored > 0 GROUP BY session_id, COALESCE(version, -1) ORDER BY 1, 2")


def _kept(store: Store) -> list[tuple]:
    store.sessions.buf.restate()
    return store.execute("SELECT session_id, version, lo, hi, n FROM token_backlog ORDER BY 1, 2").fetchall()


def _recount(store: Store) -> list[tuple]:
    return store.execute(_RECOUNT).fetchall()


def _records(rng: random.Random, n: int, versions: list[int]) -> TokenRecords:
    return TokenRecords([rng.randrange(1000) for _ in range(n)], [-rng.random() for _ in range(n)],
                        [versions[i * len(versions) // n] for i in range(n)], [False] * n)


def _append(store: Store, rng: random.Random, sid: str) -> None:
    at = store.sessions.length(sid)
    v = rng.randrange(3)
    with store.tx(durable=False):
        store.sessions.append_sampled(sid, at, _records(rng, rng.randrange(1, 24), [v, v + 1]), epoch=1, cell="c")


def _write(store: Store, rng: random.Random, sid: str) -> str:
    """One random write to session `sid`; returns what it was."""
    n = store.sessions.length(sid)
    kind = rng.choice(["append", "append", "prompt", "score", "missing", "truncate", "delete"])
    with store.tx(durable=False):
        if kind == "prompt":
            store.sessions.append_prompt(sid, [rng.randrange(100) for _ in range(rng.randrange(1, 5))])
        elif kind == "score" and n:
            lo = rng.randrange(n)
            vals = [-rng.random() if rng.random() < 0.8 else None for _ in range(rng.randrange(1, n - lo + 1))]
            store.sessions.fill_old_logprobs(sid, lo, vals, "exact", version=rng.choice([None, 0, 1, 2, 3]))
        elif kind == "missing" and n:
            lo = rng.randrange(n)
            store.sessions.mark_missing(sid, rng.randrange(4), lo, rng.randrange(lo, n + 1))
        elif kind == "truncate" and n:
            store.sessions.truncate(sid, rng.randrange(store.sessions.get(sid).segment_starts[-1], n + 1))
        elif kind == "delete":
            store.sessions.buf.delete_session(sid)
            store.execute("UPDATE sessions SET length=0, segment_starts='[0]' WHERE id=?", (sid,))
        else:
            kind = "append"
    if kind == "append":
        _append(store, rng, sid)
    return kind


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_backlog_equals_a_recount_after_every_kind_of_write(seed):
    store, rng = Store(":memory:"), random.Random(seed)
    sids = [f"s{k}" for k in range(4)]
    for sid in sids:
        store.sessions.append_prompt(sid, [1, 2, 3])
    kinds, stale = set(), 0
    for _ in range(200):
        kinds.add(_write(store, rng, rng.choice(sids)))
        raw = store.execute("SELECT session_id, version, lo, hi, n FROM token_backlog ORDER BY 1, 2").fetchall()
        stale += raw != _recount(store)  # bounds a delete or rescore left too wide, before `restate`
        assert _kept(store) == _recount(store)
    assert kinds == {"append", "prompt", "score", "missing", "truncate", "delete"}
    assert stale, "some write left stale bounds for `restate` to recompute"
    assert _recount(store), "the run ends with a backlog to compare"
    # negative control: a kept count that is off by one is seen
    store.execute("UPDATE token_backlog SET n = n + 1 WHERE session_id = (SELECT MIN(session_id) FROM token_backlog)")
    assert _kept(store) != _recount(store)


def test_a_rolled_back_savepoint_leaves_the_backlog_as_it_was():
    store, rng = Store(":memory:"), random.Random(5)
    store.sessions.append_prompt("s", [1, 2])
    _append(store, rng, "s")
    before = _kept(store)
    with store.tx(durable=False):
        with pytest.raises(RuntimeError), store.savepoint():
            store.sessions.append_sampled("s", store.sessions.length("s"), _records(rng, 9, [7]), epoch=1, cell="c")
            store.sessions.mark_missing("s", 0, 0, 100)
            assert _kept(store) != before  # the savepoint did change it
            raise RuntimeError("undo")
    assert _kept(store) == before == _recount(store)


def test_a_store_of_chunks_without_the_backlog_opens_with_it_rebuilt(tmp_path):
    path, rng = tmp_path / "s.sqlite", random.Random(6)
    store = Store(path)
    for sid in ("a", "b"):
        store.sessions.append_prompt(sid, [1, 2, 3])
        for _ in range(4):
            _append(store, rng, sid)
    with store.tx(durable=False):
        store.sessions.fill_old_logprobs("a", 3, [-0.5] * 4, "exact")
    want = _recount(store)
    assert want
    # the former layout: no backlog table, its two partial indexes over the chunks
    for stmt in ("DROP TRIGGER backlog_add", "DROP TRIGGER backlog_take", "DROP TRIGGER backlog_rescore",
                 "DROP TABLE token_backlog",
                 "CREATE INDEX chunks_unscored ON token_chunks(version, unscored) WHERE unscored > 0",
                 "CREATE INDEX chunks_backlog ON token_chunks(session_id, version, start, ufirst, ulast, unscored)"
                 " WHERE unscored > 0"):
        store.execute(stmt)
    store.close()
    store = Store(path)
    assert _kept(store) == want
    names = {r[0] for r in store.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert not {"chunks_unscored", "chunks_backlog"} & names
    assert store.sessions.unscored_by_version() == {v: n for v, n in _by_version(want).items()}
    store.close()
    # negative control: a backlog table that exists but lost its rows is not rebuilt on open
    store = Store(path)
    store.execute("DELETE FROM token_backlog")
    store.close()
    store = Store(path)
    assert _kept(store) != want
    store.close()


def _by_version(rows: list[tuple]) -> dict[int, int]:
    out: dict[int, int] = {}
    for _, v, _, _, n in rows:
        out[v] = out.get(v, 0) + n
    return out
