"""Group commit of token batches (scheduler/control/groupcommit.py): syncs that arrive together
share one transaction, each is answered only once it is committed (a second connection to the
file sees its tokens by then, and not before), a part that raises is undone alone and its
effects never run."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig, VersionsConfig
from scheduler.control.context import Context
from scheduler.control.groupcommit import GroupCommit
from scheduler.control.metrics import Metrics
from scheduler.store import Store


@pytest.fixture
def ctx(tmp_path):
    store = Store(tmp_path / "s.sqlite")
    yield Context(store, SchedulerConfig(), MigrationConfig(), VersionsConfig(), Metrics())
    store.close()


def _lengths(path: str) -> dict[str, int]:
    """What another connection to the file sees: committed rows only."""
    with sqlite3.connect(path) as other:
        return dict(other.execute("SELECT id, length FROM sessions").fetchall())


class Recorder:
    """A stand-in for `Ingest.accept_tokens`: writes one session per sync (through the store),
    records its effects; raises for the cells in `fail`."""

    def __init__(self, ctx: Context, fail: set[str] = frozenset()) -> None:
        self.ctx, self.fail, self.effects, self.seen = ctx, fail, [], []

    def __call__(self, fx, cell_id, batches):
        self.seen.append(_lengths(self.ctx.store.path))  # nothing of this commit is visible yet
        self.ctx.store.sessions.append_prompt(f"s-{cell_id}", list(batches))
        fx.later(lambda: self.effects.append(cell_id))
        if cell_id in self.fail:
            raise RuntimeError(f"part of {cell_id} failed")
        return [cell_id], [], [], None


def test_syncs_that_arrive_together_share_one_commit_and_answer_after_it(ctx):
    rec = Recorder(ctx)
    group = GroupCommit(ctx, rec)

    async def go():
        async def one(c: str):
            out = await group.submit(c, [1, 2, 3])
            return out, _lengths(ctx.store.path)  # what is committed when the answer comes
        return await asyncio.gather(*(one(f"c{k}") for k in range(5)))

    answers = asyncio.run(go())
    assert (group.commits, group.syncs) == (1, 5)
    assert rec.seen == [{}] * 5  # no part was visible to another connection before the commit
    for k, (out, committed) in enumerate(answers):
        assert out[0] == [f"c{k}"]
        assert committed == {f"s-c{j}": 3 for j in range(5)}  # the whole commit, before any answer
    assert rec.effects == [f"c{k}" for k in range(5)]  # in arrival order, after the commit
    text = ctx.metrics.render().decode()
    assert "cellflip_ingest_commits_total 1.0" in text and "cellflip_ingest_syncs_total 5.0" in text


def test_control_syncs_one_after_another_commit_one_by_one(ctx):
    rec = Recorder(ctx)
    group = GroupCommit(ctx, rec)

    async def go():
        for k in range(3):
            await group.submit(f"c{k}", [1])

    asyncio.run(go())
    assert (group.commits, group.syncs) == (3, 3)
    assert rec.seen == [{}, {"s-c0": 1}, {"s-c0": 1, "s-c1": 1}]


def test_a_part_that_raises_is_undone_alone(ctx):
    rec = Recorder(ctx, fail={"c1"})
    group = GroupCommit(ctx, rec)

    async def go():
        return await asyncio.gather(*(group.submit(f"c{k}", [7, 8]) for k in range(3)), return_exceptions=True)

    a, b, c = asyncio.run(go())
    assert isinstance(b, RuntimeError) and "c1" in str(b)
    assert a[0] == ["c0"] and c[0] == ["c2"]
    assert _lengths(ctx.store.path) == {"s-c0": 2, "s-c2": 2}  # c1's session was undone, the others stay
    assert rec.effects == ["c0", "c2"]  # the undone part's effects never ran
    assert group.commits == 1


def test_a_transaction_takes_at_most_max_syncs(ctx):
    group = GroupCommit(ctx, Recorder(ctx), max_syncs=2)

    async def go():
        return await asyncio.gather(*(group.submit(f"c{k}", [1]) for k in range(5)))

    assert len(asyncio.run(go())) == 5
    assert (group.commits, group.syncs) == (3, 5)
    assert _lengths(ctx.store.path) == {f"s-c{k}": 1 for k in range(5)}


def test_savepoints_journal_in_memory(ctx, tmp_path):
    """A group commit's savepoints (and multi-row writes' statement journals) are kept in memory
    (`temp_store=MEMORY`): on temp files they cost a sync ~0.15 ms. The control: a plain
    connection to the same file keeps the default (0: the compile-time choice, files here)."""
    assert ctx.store.execute("PRAGMA temp_store").fetchone()[0] == 2
    with sqlite3.connect(tmp_path / "s.sqlite") as plain:
        assert plain.execute("PRAGMA temp_store").fetchone()[0] == 0


def test_a_lone_sync_that_raises_leaves_nothing(ctx):
    """A lone sync runs without a savepoint: its error undoes the whole (its own) transaction."""
    rec = Recorder(ctx, fail={"c0"})
    group = GroupCommit(ctx, rec)

    async def go():
        await group.submit("c0", [1])

    with pytest.raises(RuntimeError, match="c0"):
        asyncio.run(go())
    assert _lengths(ctx.store.path) == {} and rec.effects == [] and group.commits == 0
    rec.fail = set()  # the control: the same sync without the error lands
    asyncio.run(go())
    assert _lengths(ctx.store.path) == {"s-c0": 1} and rec.effects == ["c0"]
