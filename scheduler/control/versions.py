"""Weight versions: broadcasting → active → retiring → retired.

The trainer puts version v in its version host (host memory) and publishes it with the host's
address (`source`); every live rollout cell is told to join the trainer's broadcast of it
(`load_version`, mode "broadcast"), and the answer names them (`receivers`) so the trainer
knows whom to wait for. v becomes active once every live rollout cell reports serving it
(older active versions then start retiring). A cell that missed the broadcast (failed, late,
or entering rollout from training) is told to fetch it point-to-point. A freshly registered
cell whose version is not `servable` (its initial weights, or one older than the staleness
bound allows) stays `loading`, with no request placed on it, until its fetch completes. A version is retired
(on request, or automatically) only when no live cell serves it and every token sampled under
it has an old log-prob (exact, or counted as missing) — otherwise 409, so a version is never
dropped while the log-prob service still needs it.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict, Invalid, NotFound
from scheduler.contract.protocol import LoadVersionCmd
from scheduler.contract.states import VERSION, set_state
from scheduler.control import idempotency, jobsettings
from scheduler.control.jobversions import JobLineages
from scheduler.control.staleness import versions_behind
from scheduler.store.fleet import VersionRow

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.scoring import Scoring
    from scheduler.control.served import ServedVersions

IDEMPOTENCY_SCOPE = "versions"

_CATCHING_UP = frozenset(("rollout", "draining", "loading"))
"""Cell states `catch_up` tells to load the target."""
_NEVER, _FOREVER = float("-inf"), float("inf")

VERSION_HOST = "trainer.version_host"


def host_key(job: str) -> str:
    """The setting holding `job`'s trainer's version host (each RL job has its own trainer)."""
    return VERSION_HOST if job == "default" else f"{VERSION_HOST}.{job}"


def version_host(store: Any, job: str) -> dict | None:
    """`job`'s trainer's registered version host, else the fleet's (`default`'s) where the job's
    trainer registered none."""
    return store.fleet.setting(host_key(job)) or store.fleet.setting(VERSION_HOST)


def training_host(store: Any, cell_id: str) -> dict | None:
    """The trainer's store a cell flipping to training is sent to: its job's, or, for the drain of
    a move between jobs, the job it moves to (the cell then fetches that job's version through the
    store it is connected to)."""
    moving = [m for m in store.jobs.list_moves(active_only=True) if m.cell_id == cell_id]
    return version_host(store, moving[-1].to_job if moving else store.jobs.job_of("cell", cell_id))
"""Settings key of the trainer's registered version host (the address cells may fetch from)."""


class Versions:
    """Weight versions and who was told to load which. Owns `version_sent`."""

    def __init__(self, ctx: Context, scoring: Scoring) -> None:
        self.ctx = ctx
        self.scoring = scoring
        self.version_sent: dict[tuple[str, int], float] = {}
        """(cell, version) → when the cell was told to load the version (by broadcast or fetch)."""
        self.served: ServedVersions = scoring.served
        """Which live cell serves which version, kept by change (scheduler/control/served.py)."""
        self._caught_up: int | None = None
        """The target version `catch_up` last visited every cell for."""
        self._recheck: list[tuple[float, str]] = []
        """Heap of (when, cell): a cell told to load (or loading) the target, looked at again then."""
        self._due: dict[str, float] = {}
        """cell → its one live entry in `_recheck` (the others are stale)."""
        self._told: tuple[int, float, set[str]] | None = None
        """(version, when, cells) of the last publish's broadcast, until `catch_up` first visits
        that version: the cells told then need no visit of their own."""
        self.lineages = JobLineages(ctx)
        """Each RL job's own lineage, on a fleet shared by several (scheduler/control/jobversions.py)."""

    # ------------------------------------------------------------------ reads
    def current(self) -> int | None:
        """The newest active version (what a loading cell must serve)."""
        active = [v.v for v in self.ctx.store.fleet.list_versions() if v.state == "active"]
        return max(active) if active else None

    def served_by(self, cell_id: str) -> int | None:
        """The weight version a cell serves, as last reported (else as registered)."""
        summary = self.ctx.registry.summary(cell_id)
        if summary is not None:
            return summary.version
        cell = self.ctx.store.fleet.get_cell(cell_id)
        return cell.version if cell else None

    def serving(self) -> dict[int, list[str]]:
        """version → live cells serving it (as last reported)."""
        return self.served.serving()

    def servable(self, version: int | None, cell_id: str | None = None) -> bool:
        """May a cell serve rollouts at `version`? Yes when nothing is published yet to fetch,
        when it is the target, or when it is a published, unretired version no more than
        `staleness_bound` published versions behind the newest (scheduler/control/staleness.py);
        of the cell's own RL job's lineage, within its bound, on a fleet shared by several."""
        job = self.lineages.job_of_cell(cell_id) if cell_id is not None and self.lineages.multi() else None
        t = self.target(job)
        if t is None or version == t.v:
            return True
        rows = self.ctx.store.fleet.list_versions()
        if job is not None:
            rows = self.lineages.lineage(rows, job)
        row = next((r for r in rows if r.v == version), None)
        if row is None or row.state == "retired":
            return False  # e.g. a fresh cell's initial weights, which no trainer published
        bound = self.ctx.cfg.staleness_bound if job is None else jobsettings.staleness_bound(
            self.ctx.cfg, self.ctx.store.jobs.get(job))  # the cell's job's own
        return versions_behind(sorted(r.v for r in rows), row.v) <= bound

    def target(self, job: str | None = None) -> VersionRow | None:
        """The version rollout cells should serve: the newest broadcasting or active one that
        cells can fetch (has a source); with `job`, on a fleet shared by several, that job's."""
        if job is not None and self.lineages.multi():
            return self.lineages.target(self.ctx.store.fleet.list_versions(), job)
        rows = [r for r in self.ctx.store.fleet.list_versions() if r.state in ("broadcasting", "active") and r.source]
        return max(rows, key=lambda r: r.v) if rows else None

    def _rollout_cells(self, states: tuple[str, ...] = ("rollout", "draining")) -> list[str]:
        out = []
        for c in self.ctx.store.fleet.list_cells():
            e = self.ctx.registry.live.get(c.id)
            if c.state in states and e is not None and e.seen:
                out.append(c.id)
        return out

    # ------------------------------------------------------------------ the trainer's side
    def register_host(self, host: str, port: int, job: str = "default") -> dict[str, Any]:
        """The trainer's version host: the one address besides the live cells' that a publish
        may name as its source (cells never connect to an address the scheduler did not vouch for);
        `job`'s own (the registering trainer's), which its training cells are sent to."""
        with self.ctx.txn(durable=True):
            self.ctx.store.fleet.put_setting(host_key(job), {"host": host, "port": port})
        return {"host": host, "port": port}

    def _check_vouched(self, source: dict, job: str = "default") -> None:
        """A source must be the job's registered version host or a live cell's transfer endpoint."""
        where = (source.get("host"), source.get("port"))
        host = version_host(self.ctx.store, job)
        if host is not None and where == (host["host"], host["port"]):
            return
        for c in self.ctx.store.fleet.list_cells():
            if c.state != "down" and c.id in self.ctx.registry.live and where == (
                    c.address.rpartition(":")[0], c.store_port):
                return
        raise Invalid(f"source {where[0]}:{where[1]} is neither the trainer's registered version host "
                      "(PUT /v1/trainer/version-host) nor a live cell: cells are never sent to an address "
                      "the scheduler cannot vouch for", code="source_not_vouched")

    def publish(self, version: int, source: dict | None = None, idempotency_key: str | None = None,
                job: str = "default") -> dict[str, Any]:
        """Record `version` as broadcasting and tell the rollout cells to join its broadcast.
        Under an Idempotency-Key a replay (a trainer that lost the answer) gets the first answer.
        `job`: the RL job whose lineage it extends (its rollout cells only are told)."""
        ctx = self.ctx
        fp = idempotency.fingerprint([version, source])
        hit = idempotency.replay(ctx.store, IDEMPOTENCY_SCOPE, idempotency_key, fp)
        if hit is not None:
            return hit
        now = ctx.clock()
        if source is not None:
            self._check_vouched(source, job)
        with ctx.txn(durable=True) as fx:
            rows = ctx.store.fleet.list_versions()
            if any(r.v == version for r in rows):
                raise Conflict(f"version {version} exists", code="version_exists")
            multi = job != "default" or self.lineages.multi()
            ctx.store.jobs.assign_new("version", version, job)
            lineage = [r.v for r in (self.lineages.lineage(rows, job) if multi else rows) if not _abandoned(r)]
            newest = max(lineage) if lineage else None
            if newest is not None and version < newest:
                raise Conflict(f"version {version} is older than {newest}", code="version_not_newer")
            step = ctx.ver_cfg.max_version_step
            if newest is not None and version > newest + step:
                raise Invalid(f"version {version} is more than versions.max_version_step ({step}) above the "
                              f"newest, {newest}", code="version_jump")
            row = VersionRow(version, "broadcasting", time.time(), [("broadcasting", time.time(), "published")],
                             source=source)
            ctx.store.fleet.put_version(row)
            receivers = self._rollout_cells() if source else []
            if multi:
                receivers = self.lineages.rollout_cells(receivers, job)
            policy = ctx.ver_cfg.inflight_policy
            for cell_id in receivers:
                self.version_sent[(cell_id, version)] = now
                fx.send(cell_id, lambda i: LoadVersionCmd(i, version, source, "broadcast", True, policy))
            ranks = {c.id: int(c.capabilities.get("update_ranks") or 0) for c in ctx.store.fleet.list_cells()
                     if c.id in receivers}
            answer = {**self._to_api(row, {}, self.serving()), "receivers": receivers, "receiver_ranks": ranks}
            idempotency.record(ctx.store, IDEMPOTENCY_SCOPE, idempotency_key, fp, answer)
        if receivers and not multi:  # each looked at again when its load would time out
            self._told = (version, now, set(receivers))
            self._look_again([(now + ctx.ver_cfg.load_timeout_s, c) for c in receivers])
        ctx.kick()
        return answer

    def retire(self, version: int) -> dict[str, Any]:
        store = self.ctx.store
        with self.ctx.txn(durable=True):
            row = store.fleet.get_version(version)
            if row is None:
                raise NotFound(f"unknown version {version}")
            if row.state != "retired":
                VERSION.check(row.state, "retired")
                cells = self.serving().get(version, [])
                if cells:
                    raise Conflict(f"version {version} is still served by {sorted(cells)}", code="version_in_use")
                unscored = store.sessions.unscored(version)
                if unscored:
                    raise Conflict(f"{unscored} tokens of version {version} have no old log-prob yet",
                                   code="unscored_tokens")
                set_state(VERSION, row, "retired", "retired on request")
                store.fleet.put_version(row)
        return self._to_api(row, store.sessions.version_counts(), self.serving())

    def list_all(self) -> list[dict[str, Any]]:
        counts, cells = self.ctx.store.sessions.version_counts(), self.serving()
        return [self._to_api(r, counts, cells) for r in self.ctx.store.fleet.list_versions()]

    def _to_api(self, row: VersionRow, counts: dict, cells: dict) -> dict[str, Any]:
        c = counts.get(row.v, {})
        passes = self.scoring.final_pass_s.get(row.v, [])
        when = {h[0]: h[1] for h in row.history}
        lifetime = when["retiring"] - when["active"] if "active" in when and "retiring" in when else None
        return {
            "version": row.v, "state": row.state, "cells": sorted(cells.get(row.v, [])),
            "tokens_generated": c.get("generated", 0), "tokens_scored": c.get("exact", 0),
            "tokens_missing": c.get("missing", 0), "tokens_unscored": c.get("unscored", 0),
            "source": row.source, "lifetime_s": lifetime,
            "final_pass_s": sum(passes) / len(passes) if passes else None, "final_passes": len(passes),
            "history": [list(h) for h in row.history],
        }

    # ------------------------------------------------------------------ the loop's side
    def catch_up(self) -> None:
        """Active: tell every rollout (or loading) cell that serves neither the target version
        nor is receiving it to fetch it point-to-point; again after `load_timeout_s` if still not.
        Visits every cell once per new target, then only the cells that changed since the last
        tick (`ServedVersions.dirty`) and those whose load timeout came due. On a fleet shared
        by several RL jobs, each cell its own job's target (scheduler/control/jobversions.py)."""
        if self.lineages.multi():
            self.lineages.catch_up(self)
            self._caught_up = None
            return
        t = self.target()
        if t is None:
            return
        ctx, served = self.ctx, self.served
        now = ctx.clock()
        served.refresh()
        if t.v != self._caught_up:
            self._caught_up, todo = t.v, self._first_visit(t.v, now)
        else:
            todo = set(served.dirty)
        served.dirty.clear()
        while self._recheck and self._recheck[0][0] <= now:
            when, cid = heapq.heappop(self._recheck)
            if self._due.get(cid) == when:
                del self._due[cid]
                todo.add(cid)
        timeout = ctx.ver_cfg.load_timeout_s
        v, source, policy = t.v, t.source, ctx.ver_cfg.inflight_policy
        cells, live, sent_at = served.cells, ctx.registry.live, self.version_sent
        later: list[tuple[float, str]] = []
        """(when, cell) to look at again; pushed at once (after a publish: every receiver)."""
        for cell_id in sorted(todo):
            kept = cells.get(cell_id)
            if kept is None or kept[0] not in _CATCHING_UP or not kept[2]:
                continue
            s = live[cell_id].summary
            if s is None or s.version == v:
                continue
            sent = sent_at.get((cell_id, v), _NEVER)
            if now - sent < timeout or v in s.loading:
                later.append((max(now, sent) + timeout, cell_id))
                continue
            sent_at[(cell_id, v)] = now
            later.append((now + timeout, cell_id))
            ctx.registry.send(cell_id, lambda i: LoadVersionCmd(i, v, source, "fetch", True, policy))
        self._look_again(later)

    def _first_visit(self, v: int, now: float) -> set[str]:
        """The cells to visit for a new target `v`: every cell but those its publish told moments
        ago (within the load timeout; a cell that registered anew since is visited). Each of
        those was set then to be looked at again when its load times out, which is all this
        visit would do with it (it is told nothing before): a publish's tick does not walk the
        fleet."""
        told, self._told = self._told, None
        cells = self.served.cells
        if told is None or told[0] != v or now - told[1] >= self.ctx.ver_cfg.load_timeout_s:
            return set(cells)
        return cells.keys() - told[2]

    def _look_again(self, entries: list[tuple[float, str]]) -> None:
        """Each (when, cell): look at the cell again then, unless it is due sooner already.
        Many at once join the heap in one O(heap) pass instead of one push each."""
        due, heap = self._due, self._recheck
        new = []
        for when, cell_id in entries:
            if due.get(cell_id, _FOREVER) > when:
                due[cell_id] = when
                new.append((when, cell_id))
        if len(new) > 64 and len(new) * 4 > len(heap):
            heap += new
            heapq.heapify(heap)
        else:
            for e in new:
                heapq.heappush(heap, e)

    def progress(self) -> None:
        """Passive: activate broadcast versions that every live rollout cell serves (of the
        version's RL job, on a fleet shared by several)."""
        if self.lineages.multi():
            self.lineages.progress(self)
            return
        ctx = self.ctx
        rows = ctx.store.fleet.list_versions()
        pending = [r for r in rows if r.state == "broadcasting"]
        for row in sorted(pending, key=lambda r: r.v):
            if not self.served.all_rollout_serve(row.v):
                continue
            with ctx.txn(durable=True):
                set_state(VERSION, row, "active", "every rollout cell serves it")
                ctx.store.fleet.put_version(row)
                for old in rows:
                    if old.v < row.v and old.state == "active":
                        set_state(VERSION, old, "retiring", f"version {row.v} active")
                        ctx.store.fleet.put_version(old)

    def auto_retire(self) -> None:
        """Retire superseded versions that no cell serves and whose tokens are all scored."""
        ctx = self.ctx
        if not ctx.ver_cfg.auto_retire:
            return
        rows = [r for r in ctx.store.fleet.list_versions() if r.state == "retiring"]
        if not rows:
            return
        backlog = ctx.store.sessions.unscored_by_version()
        for row in rows:
            if self.served.serves_any(row.v) or backlog.get(row.v, 0):
                continue
            with ctx.txn(durable=True):
                set_state(VERSION, row, "retired", "no cell serves it; every token has an old log-prob")
                ctx.store.fleet.put_version(row)

    # ------------------------------------------------------------------ membership
    def forget_cell(self, cell_id: str) -> None:
        """A new cell process: what an earlier one was told to load does not carry over."""
        for key in [k for k in self.version_sent if k[0] == cell_id]:
            del self.version_sent[key]
        if self._told is not None:
            self._told[2].discard(cell_id)

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None:
        self.forget_cell(cell_id)


def _abandoned(row: VersionRow) -> bool:
    """Retired without ever becoming active (a broadcast no cell completed, a bogus number): it
    does not hold the lineage back."""
    return row.state == "retired" and not any(h[0] == "active" for h in row.history)
