"""Simulated cluster state: N cells x capacity slots as numpy arrays, and the moves on it.

Time advances in controller ticks (`tick_s`). Within a tick every session finish and every
training event happens at its exact time (`advance`); at the tick the controller acts:
flips, migrations, resumptions and admissions happen then, as in production, where the
scheduler's controller loop does them. Per-cell summaries for the planner are rebuilt only
for cells that changed (`snapshot`), so a tick at 10,000 cells stays cheap.

A slot holds one session: `t0` is its effective start (progress = (t - t0) / dur, so a move
that pauses decoding for d seconds adds d to t0), `occ` when its current occupancy began
(busy accounting), `v0` the version of its first token.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from scheduler.planner import choose_destinations
from scheduler.planner_types import (
    CellSummary,
    Destination,
    LinkCostModel,
    RequestSummary,
    Snapshot,
)

from .trainer import Trainer
from .workload import Workload

ROLLOUT, TRAINING, LOADING = 0, 1, 2
ROLE_NAMES = ("rollout", "training", "loading")
INF = math.inf


class Cluster:
    """Mutable simulation state. Every method documents what it changes."""

    def __init__(self, wl: Workload, n_cells: int, hours: float, seed: int, tick_s: float,
                 can_export_kv: bool, trainer: Trainer) -> None:
        self.wl = wl
        self.n = n_cells
        self.k = wl.cell_capacity
        self.horizon_s = hours * 3600.0
        self.tick_s = tick_s
        self.can_export_kv = can_export_kv
        self.rng = np.random.default_rng(seed)
        self.trainer = trainer
        slots = self.n * self.k
        self.end = np.full(slots, INF)
        self.t0 = np.zeros(slots)
        self.dur = np.ones(slots)
        self.occ = np.zeros(slots)
        self.v0 = np.zeros(slots, dtype=np.int64)
        self.role = np.full(self.n, ROLLOUT, dtype=np.int8)
        self.ready_at = np.zeros(self.n)
        self.gen = np.zeros(self.n, dtype=np.int64)
        self.inflight = np.zeros(self.n, dtype=np.int64)
        self.train_order: list[int] = []  # training cells, earliest first (those are busy first)
        self.suspended: deque[tuple[float, float, int]] = deque()  # (done seconds, dur, v0)
        self.cost = LinkCostModel(
            kv_bytes_per_token=wl.kv_bytes_per_token, intra_node_bytes_per_s=wl.intra_node_bytes_per_s,
            inter_node_bytes_per_s=wl.inter_node_bytes_per_s, prefill_tokens_per_s=wl.prefill_tokens_per_s)
        self.blocks_per_session = -(-wl.session_tokens // self.cost.block_size)
        self.nodes = [f"node{i // wl.cells_per_node}" for i in range(self.n)]
        # accounting
        self.decode_slot_s = 0.0
        self.recomputed_tokens = 0
        self.pause_slot_s = 0.0  # seconds sessions waited on a KV copy or a re-prefill
        self.moved = {"kv": 0, "reprefill": 0, "suspend": 0}
        self.accepted_in_tick = 0
        self.freed_slot_s_in_tick = 0.0
        # planner view
        self._summaries: list[CellSummary | None] = [None] * self.n
        self._dirty = np.ones(self.n, dtype=bool)
        self._busy_count = 0

    # ------------------------------------------------------------ time
    def advance(self, t: float) -> None:
        """Finish every session whose end <= t, in time order, feeding the trainer; then run
        the trainer to t. Frees slots; updates inflight, accounting and the trainer."""
        idx = np.flatnonzero(self.end <= t)
        if idx.size:
            f = self.end[idx]
            order = np.argsort(f, kind="stable")
            idx, f = idx[order], f[order]
            self.decode_slot_s += float((f - self.occ[idx]).sum())
            self.freed_slot_s_in_tick += float((t - f).sum())
            cells = idx // self.k
            self.inflight -= np.bincount(cells, minlength=self.n)
            self._dirty[cells] = True
            self.end[idx] = INF
            self.accepted_in_tick += self.trainer.feed(f, self.v0[idx], self.dur[idx])
        self.trainer.run_until(t)
        for c in np.flatnonzero((self.role == LOADING) & (self.ready_at <= t)):
            self.role[c] = ROLLOUT
            self._dirty[c] = True

    # ------------------------------------------------------------ admission
    def admit(self, t: float) -> int:
        """Start new sessions in every free slot of rollout and loading cells (a loading
        cell's start when its weights arrive). Returns how many started."""
        ok = (self.role == ROLLOUT) | (self.role == LOADING)
        free = np.flatnonzero((self.end == INF) & np.repeat(ok, self.k))
        if free.size == 0:
            return 0
        cells = free // self.k
        start = np.maximum(t, self.ready_at[cells])
        dur = self.wl.draw_durations_s(self.rng, start, self.horizon_s)
        self.t0[free] = start
        self.occ[free] = start
        self.dur[free] = dur
        self.end[free] = start + dur
        self.v0[free] = self.trainer.version
        self.inflight += np.bincount(cells, minlength=self.n)
        self._dirty[cells] = True
        return int(free.size)

    # ------------------------------------------------------------ roles
    def set_roles(self, cells: list[int], role: int, t: float) -> None:
        """Change cells' role (bumps their generation); a cell entering rollout loads weights
        first (until t + broadcast_s). Keeps the trainer's cell order."""
        if not cells:
            return
        idx = np.asarray(cells, dtype=np.int64)
        leaving = set(int(c) for c in idx[self.role[idx] == TRAINING]) if role != TRAINING else set()
        joining = [int(c) for c in idx[self.role[idx] != TRAINING]] if role == TRAINING else []
        self.role[idx] = role
        self.gen[idx] += 1
        self._dirty[idx] = True
        if role == LOADING:
            self.ready_at[idx] = t + self.wl.broadcast_s
        if leaving:
            self.train_order = [c for c in self.train_order if c not in leaving]
            self._dirty[self.train_order] = True  # positions, hence busy flags, may shift
        self.train_order.extend(joining)

    def sync_trainer_cells(self, t: float) -> None:
        """Tell the trainer how many cells it has now."""
        self.trainer.set_cells(len(self.train_order), t)
        self.refresh_busy()

    def refresh_busy(self) -> None:
        busy = self.trainer.busy_cells()
        if busy != self._busy_count:
            lo, hi = sorted((busy, self._busy_count))
            self._dirty[self.train_order[lo:hi]] = True  # only these changed busy flag
            self._busy_count = busy

    # ------------------------------------------------------------ moves
    def sessions_of(self, c: int) -> np.ndarray:
        base = c * self.k
        return base + np.flatnonzero(self.end[base:base + self.k] < INF)

    def context_tokens(self, slots: np.ndarray, t: float) -> np.ndarray:
        progress = np.clip((t - self.t0[slots]) / self.dur[slots], 0.0, 1.0)
        return (progress * self.wl.session_tokens).astype(np.int64)

    def drain(self, cells: list[int], t: float) -> None:
        """Move every session off `cells` (already marked training) where the planner says:
        KV copy or re-prefill into a rollout cell, or suspend. Updates slots and counters."""
        slots = np.concatenate([self.sessions_of(c) for c in cells]) if cells else np.zeros(0, np.int64)
        if slots.size == 0:
            return
        ctx = self.context_tokens(slots, t)
        moves = [(int(s // self.k), RequestSummary(int(s), int(x), 0)) for s, x in zip(slots, ctx)]
        dests = choose_destinations(self.snapshot(t), moves, self.cost)
        for s, x, d in zip(slots.tolist(), ctx.tolist(), dests):
            self._close(s, t)
            if d.path == "suspend":
                self.suspended.append(((t - self.t0[s]), self.dur[s], int(self.v0[s])))
                self.moved["suspend"] += 1
                continue
            self._place(int(d.cell_id), t - self.t0[s], self.dur[s], int(self.v0[s]), t, d, x)

    def resume_suspended(self, t: float) -> None:
        """Place suspended sessions (oldest first) into free rollout slots by re-prefill."""
        if not self.suspended:
            return
        free = int(((self.role == ROLLOUT) * (self.k - self.inflight)).sum())
        m = min(free, len(self.suspended))
        if m == 0:
            return
        batch = [self.suspended.popleft() for _ in range(m)]
        ctx = [min(self.wl.session_tokens, int(done / dur * self.wl.session_tokens)) for done, dur, _ in batch]
        moves = [(None, RequestSummary(i, x, 0)) for i, x in enumerate(ctx)]
        dests = choose_destinations(self.snapshot(t), moves, self.cost)
        for (done, dur, v0), x, d in zip(batch, ctx, dests):
            if d.path == "suspend":
                self.suspended.append((done, dur, v0))
            else:
                self._place(int(d.cell_id), done, dur, v0, t, d, x)

    def _close(self, s: int, t: float) -> None:
        self.decode_slot_s += t - self.occ[s]
        self.end[s] = INF
        c = s // self.k
        self.inflight[c] -= 1
        self._dirty[c] = True

    def _place(self, c: int, done: float, dur: float, v0: int, t: float, d: Destination, ctx: int) -> None:
        base = c * self.k
        s = base + int(np.flatnonzero(self.end[base:base + self.k] == INF)[0])
        self.t0[s] = t + d.seconds - done
        self.occ[s] = t
        self.dur[s] = dur
        self.end[s] = self.t0[s] + dur
        self.v0[s] = v0
        self.inflight[c] += 1
        self._dirty[c] = True
        self.moved[d.path] += 1
        self.pause_slot_s += d.seconds
        if d.path == "reprefill":
            self.recomputed_tokens += ctx

    # ------------------------------------------------------------ planner view
    def snapshot(self, t: float, **rates: float) -> Snapshot:
        """Rebuild summaries of changed cells and return the planner's view. Changes nothing
        but the summary cache."""
        dirty = np.flatnonzero(self._dirty)
        if dirty.size:
            busy = set(self.train_order[: self._busy_count])
            tokens = self._tokens_per_cell(dirty, t)
            for c, tok in zip(dirty.tolist(), tokens):
                role = int(self.role[c])
                inflight = int(self.inflight[c])
                self._summaries[c] = CellSummary(
                    c, self.nodes[c], ROLE_NAMES[role], 0, inflight, self.k,
                    (self.k - inflight) * self.blocks_per_session if role != TRAINING else 0,
                    self.k * self.blocks_per_session, int(self.gen[c]), self.can_export_kv,
                    c in busy, tok)
            self._dirty[:] = False
        tr = self.trainer
        return Snapshot(
            cells=tuple(self._summaries),  # type: ignore[arg-type]
            finished_waiting=tr.queue.size, batch_size=tr.batch_size,
            training_in_progress=bool(tr.steps), min_rollout_cells=1,
            # agent harnesses always have prompts waiting: as many as the cluster has slots
            queued_sessions=len(self.suspended) + self.n * self.k,
            version=tr.version, staleness_bound=self.wl.staleness_bound,
            steps_in_progress=len(tr.steps), max_cells_per_step=tr.width,
            finish_rate_per_slot_s=rates.get("finish_rate_per_slot_s", 0.0),
            train_rate_per_cell_s=rates.get("train_rate_per_cell_s", 0.0))

    def _tokens_per_cell(self, cells: np.ndarray, t: float) -> list[int]:
        slots = (cells[:, None] * self.k + np.arange(self.k)).ravel()
        live = self.end[slots] < INF
        ctx = np.where(live, self.context_tokens(slots, t), 0)
        return ctx.reshape(-1, self.k).sum(axis=1).tolist()

    def mark_all_dirty(self) -> None:
        self._dirty[:] = True

    def check_integrity(self) -> None:
        """Assert the invariants between the arrays (tests call it every tick)."""
        live = (self.end < INF).reshape(self.n, self.k)
        assert (live.sum(axis=1) == self.inflight).all(), "inflight disagrees with occupied slots"
        assert not live[self.role == TRAINING].any(), "a training cell holds sessions"
        assert sorted(self.train_order) == np.flatnonzero(self.role == TRAINING).tolist()
        assert self.trainer.cells == len(self.train_order), "trainer cell count out of date"
        slots = np.flatnonzero(self.end < INF)
        assert (self.end[slots] >= self.occ[slots]).all() and (self.dur[slots] > 0).all()

    # ------------------------------------------------------------ accounting
    def occupied_decoding(self, t: float) -> int:
        """Slots decoding at time t."""
        return int(((self.end < INF) & (self.occ <= t)).sum())

    def close_books(self) -> None:
        """Count the decode time of sessions still running at the horizon."""
        h = self.horizon_s
        live = (self.end < INF) & (self.occ < h)
        self.decode_slot_s += float((h - self.occ[live]).sum())
        self.trainer.run_until(h)
