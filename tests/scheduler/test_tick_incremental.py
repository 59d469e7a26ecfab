"""The control loop's tick works on what changed since the last one; each structure it keeps by
change must act as a full recomputation would. Two controllers over two identical stores see the
same fleet changes tick after tick; one works incrementally (as shipped), the other is made to
recompute from scratch each tick; what they send the cells and what they keep must agree. A
negative control breaks the incremental one and the comparison must catch it."""

from __future__ import annotations

import json
import random

from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig
from scheduler.contract.protocol import Summary
from scheduler.control.controller import Controller
from scheduler.control.snapshot import CellSummaries
from scheduler.store import Store

CELLS = 60
HOST = {"host": "trainer", "port": 29500}
CAPS = json.dumps({"kv_export": True, "block_size": 16})


class Fleet:
    """A controller over a store of `CELLS` cells, moved by a seeded script."""

    def __init__(self, path: str, full: bool) -> None:
        self.store = Store(path)
        self.full = full
        self.ids = [f"cell-{i:03d}" for i in range(CELLS)]
        with self.store.tx():
            self.store.executemany(
                "INSERT INTO cells(id, incarnation, state, generation, version, address, store_port, capabilities, "
                "kv_blocks_total, kv_blocks_used, max_running, history, trust) "
                "VALUES (?,?,?,1,0,?,1,?,4096,0,8,'[]','verified')",
                [(c, f"inc-{c}", "training" if i < 6 else "rollout", f"node{i // 8}:{20000 + i}", CAPS)
                 for i, c in enumerate(self.ids)])
            self.store.execute("INSERT INTO versions(v, state, created_at, history, source) "
                               "VALUES (0, 'active', 0, '[]', ?)", (json.dumps(HOST),))
        cfg = SchedulerConfig(db_path=path, min_rollout_cells=1, lease_s=1e9, stall_timeout_s=1e9, auto_flip=False)
        self.ctl = Controller(self.store, cfg, MigrationConfig(path="reprefill"))
        self.ctl.register_version_host(HOST["host"], HOST["port"])
        self.version = dict.fromkeys(self.ids, 0)
        self.loading: dict[str, list[int]] = {c: [] for c in self.ids}
        self.blocks = dict.fromkeys(self.ids, 0)
        for c in self.ids:
            self.sync(c)

    def sync(self, c: str) -> None:
        state = self.store.fleet.cell_states([c]).get(c, "rollout")
        self.ctl.ctx.registry.renew(c, 1e9, Summary(
            kv_blocks_used=self.blocks[c], kv_blocks_total=4096, version=self.version[c], role=state,
            versions_held=[self.version[c]], max_running=8, block_size=16, loading=list(self.loading[c])))

    def tick(self) -> dict[str, list[tuple]]:
        if self.full:
            self.ctl.versions._caught_up = None  # the reference: catch_up visits every cell
            self.ctl.versions._told = None  # (none left out as told by a publish)
        self.ctl.tick()
        out = {}
        for c in self.ids:
            cmds = self.ctl.ctx.registry.take(c)
            if cmds:
                out[c] = [(type(m).__name__, getattr(m, "version", None)) for m in cmds]
        return out


def script(rng: random.Random, fleets: list[Fleet], step: int, last: list[str]) -> list[str]:
    """One tick's changes, the same to every fleet: KV-only syncs, versions loaded or being
    loaded, a state written by hand, a publish now and then."""
    ids = [c for c in fleets[0].ids if c in fleets[0].ctl.ctx.registry.live]
    if step in (15, 25):  # a cell goes down: every kept structure lets it go
        for f in fleets:
            f.ctl.membership.fence(ids[30 + step], "gone")
        ids = [c for c in ids if c != ids[30 + step]]
    if step % 7 == 3:
        for f in fleets:
            f.ctl.publish_version(step, HOST)
    kv = rng.sample(ids, 40 if step % 3 == 0 else 10)  # more than half: the store reads the whole table
    loaded = rng.sample(ids, 5)
    loading = rng.sample(ids, 4)
    flipped = rng.sample([c for c in ids if c >= "cell-006"], 2)
    failed = last[: len(last) // 2]  # fetches that ended without the version: seen with a KV change
    for f in fleets:
        target = f.ctl.versions.target()
        for c in kv:
            f.blocks[c] += 1
        for c in loaded:
            f.version[c], f.loading[c] = (target.v if target else 0), []
        for c in loading:
            f.loading[c] = [target.v] if target else []
        for c in failed:
            f.loading[c] = []
            f.blocks[c] += 1
        with f.store.tx():
            for c in flipped:
                state = f.store.fleet.cell_states([c])[c]
                f.store.execute("UPDATE cells SET state=? WHERE id=?",
                                ("training" if state == "rollout" else "rollout", c))
        for c in set(kv) | set(loaded) | set(loading) | set(flipped) | set(failed):
            f.sync(c)
    return loading


def kept_differs(ctl: Controller) -> list[str]:
    """What `ctl` keeps by change against the same read from scratch: the planning rows, the
    planner's cell summaries and its placement index, the fleet's tally."""
    out = []
    fleet = ctl.store.fleet
    if sorted(fleet.planning_rows()) != sorted(fleet._read_planning(None)):
        out.append("planning rows")
    fresh = CellSummaries(ctl.ctx)
    if ctl.cell_summaries.current(None, set()) != fresh.current(None, set()):
        out.append("cell summaries")
    if ctl.cell_summaries.placement.cells != list(fresh.current(None, set())):
        out.append("placement index")
    tally = ctl.loop.tally
    tally.advance(ctl.ctx.clock())
    rows = {r.cell_id: r for r in fleet._read_planning(None)}
    live = ctl.ctx.registry.live
    rollout = {c for c, r in rows.items() if r.state == "rollout" and c in live}
    offered = sum(rows[c].max_running for c in rollout)
    occupied = sum(min(rows[c].max_running, rows[c].live) for c in rollout)
    if (tally.offered, tally.occupied, tally.rollout) != (offered, occupied, rollout):
        out.append("tally")
    return out


def run(tmp_path, break_incremental: bool = False, break_summaries: bool = False) -> list[str]:
    """Tick both fleets through the script; returns the ticks where they differ."""
    inc, ref = Fleet(str(tmp_path / "inc.sqlite"), False), Fleet(str(tmp_path / "ref.sqlite"), True)
    if break_incremental:
        inc.ctl.versions.served.dirty = _Deaf()
    if break_summaries:
        inc.ctl.cell_summaries.looks.watched = set()  # the registry's marks go to a set no one reads
    rng, diffs, loading = random.Random(7), [], []
    try:
        for step in range(40):
            loading = script(rng, [inc, ref], step, loading)
            a, b = inc.tick(), ref.tick()
            if a != b:
                diffs.append(f"tick {step}: {sorted(set(a) ^ set(b))[:5]}")
            served_a, served_b = inc.ctl.versions.served, ref.ctl.versions.served
            if served_a.cells != served_b.cells:
                diffs.append(f"tick {step}: served versions differ")
            diffs += [f"tick {step}: {what} differ from a full read" for what in kept_differs(inc.ctl)]
    finally:
        inc.store.close()
        ref.store.close()
    return diffs


class _Deaf(set):
    """A `dirty` set that forgets what it is told (the negative control)."""

    def __ior__(self, other):  # noqa: D105
        return self

    def add(self, item) -> None:  # noqa: D102
        return None


def test_catch_up_by_change_sends_what_a_full_visit_sends(tmp_path):
    assert run(tmp_path) == []


def test_negative_control_a_catch_up_that_misses_changes_is_caught(tmp_path):
    assert run(tmp_path, break_incremental=True) != []


def test_negative_control_summaries_that_miss_changes_are_caught(tmp_path):
    diffs = run(tmp_path, break_summaries=True)
    assert any("cell summaries" in d for d in diffs)


def _commits(store: Store) -> list[int]:
    """Counts the outermost transactions the store opens from now on."""
    n, tx = [0], store.tx

    def counted(durable: bool = True):
        if not store._depth:
            n[0] += 1
        return tx(durable)

    store.tx = counted  # type: ignore[method-assign]
    return n


def test_flips_step_together_in_one_commit_and_one_by_one_when_one_raises(tmp_path):
    f = Fleet(str(tmp_path / "f.sqlite"), False)
    try:
        cells = f.ids[10:14]
        for c in cells:
            f.ctl.flips.create("training", c, None, None)
        n = _commits(f.store)
        f.ctl.flips.step()
        assert n[0] == 1  # four flips stepped, one commit
        states = {r.cell_id: r.state for r in f.store.fleet.list_flips(active_only=True)}
        assert set(states) == set(cells) and "pending" not in states.values()
        for c in f.ids[20:24]:
            f.ctl.flips.create("training", c, None, None)
        advance, bad = f.ctl.flips._advance, f.ids[22]

        def failing(fx, flip, leaving):
            if flip.cell_id == bad:
                raise RuntimeError("a flip whose step raises")
            advance(fx, flip, leaving)

        f.ctl.flips._advance = failing
        try:
            f.ctl.flips.step()
        except RuntimeError:
            pass
        else:
            raise AssertionError("the failing step must raise")
        states = {r.cell_id: r.state for r in f.store.fleet.list_flips(active_only=True)}
        # one by one after the shared transaction rolled back: those before the bad one moved on
        assert [states[c] for c in f.ids[20:24]] == ["draining", "draining", "pending", "pending"]
    finally:
        f.store.close()
