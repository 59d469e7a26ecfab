"""The column-packed token buffer (scheduler/store/tokenbuf.py, tokenpack.py): every read gives
the tokens a per-token table gave, scoring updates single tokens inside chunks, the scoring
backlog's sums match a token-by-token count, and a per-token store converts on open."""

from __future__ import annotations

import random
import sqlite3

import pytest

from scheduler.contract.errors import Invalid
from scheduler.contract.records import StoredToken, TokenRecords
from scheduler.store import Store
from scheduler.store.owners import RequestRow


def _records(rng: random.Random, n: int, versions: list[int]) -> TokenRecords:
    return TokenRecords([rng.randrange(1 << 31) for _ in range(n)], [-rng.random() * 5 for _ in range(n)],
                        [versions[i * len(versions) // n] for i in range(n)], [rng.random() < 0.3 for _ in range(n)])


class Model:
    """The reference: a session's buffer as a plain list of `StoredToken` rows, with epochs and cells."""

    def __init__(self) -> None:
        self.rows: list[StoredToken] = []
        self.epochs: list[int | None] = []
        self.cells: list[str | None] = []

    def prompt(self, ids: list[int]) -> None:
        self.rows += [StoredToken(t, 0, None, None, 0, None, None) for t in ids]
        self.epochs += [None] * len(ids)
        self.cells += [None] * len(ids)

    def sampled(self, rec: TokenRecords, epoch: int, cell: str) -> None:
        self.rows += [StoredToken(r.token_id, 1, r.logprob, r.version, int(r.truncated), None, None) for r in rec]
        self.epochs += [epoch] * len(rec)
        self.cells += [cell] * len(rec)

    def score(self, start: int, values: list[float | None], prov: str, version: int | None = None) -> int:
        n = 0
        for i, v in enumerate(values):
            t = self.rows[start + i]
            if t.loss_mask and (version is None or t.version == version) and (v is not None or prov == "missing"):
                self.rows[start + i] = t._replace(old_logprob=v, provenance=prov)
                n += 1
        return n


def _build(store: Store, sid: str, seed: int) -> Model:
    """A session of three turns: prompts, sampled batches spanning two versions, epochs and cells."""
    rng, m = random.Random(seed), Model()
    for turn in range(3):
        ids = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        store.sessions.append_prompt(sid, ids)
        m.prompt(ids)
        for b in range(3):
            rec = _records(rng, rng.randrange(1, 20), [turn + b, turn + b + 1])
            with store.tx(durable=False):
                store.sessions.append_sampled(sid, len(m.rows), rec, epoch=turn * 3 + b, cell=f"c{b}")
            m.sampled(rec, turn * 3 + b, f"c{b}")
    return m


def _check(store: Store, sid: str, m: Model) -> None:
    s, n = store.sessions, len(m.rows)
    assert s.length(sid) == n and s.read(sid) == m.rows
    for lo, hi in [(0, 1), (3, 17), (n - 5, n), (n // 2, n // 2 + 21), (n, n)]:
        assert s.read(sid, lo, hi) == m.rows[lo:hi], (lo, hi)
        assert s.samplers(sid, lo, hi) == m.cells[lo:hi]
    assert s.epochs(sid, 5) == [(i, e) for i, e in enumerate(m.epochs) if i >= 5 and m.rows[i].loss_mask]
    counts: dict[int, dict[str, int]] = {}
    for t in m.rows:
        if t.loss_mask:
            d = counts.setdefault(t.version, {"generated": 0, "exact": 0, "missing": 0, "unscored": 0})
            d["generated"] += 1
            d[t.provenance or "unscored"] += 1
    assert s.version_counts() == counts
    assert s.unscored_by_version() == {v: d["unscored"] for v, d in counts.items() if d["unscored"]}
    assert all(s.unscored(v) == d["unscored"] for v, d in counts.items())


def test_every_read_gives_the_tokens_written_and_a_changed_token_is_seen():
    store = Store(":memory:")
    m = _build(store, "s", seed=1)
    _check(store, "s", m)
    # negative control: one changed log-prob, one changed id, one changed flag each break equality
    for field, value in (("logprob", -9.5), ("token_id", 12345), ("truncated", 1 - m.rows[-1].truncated)):
        other = m.rows[:-1] + [m.rows[-1]._replace(**{field: value})]
        assert store.sessions.read("s") != other, field


def test_scoring_sets_single_tokens_inside_chunks_and_the_counts_follow():
    store = Store(":memory:")
    m = _build(store, "s", seed=2)
    n, s = len(m.rows), store.sessions
    rng = random.Random(5)
    with store.tx(durable=False):
        for _ in range(12):
            lo = rng.randrange(n)
            vals = [None if rng.random() < 0.3 else -rng.random() for _ in range(rng.randrange(1, 30))][: n - lo]
            v = rng.choice([None, 1, 2, 3])
            assert s.fill_old_logprobs("s", lo, vals, "exact", version=v) == m.score(lo, vals, "exact", v)
        lo = n // 3
        want = sum(1 for t in m.rows[lo:lo + 25] if t.loss_mask and t.version == 2 and t.provenance is None)
        assert s.mark_missing("s", 2, lo, lo + 25) == want
        for i in range(lo, lo + 25):
            t = m.rows[i]
            if t.loss_mask and t.version == 2 and t.provenance is None:
                m.rows[i] = t._replace(provenance="missing")
    _check(store, "s", m)
    with store.tx(durable=False):
        left = sum(1 for t in m.rows[10:] if t.loss_mask and t.provenance is None)
        assert s.mark_missing_from("s", 10) == left
    m.rows[10:] = [t._replace(provenance="missing") if t.loss_mask and t.provenance is None else t
                   for t in m.rows[10:]]
    _check(store, "s", m)


def test_truncate_inside_a_chunk_then_append_again():
    store = Store(":memory:")
    m = _build(store, "s", seed=3)
    n = len(m.rows)
    cut = n - 3  # inside the last sampled batch
    with store.tx(durable=False):
        assert store.sessions.truncate("s", cut) == 3
    del m.rows[cut:], m.epochs[cut:], m.cells[cut:]
    _check(store, "s", m)
    rec = _records(random.Random(9), 7, [4])
    with store.tx(durable=False):
        store.sessions.append_sampled("s", cut, rec, epoch=99, cell="c9")
    m.sampled(rec, 99, "c9")
    _check(store, "s", m)


def _reference_ranges(store: Store, reqs: list[RequestRow], limit: int) -> list[tuple]:
    """`unscored_ranges` token by token, from `read` and the request rows."""
    out = []
    for r in sorted(reqs, key=lambda r: (r.created_at, r.id)):
        toks = store.sessions.read(r.session_id, r.base, r.base + r.num_generated)
        by_v: dict[int, list[int]] = {}
        for i, t in enumerate(toks):
            if t.loss_mask and t.provenance is None:
                by_v.setdefault(t.version, []).append(r.base + i)
        for v, idx in sorted(by_v.items()):
            out.append((r.id, v, min(idx), max(idx), len(idx)))
    return out[:limit]


@pytest.mark.parametrize("limit", [3, 256])
def test_the_scoring_backlog_matches_a_token_by_token_count(limit):
    """Sessions of one unscored turn (summed per session) and of several (taken chunk by chunk)."""
    store = Store(":memory:")
    rng, reqs = random.Random(4), []
    for k in range(6):
        sid = f"s{k}"
        for turn in range(1 + k % 3):
            store.sessions.append_prompt(sid, [1, 2, 3])
            base = store.sessions.length(sid)
            rid = f"r{k}-{turn}"
            rec = _records(rng, 20, [turn, turn + 1])
            req = RequestRow(rid, sid, base, 0, len(rec), {}, "c0", 1, "running", created_at=100 - k * 10 + turn)
            with store.tx(durable=False):
                store.owners.put_request(req)
                for j in range(0, 20, 5):  # a sync per 5 tokens: several chunks per request
                    store.sessions.append_sampled(sid, base + j, rec[j:j + 5], epoch=1, cell="c0")
            reqs.append(req)
    with store.tx(durable=False):
        store.sessions.fill_old_logprobs("s1", reqs[1].base, [-0.1] * 4, "exact")  # part of one turn scored
    got = [(r.request_id, r.version, r.first, r.last, r.count) for r in store.sessions.unscored_ranges(limit)]
    ref = _reference_ranges(store, reqs, 10**6)
    assert got == ref[:limit] and len(ref) == 24  # 12 requests, each unscored in 2 versions
    # negative control: scoring one more token of the oldest request changes the answer
    oldest = min(reqs, key=lambda r: r.created_at)
    with store.tx(durable=False):
        assert store.sessions.fill_old_logprobs(oldest.session_id, oldest.base + 19, [-0.2], "exact") == 1
    assert [(r.request_id, r.version, r.first, r.last, r.count) for r in store.sessions.unscored_ranges(limit)] != got


def test_a_token_id_outside_int32_is_refused_and_nothing_is_written():
    store = Store(":memory:")
    store.sessions.append_prompt("s", [1, 2])
    with pytest.raises(Invalid, match="32-bit"):
        store.sessions.append_prompt("s", [3, 1 << 31])
    assert store.sessions.read("s").token_ids == (1, 2) and store.sessions.length("s") == 2


def test_a_per_token_store_is_converted_on_open(tmp_path):
    """The former layout (one `tokens` row per token) becomes chunks at the next open, once."""
    path = tmp_path / "old.sqlite"
    Store(path).close()  # the other tables, as the former release also had them
    conn = sqlite3.connect(path)
    conn.executescript("""
      CREATE TABLE tokens(session_id TEXT NOT NULL, idx INTEGER NOT NULL, token_id INTEGER NOT NULL,
        loss_mask INTEGER NOT NULL, logprob REAL, version INTEGER, truncated INTEGER NOT NULL,
        old_logprob REAL, provenance TEXT, epoch INTEGER, cell TEXT, PRIMARY KEY(session_id, idx)) WITHOUT ROWID;
      INSERT INTO sessions(id, state, length, segment_starts, created_at) VALUES ('s', 'open', 6, '[0]', 1.0);""")
    rows = [("s", 0, 5, 0, None, None, 0, None, None, None, None), ("s", 1, 6, 0, None, None, 0, None, None, None, None),
            ("s", 2, 7, 1, -0.5, 1, 0, -0.25, "exact", 3, "c1"), ("s", 3, 8, 1, -1.5, 1, 1, None, None, 3, "c1"),
            ("s", 4, 9, 1, -2.5, 2, 0, None, "missing", 4, "c2"), ("s", 5, 10, 1, -3.5, 2, 0, None, None, 4, "c2")]
    conn.executemany("INSERT INTO tokens VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.commit()
    conn.close()
    want = [StoredToken(r[2], r[3], r[4], r[5], r[6], r[7], r[8]) for r in rows]
    for _ in range(2):  # the second open finds nothing to convert
        store = Store(path)
        assert store.sessions.read("s") == want
        assert store.sessions.epochs("s") == [(2, 3), (3, 3), (4, 4), (5, 4)]
        assert store.sessions.samplers("s", 0, 6) == [None, None, "c1", "c1", "c2", "c2"]
        assert store.sessions.unscored_by_version() == {1: 1, 2: 1}
        assert store.execute("SELECT name FROM sqlite_master WHERE name='tokens'").fetchone() is None
        store.close()


def test_the_former_move_trigger_is_replaced_on_open(tmp_path):
    """A store written before `requests_count_grow` has the former all-moves trigger: opening it
    drops that one, so a request's growth is counted once."""
    from scheduler.store import counters
    from scheduler.store.counters import _REQ_MOVES, _req_enter, _req_leave

    former = (f"CREATE TRIGGER requests_count_upd AFTER {_REQ_MOVES} BEGIN {_req_leave('OLD')} "
              f"{_req_enter('NEW')} END;")
    path = tmp_path / "s.sqlite"
    store = Store(path)
    with store.tx():
        store.owners.put_request(RequestRow("r", "s", 3, 0, 0, {}, "c1", 1, "running"))
    store.execute(former)
    store.owners.set_num_generated("r", 5)  # the control: both triggers count the growth
    assert counters.stored(store) != counters.recount(store)
    store.close()
    again = Store(path)  # recounted, and the former trigger dropped
    again.owners.set_num_generated("r", 9)
    assert counters.stored(again) == counters.recount(again) and counters.stored(again)[0]["c1"][1] == 12
    again.close()
