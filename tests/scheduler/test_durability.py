"""The running loop's commits become durable off its thread (scheduler/control/durability.py):
no cell hears of a tick's change before the WAL holding it is synced, effects run in commit
order whoever commits after, and a failed sync releases nothing."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from sched_fakes import FakeCell, Harness, pump, until_held

from scheduler.control import durability


def _fleet(tmp_path) -> tuple[Harness, list[FakeCell], list]:
    """c0 holds two requests, c1 has room for them."""
    h = Harness(str(tmp_path / "s.sqlite"), migration={"path": "reprefill"})
    c0 = FakeCell(h.client, "c0", max_running=8)
    c0.register(), c0.sync()
    futs = [h.complete({"prompt_ids": [i, i + 1], "max_tokens": 4}, session=f"s{i}") for i in range(2)]
    until_held(c0, count=2)
    c0.step(1), c0.sync()
    c1 = FakeCell(h.client, "c1", max_running=8)
    c1.register(), c1.sync()
    return h, [c0, c1], futs


def _owned_by(h: Harness, cell: str) -> int:
    q = "SELECT COUNT(*) FROM requests WHERE cell_id=? AND state='running'"
    return h.ctl.store.execute(q, (cell,)).fetchone()[0]


def _synced_paths(monkeypatch, gate: threading.Event | None = None) -> list[str]:
    """Every path the tail fsyncs, recorded (after `gate` opens, if given)."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        if gate is not None:
            assert gate.wait(30)
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(durability.os, "fsync", fsync)
    return seen


def test_a_deferred_tick_tells_the_cells_only_once_the_wal_is_synced(tmp_path, monkeypatch):
    h, cells, futs = _fleet(tmp_path)
    gate = threading.Event()
    synced = _synced_paths(monkeypatch, gate)
    registry = h.ctl.ctx.registry
    try:
        h.client.post("/v1/flips", json={"cell": "c0", "to": "training"})
        h.client.portal.call(lambda: h.ctl.tick(defer_sync=True))
        assert _owned_by(h, "c1") == 2  # the moves are committed: the store has them
        time.sleep(0.2)
        assert not registry.has_commands("c1")  # but c1 is not told before the disk has them
        gate.set()
        deadline = time.monotonic() + 30
        while not registry.has_commands("c1") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert registry.has_commands("c1")  # released on the loop's thread once the sync returned
        assert synced and synced[0] == os.path.realpath(f"{h.db_path}-wal")
        pump(cells, rounds=200, harness=h, until=futs)
        for fut in futs:
            assert len(fut.result(timeout=60).json()["token_ids"]) == 4
        h.check()
    finally:
        gate.set()
        h.close()


def test_a_tick_that_does_not_defer_tells_the_cells_at_once(tmp_path, monkeypatch):
    """Negative control of the above: the tick as tests and tools call it syncs itself."""
    h, _, _ = _fleet(tmp_path)
    synced = _synced_paths(monkeypatch)
    try:
        h.client.post("/v1/flips", json={"cell": "c0", "to": "training"})
        h.tick()
        assert _owned_by(h, "c1") == 2 and h.ctl.ctx.registry.has_commands("c1")
        assert synced == []  # SQLite's own sync at commit, not the tail's
    finally:
        h.close()


def test_effects_run_in_commit_order_whoever_commits_next(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    ctx, ran = h.ctl.ctx, []
    try:
        with ctx.tail.deferred():
            with ctx.txn() as fx:
                fx.later(lambda: ran.append("tick"))
        assert ran == []  # held: not synced yet
        with ctx.txn(durable=False) as fx:  # a token sync's commit: ordered behind it
            fx.later(lambda: ran.append("sync"))
        assert ran == []
        with ctx.txn() as fx:  # a durable commit: its own sync covered both before it
            fx.later(lambda: ran.append("api"))
        assert ran == ["tick", "sync", "api"]
        with ctx.txn() as fx:  # nothing held: at once (the negative control)
            fx.later(lambda: ran.append("later"))
        assert ran[-1] == "later"
    finally:
        h.close()


def test_a_rolled_back_deferred_commit_tells_nobody(tmp_path):
    h = Harness(str(tmp_path / "s.sqlite"))
    ctx, ran = h.ctl.ctx, []
    try:
        with pytest.raises(RuntimeError), ctx.tail.deferred(), ctx.txn() as fx:
            fx.later(lambda: ran.append("undone"))
            raise RuntimeError("a step failed")
        ctx.tail.settle()
        assert ran == [] and not ctx.tail.held
    finally:
        h.close()


def test_a_failed_sync_releases_nothing_and_the_next_one_does(tmp_path, monkeypatch):
    h = Harness(str(tmp_path / "s.sqlite"))
    ctx, ran, calls = h.ctl.ctx, [], []
    real = os.fsync

    def flaky(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(durability.os, "fsync", flaky)

    async def main() -> None:
        with ctx.tail.deferred(), ctx.txn() as fx:
            fx.later(lambda: ran.append("moved"))
        ctx.tail.sync_soon()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if ctx.tail._sync is None:
                break
        assert calls and ran == []  # the sync failed: nobody hears of the commit
        ctx.tail.sync_soon()  # the loop's next tick tries again
        for _ in range(200):
            await asyncio.sleep(0.01)
            if ran:
                break
        assert ran == ["moved"] and len(calls) == 2

    try:
        asyncio.run(main())
    finally:
        h.close()
