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

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler.protocol import DropVersionCmd, LoadVersionCmd, ScoreCmd, ScoredEvent

if TYPE_CHECKING:
    from scheduler.controller import Controller, Effects

log = logging.getLogger("cellflip.scoring")

SCORING_ROLES = ("rollout", "draining")
"""Cell states whose engine holds weights it can score with."""


@dataclass(slots=True)
class Task:
    cell_id: str
    request_id: str
    session_id: str
    version: int
    start: int
    end: int
    sent_at: float


@dataclass
class ScoringState:
    """In-memory bookkeeping (rebuilt from the store after a restart: unscored tokens are
    simply assigned again)."""

    tasks: dict[str, Task] = field(default_factory=dict)
    fetch_sent: dict[tuple[str, int], float] = field(default_factory=dict)
    """(cell, version) → when a scoring-only fetch of a version was sent."""
    fetch_failed: dict[int, str] = field(default_factory=dict)
    """version → why the last scoring-only fetch of it failed."""
    no_holder_since: dict[int, float] = field(default_factory=dict)
    """version → since when no live cell holds it (a restarted scheduler waits for reports)."""
    drop_sent: dict[tuple[str, int], float] = field(default_factory=dict)
    switched_at: dict[tuple[str, int], float] = field(default_factory=dict)
    """(cell, version) → when the cell stopped serving the version it still holds."""
    final_pass_s: dict[int, list[float]] = field(default_factory=dict)
    scored_tokens: int = 0
    scoring_seconds: float = 0.0
    last_pass: float = float("-inf")

    def busy(self, key: tuple[str, int]) -> bool:
        return any((t.request_id, t.version) == key for t in self.tasks.values())

    def load(self, cell_id: str) -> int:
        return sum(t.cell_id == cell_id for t in self.tasks.values())


def _holders(ctl: Controller, version: int) -> list[str]:
    out = []
    for c in ctl.store.fleet.list_cells():
        e = ctl.registry.live.get(c.id)
        if c.state in SCORING_ROLES and e is not None and e.summary is not None and version in e.summary.versions_held:
            out.append(c.id)
    return out


def _serving(ctl: Controller, cell_id: str) -> int | None:
    e = ctl.registry.live.get(cell_id)
    return e.summary.version if e is not None and e.summary is not None else None


def step(ctl: Controller) -> None:
    """Expire lost tasks, hand out new ones, let cells drop what is fully scored."""
    st, now, cfg = ctl.scoring, ctl.clock(), ctl.ver_cfg
    for tid, t in list(st.tasks.items()):
        if now - t.sent_at > cfg.task_timeout_s or t.cell_id not in ctl.registry.live:
            del st.tasks[tid]
    if now - st.last_pass >= cfg.score_interval_s:
        st.last_pass = now
        _assign(ctl, now)
    _drops(ctl, now)


def _assign(ctl: Controller, now: float) -> None:
    st, cfg = ctl.scoring, ctl.ver_cfg
    holders: dict[int, list[str]] = {}
    with ctl.txn(durable=False) as fx:
        for row in ctl.store.sessions.unscored_ranges(limit=cfg.max_ranges_per_pass):
            rid, sid, prompt_start, base, num_gen, params, state, owner, v, lo, hi, n = row
            if st.busy((rid, v)):
                continue
            switched = owner is not None and _serving(ctl, owner) != v
            frozen = state not in ("running", "migrating", "parked") or switched
            if not frozen and n < cfg.score_batch_tokens:
                continue
            if v not in holders:
                holders[v] = _holders(ctl, v)
            # the cap keeps background scoring light; a final pass is not held back by it
            cells = [c for c in holders[v] if _serving(ctl, c) != v or st.load(c) < cfg.max_tasks_per_cell]
            if not holders[v]:
                _no_holder(ctl, fx, v, sid, lo, hi, now)
                continue
            st.no_holder_since.pop(v, None)
            if not cells:
                continue
            cell = owner if owner in cells else min(cells, key=st.load)
            urgent = _serving(ctl, cell) != v  # the final pass of a version this cell switched off
            temperature = float(json.loads(params).get("temperature", 1.0)) if isinstance(params, str) else \
                float(params.get("temperature", 1.0))
            ids = ctl.store.sessions.token_ids(sid, prompt_start, hi + 1)
            tid = uuid.uuid4().hex[:16]
            st.tasks[tid] = Task(cell, rid, sid, v, lo, hi + 1, now)
            fx.send(cell, lambda i, tid=tid, sid=sid, v=v, ps=prompt_start, lo=lo, hi=hi, ids=ids, t=temperature,
                    u=urgent: ScoreCmd(i, tid, sid, v, ps, lo, hi + 1, ids, t, u))


def _no_holder(ctl: Controller, fx: Effects, version: int, session_id: str, lo: int, hi: int, now: float) -> None:
    """No live cell holds `version`: fetch it for scoring from the trainer, or give up."""
    st = ctl.scoring
    row = ctl.store.fleet.get_version(version)
    source = row.source if row is not None else None
    if source is not None and version not in st.fetch_failed:
        if any(v == version and now - t < ctl.ver_cfg.task_timeout_s for (_, v), t in st.fetch_sent.items()):
            return  # a fetch is under way
        live = [c for c in ctl.store.fleet.list_cells() if c.id in ctl.registry.live]
        scorers = [c for c in live if c.capabilities.get("scoring")]  # SGLang `trainer_copy` cells cannot
        cands = [c.id for c in scorers if c.state == "rollout"]
        if cands:
            cell = min(cands, key=st.load)
            st.fetch_sent[(cell, version)] = now
            fx.send(cell, lambda i: LoadVersionCmd(i, version, source, mode="fetch", activate=False))
            return
        if scorers or not live:
            return  # no rollout cell that scores now: wait for one
    since = st.no_holder_since.setdefault(version, now)
    if version not in st.fetch_failed and now - since < ctl.ver_cfg.task_timeout_s:
        return  # cells may not have reported yet (a restart); wait before giving up
    why = st.fetch_failed.get(version, "no cell holds it and it has no source" if source is None else
                              "no live cell can score it (no engine with a scoring copy)")
    n = ctl.store.sessions.mark_missing(session_id, version, lo, hi + 1)
    if n:
        fx.later(lambda: ctl.metrics.logprob_missing.inc(n))
        log.warning("version %d: %d tokens of session %s have no exact old log-prob (%s)", version, n, session_id, why)


def on_scored(ctl: Controller, e: ScoredEvent) -> None:
    st = ctl.scoring
    if e.task_id is not None:
        st.tasks.pop(e.task_id, None)
    if ctl.store.sessions.get(e.session_id) is None:
        return
    n = ctl.store.sessions.fill_old_logprobs(e.session_id, e.start, e.old_logprobs, e.provenance, version=e.version)
    if e.provenance == "exact":
        st.scored_tokens += n
        st.scoring_seconds += max(e.seconds, 0.0)
        ctl.metrics.logprob_scored.inc(n)
    else:
        ctl.metrics.logprob_missing.inc(n)


def on_fetch_failed(ctl: Controller, version: int, reason: str) -> None:
    ctl.scoring.fetch_failed[version] = reason or "fetch failed"


def _drops(ctl: Controller, now: float) -> None:
    """Each cell frees versions it no longer serves once all their tokens are scored."""
    st = ctl.scoring
    backlog = None
    for cell_id, e in ctl.registry.live.items():
        if e.summary is None:
            continue
        for v in e.summary.versions_held:
            if v == e.summary.version:
                continue
            st.switched_at.setdefault((cell_id, v), now)
            if backlog is None:
                backlog = ctl.store.sessions.unscored_by_version()
            if backlog.get(v, 0) and e.summary.role != "training":
                continue  # still needed here for the final pass (a training cell scores nothing)
            if now - st.drop_sent.get((cell_id, v), float("-inf")) < ctl.cfg.lease_s:
                continue
            st.drop_sent[(cell_id, v)] = now
            t0 = st.switched_at.pop((cell_id, v), now)
            st.final_pass_s.setdefault(v, []).append(now - t0)
            ctl.metrics.logprob_final_pass.observe(now - t0)
            ctl.registry.send(cell_id, lambda i, v=v: DropVersionCmd(i, v))


def sole_holder_with_backlog(ctl: Controller, cell_id: str) -> list[int]:
    """Versions with unscored tokens that only `cell_id` holds (a flip to training waits for
    their final pass)."""
    e = ctl.registry.live.get(cell_id)
    if e is None or e.summary is None:
        return []
    backlog = ctl.store.sessions.unscored_by_version()
    return [v for v in e.summary.versions_held
            if backlog.get(v, 0) and not any(c != cell_id for c in _holders(ctl, v))]
