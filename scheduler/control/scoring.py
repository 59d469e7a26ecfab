"""Log-prob service, scheduler side: which cell scores which sampled tokens, and when a cell
may drop a version.

One line: unscored (request, version) ranges → a `score` task on a live cell holding that
version (the owner first) → `scored` event → old log-probs written with provenance `exact`.

- A range is scored once it can no longer grow: its request ended, or its owner moved on to a
  newer version; a live range is scored early once `score_batch_tokens` wait, so the final
  pass before a cell drops a version finds little left.
- Tasks are few per cell (`max_tasks_per_cell`) and run at low priority on the cell; a task
  not answered within `task_timeout_s` is forgotten and reassigned.
- No live cell holds the version: a rollout cell fetches it from the trainer's version host
  for scoring only. Where that is impossible too (no source, or the fetch failed) the tokens
  get provenance `missing`, counted in a metric — never silent.
- A cell drops a version it no longer serves once none of that version's tokens is unscored;
  the time from its switch to the drop is the final pass (`final_pass_s` per version).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.contract.protocol import DropVersionCmd, LoadVersionCmd, ScoreCmd, ScoredEvent
from scheduler.contract.sampling import SamplingParams
from scheduler.control.holders import VersionHolders
from scheduler.control.served import ServedVersions

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.trust import Trust

log = logging.getLogger("cellflip.scoring")


@dataclass(slots=True)
class Task:
    cell_id: str
    request_id: str
    session_id: str
    version: int
    start: int
    end: int
    sent_at: float


class Scoring:
    """The log-prob service's bookkeeping, in memory (rebuilt after a restart: unscored tokens
    are simply assigned again)."""

    def __init__(self, ctx: Context, trust: Trust) -> None:
        self.ctx = ctx
        self.trust = trust
        self.tasks: dict[str, Task] = {}
        self.fetch_sent: dict[tuple[str, int], float] = {}
        """(cell, version) → when a scoring-only fetch of a version was sent."""
        self.fetch_failed: dict[int, str] = {}
        """version → why the last scoring-only fetch of it failed."""
        self.no_holder_since: dict[int, float] = {}
        """version → since when no live cell holds it (a restarted scheduler waits for reports)."""
        self.drop_sent: dict[tuple[str, int], float] = {}
        self.switched_at: dict[tuple[str, int], float] = {}
        """(cell, version) → when the cell stopped serving the version it still holds."""
        self.final_pass_s: dict[int, list[float]] = {}
        self.scored_tokens = 0
        self.scoring_seconds = 0.0
        self.last_pass = float("-inf")
        self._drop_sweep = ctx.registry.rotation()
        """The live cells `_drops` visits next."""
        self.served = ServedVersions(ctx)
        """Which live cell serves which version, kept by change (shared with `Versions`)."""
        self.holders = VersionHolders(ctx, self.served)
        """Which live cell in a scoring role holds which version, kept by change."""

    def busy(self, key: tuple[str, int]) -> bool:
        return any((t.request_id, t.version) == key for t in self.tasks.values())

    def load(self, cell_id: str) -> int:
        return sum(t.cell_id == cell_id for t in self.tasks.values())

    def to_api(self) -> dict[str, Any]:
        """The `scoring` block of GET /v1/versions."""
        return {"tokens": self.scored_tokens, "seconds": round(self.scoring_seconds, 6), "tasks": len(self.tasks)}

    def _holders(self, version: int) -> list[str]:
        return self.holders.of(version)

    def _serving(self, cell_id: str) -> int | None:
        s = self.ctx.registry.summary(cell_id)
        return s.version if s is not None else None

    def step(self) -> None:
        """Expire lost tasks, hand out new ones, let cells drop what is fully scored."""
        now, cfg = self.ctx.clock(), self.ctx.ver_cfg
        for tid, t in list(self.tasks.items()):
            if now - t.sent_at > cfg.task_timeout_s or t.cell_id not in self.ctx.registry.live:
                del self.tasks[tid]
        if now - self.last_pass >= cfg.score_interval_s:
            self.last_pass = now
            self._assign(now)
        self._drops(now)

    def _assign(self, now: float) -> None:
        ctx, cfg = self.ctx, self.ctx.ver_cfg
        holders: dict[int, list[str]] = {}
        self.served.refresh()
        verified = self.served.verified
        with ctx.txn(durable=False) as fx:
            for row in ctx.store.sessions.unscored_ranges(limit=cfg.max_ranges_per_pass):
                rid, sid, owner, v, lo, hi = row.request_id, row.session_id, row.owner, row.version, row.first, row.last
                if self.busy((rid, v)):
                    continue
                switched = owner is not None and self._serving(owner) != v
                frozen = row.state not in ("running", "migrating", "parked") or switched
                if not frozen and row.count < cfg.score_batch_tokens:
                    continue
                if v not in holders:
                    holders[v] = self._holders(v)
                # the cap keeps background scoring light; a final pass is not held back by it
                cells = [c for c in holders[v] if self._serving(c) != v or self.load(c) < cfg.max_tasks_per_cell]
                if not holders[v]:
                    self._no_holder(fx, v, sid, lo, hi, now)
                    continue
                self.no_holder_since.pop(v, None)
                if cells:
                    # a verified cell other than the sampler scores it: the exact log-probs then
                    # also check what the sampler reported (Trust.cross_check)
                    # (ties between equally loaded cells broken by the range, so every cell scores)
                    sampled_by = set(ctx.store.sessions.samplers(sid, lo, hi + 1))
                    others = [c for c in cells if c != owner and c not in sampled_by and c in verified]
                    spread = lambda c, rid=rid: (self.load(c), zlib.crc32(f"{rid}/{c}".encode()))  # noqa: E731
                    cell = min(others, key=spread) if others else owner if owner in cells else min(
                        cells, key=spread)
                    self._send_task(fx, cell, rid, sid, v, row.prompt_start, lo, hi + 1, row.params, now)

    def _send_task(self, fx: Effects, cell: str, rid: str, sid: str, v: int, prompt_start: int, start: int, end: int,
                   params: str, now: float) -> None:
        urgent = self._serving(cell) != v  # the final pass of a version this cell switched off
        temperature = SamplingParams.model_validate_json(params).temperature
        ids = self.ctx.store.sessions.token_ids(sid, prompt_start, end)
        tid = uuid.uuid4().hex[:16]
        self.tasks[tid] = Task(cell, rid, sid, v, start, end, now)
        fx.send(cell, lambda i: ScoreCmd(i, tid, sid, v, prompt_start, start, end, ids, temperature, urgent))

    def _no_holder(self, fx: Effects, version: int, session_id: str, lo: int, hi: int, now: float) -> None:
        """No live cell holds `version`: fetch it for scoring from the trainer, or give up."""
        ctx = self.ctx
        row = ctx.store.fleet.get_version(version)
        source = row.source if row is not None else None
        if source is not None and version not in self.fetch_failed:
            if any(v == version and now - t < ctx.ver_cfg.task_timeout_s for (_, v), t in self.fetch_sent.items()):
                return  # a fetch is under way
            live = [c for c in ctx.store.fleet.list_cells() if c.id in ctx.registry.live]
            scorers = [c for c in live if c.capabilities.get("scoring")]  # SGLang `publisher_copy` cells cannot
            cands = [c.id for c in scorers if c.state == "rollout"]
            if cands:
                cell = min(cands, key=self.load)
                self.fetch_sent[(cell, version)] = now
                fx.send(cell, lambda i: LoadVersionCmd(i, version, source, mode="fetch", activate=False))
                return
            if scorers or not live:
                return  # no rollout cell that scores now: wait for one
        since = self.no_holder_since.setdefault(version, now)
        if version not in self.fetch_failed and now - since < ctx.ver_cfg.task_timeout_s:
            return  # cells may not have reported yet (a restart); wait before giving up
        why = self.fetch_failed.get(version, "no cell holds it and it has no source" if source is None else
                                    "no live cell can score it (no engine with a scoring copy)")
        n = ctx.store.sessions.mark_missing(session_id, version, lo, hi + 1)
        if n:
            fx.later(lambda: ctx.metrics.logprob_missing.inc(n))
            log.warning("version %d: %d tokens of session %s have no exact old log-prob (%s)", version, n,
                        session_id, why)

    def on_scored(self, fx: Effects, cell_id: str, e: ScoredEvent) -> None:
        """A scoring task's answer. Exact log-probs from a verified cell are checked against what
        each token's sampler reported (`Trust.cross_check`); a value that is not a finite number
        is never stored: that token's provenance becomes `missing`."""
        ctx = self.ctx
        task = self.tasks.pop(e.task_id, None) if e.task_id is not None else None
        if ctx.store.sessions.get(e.session_id) is None:
            return
        old = list(e.old_logprobs)
        if e.provenance == "exact":
            req = ctx.store.owners.get_request(task.request_id) if task is not None else None
            base = req.base if req is not None and req.base <= e.start else e.start
            clean = self.trust.cross_check(fx, cell_id, e.session_id, base, e.start, e.version, old,
                                           task.request_id if task is not None else None)
            for i, (raw, x) in enumerate(zip(old, clean, strict=True)):
                if raw is not None and x is None and e.version is not None:
                    n = ctx.store.sessions.mark_missing(e.session_id, e.version, e.start + i, e.start + i + 1)
                    fx.later(lambda n=n: ctx.metrics.logprob_missing.inc(n))
            old = clean
        n = ctx.store.sessions.fill_old_logprobs(e.session_id, e.start, old, e.provenance, version=e.version)
        if e.provenance == "exact":
            self.scored_tokens += n
            self.scoring_seconds += max(e.seconds, 0.0)
            ctx.metrics.logprob_scored.inc(n)
        else:
            ctx.metrics.logprob_missing.inc(n)

    def on_fetch_failed(self, version: int, reason: str) -> None:
        self.fetch_failed[version] = reason or "fetch failed"

    def _drops(self, now: float) -> None:
        """Each cell frees versions it no longer serves once all their tokens are scored."""
        ctx = self.ctx
        backlog = None
        for cell_id in self._drop_sweep.next():  # a slice of the live cells a tick
            e = ctx.registry.live.get(cell_id)
            if e is None or e.summary is None:
                continue
            for v in e.summary.versions_held:
                if v == e.summary.version:
                    continue
                self.switched_at.setdefault((cell_id, v), now)
                if backlog is None:
                    backlog = ctx.store.sessions.unscored_by_version()
                if backlog.get(v, 0) and e.summary.role != "training":
                    continue  # still needed here for the final pass (a training cell scores nothing)
                if now - self.drop_sent.get((cell_id, v), float("-inf")) < ctx.cfg.lease_s:
                    continue
                self.drop_sent[(cell_id, v)] = now
                t0 = self.switched_at.pop((cell_id, v), now)
                self.final_pass_s.setdefault(v, []).append(now - t0)
                ctx.metrics.logprob_final_pass.observe(now - t0)
                ctx.registry.send(cell_id, lambda i, v=v: DropVersionCmd(i, v))

    def sole_holder_with_backlog(self, cell_id: str) -> list[int]:
        """Versions with unscored tokens that only `cell_id` holds (a flip to training waits for
        their final pass)."""
        s = self.ctx.registry.summary(cell_id)
        if s is None:
            return []
        backlog = self.ctx.store.sessions.unscored_by_version()
        return [v for v in s.versions_held
                if backlog.get(v, 0) and not any(c != cell_id for c in self._holders(v))]

    def on_cell_fenced(self, fx: Effects, cell_id: str, reason: str) -> None:
        """The cell's tasks and fetches are lost with it: its ranges are assigned again."""
        for tid in [tid for tid, t in self.tasks.items() if t.cell_id == cell_id]:
            del self.tasks[tid]
        for d in (self.fetch_sent, self.drop_sent, self.switched_at):
            for key in [k for k in d if k[0] == cell_id]:
                del d[key]
