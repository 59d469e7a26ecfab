"""Fake cells speaking the cell protocol over HTTP (no torch), a fake clock, app fixtures."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi.testclient import TestClient

from scheduler.api.app import create_app
from scheduler.contract.config import CellflipConfig
from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig
from scheduler.contract.prefixhash import prefix_digest
from scheduler.contract.probe import PROBE_LEN
from tests.conftest import AUTH


class FakeClock:
    """Monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make_config(migration: dict | None = None, **sched) -> CellflipConfig:
    base = {"lease_s": 5.0, "heartbeat_s": 0.5, "min_rollout_cells": 1, "drain_deadline_s": 30.0}
    base.update(sched)
    return CellflipConfig(scheduler=SchedulerConfig(**base), migration=MigrationConfig(**(migration or {})))


class Harness:
    """A TestClient on an app with a fake clock and no background loop."""

    def __init__(self, db_path: str, clock: FakeClock | None = None, migration: dict | None = None, **sched) -> None:
        self.db_path = db_path
        self.clock = clock or FakeClock()
        self.app = create_app(make_config(migration, **sched), db_path=db_path, clock=self.clock, tick_interval_s=None)
        self.client = TestClient(self.app, headers=AUTH)
        self.client.__enter__()
        self.pool = ThreadPoolExecutor(4)

    @property
    def ctl(self):
        return self.app.state.controller

    def auth(self, scope: str) -> dict:
        """The Authorization header of this app's bootstrap token of `scope` (the client's own
        default is the admin token)."""
        from scheduler.contract.tokens import server_tokens

        tokens = server_tokens(self.app.state.controller.cfg.model_copy(update={"db_path": self.db_path}))
        return {"Authorization": f"Bearer {tokens[scope]}"}

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.client.portal.call(self.ctl.tick)

    def complete(self, body: dict, session: str | None = None, headers: dict | None = None) -> Future:
        """POST /v1/generate on a worker thread (it blocks until the cells finish it)."""
        return complete_async(self.client, self.pool, body, session, headers)

    def check(self) -> None:
        """The store's ownership invariants hold."""
        assert self.client.portal.call(self.ctl.check_integrity) == []

    def close(self) -> None:
        try:
            problems = self.client.portal.call(self.ctl.check_integrity)
        finally:
            # end waiting completions and let their threads read the answers before the portal stops
            self.client.portal.call(self.ctl.close)
            self.pool.shutdown(wait=True)
            self.client.__exit__(None, None, None)
        assert problems == [], problems  # every test ends with the ownership invariants holding


def open_harness(tmp_path):
    """Body of each test module's `harness` fixture: an app on a fresh SQLite file."""
    h = Harness(str(tmp_path / "sched.sqlite"))
    yield h
    h.close()


FAKE_PROBE = [-1.0 - 0.01 * i for i in range(PROBE_LEN - 1)]
"""The fake model's answer to the registration probe (any version)."""


def token_of(request_id: str, i: int) -> int:
    return (sum(map(ord, request_id)) * 31 + i * 7) % 1000


@dataclass
class Held:
    request_id: str
    epoch: int
    session_id: str
    prompt: list[int]
    tokens: list[list] = field(default_factory=list)
    max_tokens: int = 8
    synced: int = 0
    """Generated tokens the scheduler acknowledged."""
    stopped: bool = False
    parked: bool = False
    """Stopped for a migration's stop-and-copy."""
    incoming: str | None = None
    """Migration id when this copy is an import not yet committed."""


class FakeCell:
    """A cell agent in miniature: keeps requests, generates deterministic tokens, obeys commands."""

    def __init__(self, client: TestClient, cell_id: str, *, kv_export: bool = True, max_running: int = 4,
                 kv_blocks_total: int = 64, version: int | None = 0, headers: dict | None = None,
                 kv_store: str | None = None, scoring: bool = True, probe: list[float] | None = None,
                 caps: dict | None = None) -> None:
        self.client, self.cell_id = client, cell_id
        self.incarnation = uuid.uuid4().hex[:8]
        self.kv_export, self.max_running, self.kv_blocks_total = kv_export, max_running, kv_blocks_total
        self.version, self.role = version, "rollout"
        self.kv_store, self.scoring = kv_store, scoring
        self.headers = headers or {}
        self.held: dict[str, Held] = {}
        self.contexts: dict[str, list[int]] = {}
        """session → the context of its last request finished here (what a delta start extends)."""
        self.commands: list[dict] = []
        self.pending_tokens: list[dict] = []
        self.events: list[dict] = []
        self.rejected: list[str] = []
        self.migrations_out: dict[str, dict] = {}
        self.versions_held: list[int] | None = None
        """Reported weight versions in memory (None: only the served one)."""
        self.probe = probe if probe is not None else (FAKE_PROBE if scoring else None)
        self.caps = caps or {}
        """More capabilities to report (model limits: vocab_size, max_context, output_ranges)."""
        """The registration probe's answer: every honest fake cell gives the same one."""

    def register(self, expect: int = 200, **extra) -> dict:
        """`extra`: more registration fields (`model`, `job`)."""
        r = self.client.post("/internal/v1/cells/register", headers=self.headers, json={**extra,
            "cell_id": self.cell_id, "incarnation": self.incarnation, "address": f"127.0.0.1:{hash(self.cell_id) % 1000 + 9000}",
            "store_port": 29500, "capabilities": {"kv_export": self.kv_export, "scoring": self.scoring, "weight_update": "staged",
                                                  "batch_invariant": True, "block_size": 16,
                                                  "kv_store": self.kv_store, **self.caps},
            "kv_blocks_total": self.kv_blocks_total, "max_running": self.max_running, "version": self.version,
            "probe": self.probe})
        assert r.status_code == expect, r.text
        return r.json()

    def summary(self) -> dict:
        held = self.versions_held if self.versions_held is not None else [self.version]
        return {"inflight": len(self.held), "kv_blocks_used": len(self.held), "kv_blocks_total": self.kv_blocks_total,
                "version": self.version, "request_ids": sorted(self.held), "role": self.role,
                "versions_held": [v for v in held if v is not None]}

    def sync(self, expect: int = 200, wait_s: float = 0.0) -> dict:
        tokens, self.pending_tokens = self.pending_tokens, []
        events, self.events = self.events, []
        r = self.client.post(f"/internal/v1/cells/{self.cell_id}/sync", headers=self.headers, json={
            "incarnation": self.incarnation, "summary": self.summary(), "tokens": tokens, "events": events, "wait_s": wait_s})
        assert r.status_code == expect, r.text
        if r.status_code != 200:
            return r.json()
        body = r.json()
        for b in tokens:
            h = self.held.get(b["request_id"])
            if h is not None and b["request_id"] not in body["rejected"]:
                n = b["records"]["n"] if isinstance(b["records"], dict) else len(b["records"])  # packed or rows
                h.synced = max(h.synced, b["start"] + n)
                if b["finish_reason"] is not None:
                    done = self.held.pop(b["request_id"])
                    self.contexts[done.session_id] = done.prompt + [int(r[0]) for r in done.tokens]
        for rid in body["rejected"]:
            self.held.pop(rid, None)
        self.rejected += body["rejected"]
        for cmd in body["commands"]:
            self.handle(cmd)
        return body

    def handle(self, cmd: dict) -> None:
        self.commands.append(cmd)
        t = cmd["type"]
        if t == "start":
            ids = self.context_of(cmd)
            if ids is None:  # a delta start on a prefix not held here
                self.events.append({"type": "prefix_missing", "request_id": cmd["request_id"], "epoch": cmd["epoch"]})
                return
            cmd = {**cmd, "token_ids": ids}
            n, plen = cmd["num_generated"], cmd["prompt_len"]
            gen = cmd["token_ids"][plen:]
            assert len(gen) == n
            h = Held(cmd["request_id"], cmd["epoch"], cmd["session_id"], cmd["token_ids"][:plen],
                     [[tok, -0.5, self.version or 0, False] for tok in gen], cmd["params"]["max_tokens"], synced=n)
            self.held[h.request_id] = h
        elif t == "suspend" and cmd.get("park") and cmd["request_id"] in self.held:
            self.held[cmd["request_id"]].parked = True  # kept, never decoded here again
        elif t in ("abort", "suspend"):
            self.held.pop(cmd["request_id"], None)
        elif t == "set_role":
            self.role = cmd["role"]
            if cmd.get("version") is not None:
                self.version = cmd["version"]
        elif t == "migrate_out":
            self.migrations_out[cmd["migration_id"]] = cmd
        elif t == "cancel_migration":
            h = self.held.get(cmd["request_id"])
            if h is not None and h.incoming == cmd["migration_id"]:
                del self.held[cmd["request_id"]]
            elif h is not None:
                h.stopped = False

    def context_of(self, cmd: dict) -> list[int] | None:
        """A start's whole context: its token ids, after the held prefix a delta start names
        (None when this cell does not hold that prefix, by length and digest)."""
        if cmd.get("prefix_hash") is None:
            return cmd["token_ids"]
        held = self.contexts.get(cmd["session_id"])
        if held is None or len(held) != cmd["prefix_len"] or prefix_digest(held) != cmd["prefix_hash"]:
            return None
        return held + cmd["token_ids"]

    def step(self, n: int = 1) -> None:
        """Decode n tokens for every running request (queued for the next sync)."""
        for h in list(self.held.values()):
            if h.stopped or h.incoming or h.parked:
                continue
            start = len(h.tokens)
            new = []
            for _ in range(n):
                if len(h.tokens) >= h.max_tokens:
                    break
                i = len(h.tokens)
                rec = [token_of(h.request_id, i), -0.25 - 0.001 * i, self.version or 0, False]
                h.tokens.append(rec)
                new.append(rec)
            done = len(h.tokens) >= h.max_tokens
            if new or done:
                self.pending_tokens.append({"request_id": h.request_id, "epoch": h.epoch, "start": start,
                                            "records": new, "finish_reason": "length" if done else None})

    def commit(self, migration_id: str, request_id: str, epoch: int, tail_start: int, records: list, num_tokens: int):
        return self.client.post(f"/internal/v1/migrations/{migration_id}/commit", headers=self.headers, json={
            "cell_id": self.cell_id, "incarnation": self.incarnation, "request_id": request_id, "epoch": epoch,
            "num_tokens": num_tokens, "tail": {"start": tail_start, "records": records}})

    def abort_migration(self, migration_id: str, reason: str = "test"):
        return self.client.post(f"/internal/v1/migrations/{migration_id}/abort", headers=self.headers,
                                json={"cell_id": self.cell_id, "incarnation": self.incarnation, "reason": reason})


def hand_over(src: FakeCell, dst: FakeCell, migration_id: str) -> int:
    """Play the data plane of one KV migration: stop-and-copy src → dst, dst commits, resumes."""
    cmd = src.migrations_out.pop(migration_id)
    h = src.held[cmd["request_id"]]
    h.stopped = True
    copy = Held(h.request_id, h.epoch, h.session_id, h.prompt, [list(r) for r in h.tokens], h.max_tokens, h.synced)
    tail = copy.tokens[h.synced:]
    r = dst.commit(migration_id, h.request_id, h.epoch, h.synced, tail, len(copy.tokens))
    assert r.status_code == 200, r.text
    copy.epoch, copy.synced = r.json()["epoch"], len(copy.tokens)
    dst.held[copy.request_id] = copy
    del src.held[h.request_id]
    return copy.epoch


def pump(cells: list[FakeCell], until: Future | list[Future] | None = None, rounds: int = 200, tokens: int = 1,
         harness: Harness | None = None) -> None:
    """Sync + decode every cell until `until` (one future or all of a list) is done, or
    `rounds` pass."""
    if isinstance(until, list):
        futs = until

        class _All:
            def done(self) -> bool:
                return all(f.done() for f in futs)

        until = _All()
    for _ in range(rounds):
        for c in cells:
            c.sync()
            c.step(tokens)
        if harness is not None:
            harness.tick()
        if until is not None and until.done():
            return
        time.sleep(0.001)
    assert until is None, "completion did not finish"


def complete_async(client: TestClient, pool: ThreadPoolExecutor, body: dict, session: str | None = None,
                   headers: dict | None = None) -> Future:
    h = dict(headers or {})
    if session is not None:
        h["X-Session-Id"] = session
    return pool.submit(client.post, "/v1/generate", json=body, headers=h)


def until_held(cell: FakeCell, fut: Future | None = None, rounds: int = 500, count: int = 1) -> None:
    """Sync `cell` until it holds `count` requests (the completion in `fut` was admitted)."""
    for _ in range(rounds):
        cell.sync()
        if len(cell.held) >= count:
            return
        if fut is not None and fut.done():
            raise AssertionError(f"completion ended early: {fut.result(timeout=60).status_code} {fut.result(timeout=60).text}")
        time.sleep(0.002)
    raise AssertionError(f"{cell.cell_id} never got a request")


def flip_holder(harness: Harness, max_tokens: int, session: str = "m") -> tuple[FakeCell, FakeCell, Future]:
    """Cell a holds one request of `session` (2 tokens synced), cell b beside it; a is flipped to
    training, so the tick issues a KV migration a -> b (its commands are on both fakes)."""
    a = FakeCell(harness.client, "a", max_running=1)
    a.register(), a.sync()
    fut = harness.complete({"prompt_ids": [1, 2], "max_tokens": max_tokens}, session=session)
    until_held(a, fut)
    b = FakeCell(harness.client, "b")
    b.register(), b.sync()
    a.step(2), a.sync()
    assert harness.client.post("/v1/flips", json={"cell": "a", "to": "training"}).status_code == 202
    harness.tick()
    a.sync(), b.sync()
    return a, b, fut


def keep_alive(harness: Harness, cells: list[FakeCell], seconds: float, step: float = 2.0) -> None:
    """Move the fake clock by `seconds`, syncing every cell often enough to keep its lease."""
    left = seconds
    while left > 0:
        dt = min(step, left)
        harness.clock.advance(dt)
        left -= dt
        for c in cells:
            c.sync()


VERSION_SOURCE = {"host": "127.0.0.1", "port": 29999, "namespace": "versions"}
"""A version host that is never dialled: the fakes only record the loads they are told."""


def publish(harness: Harness, version: int, source: dict = VERSION_SOURCE) -> None:
    """Register `source` as the trainer's version host and publish `version` from it."""
    harness.client.put("/v1/trainer/version-host", json={"host": source["host"], "port": source["port"]})
    assert harness.client.post("/v1/versions", json={"version": version, "source": source}).status_code == 201


def fetches(cell: FakeCell) -> list[int]:
    """The versions `cell` was told to fetch, in order."""
    return [c["version"] for c in cell.commands if c["type"] == "load_version" and c["mode"] == "fetch"]


def registered(harness: Harness, n: int, prefix: str = "c") -> list[FakeCell]:
    """`n` fake cells `<prefix>0`… registered and synced once."""
    cells = [FakeCell(harness.client, f"{prefix}{i}") for i in range(n)]
    for c in cells:
        c.register()
        c.sync()
    return cells
