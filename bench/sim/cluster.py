"""Simulated cluster state: N cells x capacity slots as numpy arrays, and the moves on it.

Time advances in controller ticks (`tick_s`). Within a tick every session finish and every
training event happens at its exact time (`advance`); flips, migrations, resumptions and
admissions happen at the tick, as the scheduler's controller loop does them. Planner summaries
are rebuilt only for cells that changed (`snapshot`): a tick at 10,000 cells stays cheap.

A slot holds one session: `t0` its effective start (progress = (t - t0) / dur: a pause of d
seconds adds d to t0), `occ` when its occupancy began, `v0` its first token's version, `tok`
its tokens at the end.

How sessions move off a cell flipped to training (`mode`), each charged where it costs:
- "kv" (cellflip): a KV copy, bytes / link bandwidth, paid by both ends: the destination
  cell's sessions pause for it, the source trains that much later (or the next step waits).
- "reprefill" (flip_reprefill): the destination recomputes the context (`Workload.prefill_s`,
  from context length and model size) and its sessions pause meanwhile; tokens are kept.
- "abort" (flip_abort): the session restarts from its prompt elsewhere, which the destination
  prefills (progress lost, decoded tokens discarded), as RL frameworks without live migration do.
- "free" (the oracle): moves take no time and cost nothing.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from scheduler.control.rates import Rates
from scheduler.planner.destinations import choose_destinations
from scheduler.planner.types import CellSummary, LinkCostModel, RequestSummary, Snapshot

from .trainer import Trainer
from .workload import Workload

ROLLOUT, TRAINING, LOADING = 0, 1, 2
ROLE_NAMES = ("rollout", "training", "loading")
INF = math.inf
MODES = ("kv", "reprefill", "abort", "free")
TOKENS_SLACK = 0.10
"""A cell's summary is rebuilt once its in-flight tokens moved this share off the summary's."""


class Cluster:
    """Mutable simulation state. Every method documents what it changes."""

    def __init__(self, wl: Workload, n_cells: int, hours: float, seed: int, tick_s: float,
                 mode: str, trainer: Trainer) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.wl = wl
        self.n = n_cells
        self.k = wl.cell_capacity
        self.horizon_s = hours * 3600.0
        self.tick_s = tick_s
        self.mode = mode
        self.can_export_kv = mode == "kv"
        self.rng = np.random.default_rng(seed)
        self.trainer = trainer
        slots = self.n * self.k
        self.end = np.full(slots, INF)
        self.t0 = np.zeros(slots)
        self.dur = np.ones(slots)
        self.occ = np.zeros(slots)
        self.v0 = np.zeros(slots, dtype=np.int64)
        self.tok = np.ones(slots)
        self.role = np.full(self.n, ROLLOUT, dtype=np.int8)
        self.ready_at = np.zeros(self.n)
        self.gen = np.zeros(self.n, dtype=np.int64)
        self.inflight = np.zeros(self.n, dtype=np.int64)
        self.train_order: list[int] = []  # training cells, earliest first (those are busy first)
        self.suspended: deque[tuple[float, float, int, float]] = deque()  # (done s, dur, v0, tokens)
        self.cost = LinkCostModel(
            kv_bytes_per_token=wl.kv_bytes_per_token, intra_node_bytes_per_s=wl.intra_node_bytes_per_s,
            inter_node_bytes_per_s=wl.inter_node_bytes_per_s, prefill_tokens_per_s=wl.prefill_tokens_per_s)
        self.blocks_per_session = -(-wl.session_tokens // self.cost.block_size)
        self.nodes = [f"node{i // wl.cells_per_node}" for i in range(self.n)]
        # accounting
        self.decode_slot_s = 0.0
        self.recomputed_tokens = 0
        self.pause_slot_s = 0.0  # seconds sessions waited on a KV copy or a re-prefill
        self.moved = {"kv": 0, "reprefill": 0, "abort": 0, "suspend": 0}
        self.decoded_tokens = 0.0  # sessions finished, plus the progress of those aborted or cut
        self.discarded_tokens = 0.0
        """Decoded tokens thrown away here (aborted or cut sessions); staleness drops are the trainer's."""
        self.discarded_slot_s = 0.0
        self.source_delay_cell_s = 0.0
        self.accepted_in_tick = 0
        self.finished_in_tick = 0
        self.freed_slot_s_in_tick = 0.0
        # planner view
        self._summaries: list[CellSummary | None] = [None] * self.n
        self._dirty = np.ones(self.n, dtype=bool)
        self._tokens = np.zeros(self.n, dtype=np.int64)
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
            self.decoded_tokens += float(self.tok[idx].sum())
            self.finished_in_tick += int(idx.size)
            self.accepted_in_tick += self.trainer.feed(f, self.v0[idx], self.dur[idx], self.tok[idx])
        self.trainer.run_until(t)
        for c in np.flatnonzero((self.role == LOADING) & (self.ready_at <= t)):
            self.role[c] = ROLLOUT
            self._dirty[c] = True

    # ------------------------------------------------------------ admission
    def admit(self, t: float, limit: int | None = None) -> int:
        """Start new sessions in every free slot of rollout and loading cells (a loading
        cell's start when its weights arrive), at most `limit`. Returns how many started."""
        ok = (self.role == ROLLOUT) | (self.role == LOADING)
        free = np.flatnonzero((self.end == INF) & np.repeat(ok, self.k))[:limit]
        if free.size == 0:
            return 0
        cells = free // self.k
        start = np.maximum(t, self.ready_at[cells])
        dur = self.wl.draw_durations_s(self.rng, start, self.horizon_s)
        self.tok[free] = self.wl.tokens_of(dur, start, self.horizon_s)
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
        if role == LOADING and self.mode == "free":
            role = ROLLOUT  # the oracle's weights arrive at once
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
        return (progress * self.tok[slots]).astype(np.int64)

    def drain(self, cells: list[int], t: float) -> None:
        """Move every session off `cells` (already marked training) the way `mode` says: where
        the planner puts it (KV copy, re-prefill or restart) or suspend; the oracle's at no
        cost (`_drain_free`). Updates slots, counters and the charges of every move."""
        slots = np.concatenate([self.sessions_of(c) for c in cells]) if cells else np.zeros(0, np.int64)
        if slots.size == 0:
            return
        if self.mode == "free":
            self._drain_free(slots, t)
            return
        ctx = self.context_tokens(slots, t)
        moves = [(int(s // self.k), RequestSummary(int(s), int(x), 0)) for s, x in zip(slots, ctx)]
        dests = choose_destinations(self.snapshot(t), moves, self.cost)
        delay = 0.0
        for s, x, d in zip(slots.tolist(), ctx.tolist(), dests):
            self._close(s, t)
            done, dur, v0, tok = t - self.t0[s], self.dur[s], int(self.v0[s]), float(self.tok[s])
            if self.mode == "abort":
                self._discard(x, done)
                done, v0 = 0.0, self.trainer.version
                self.moved["abort"] += 1
            if d.path == "suspend":
                self.suspended.append((done, dur, v0, tok))
                self.moved["suspend"] += 1
                continue
            delay += self._place(int(d.cell_id), done, dur, v0, tok, t, d.path, x, src=s // self.k)
        if delay > 0:
            self.source_delay_cell_s += delay
            self.trainer.send_kv(delay / len(cells), len(cells))

    def resume_suspended(self, t: float) -> None:
        """Place suspended sessions (oldest first) into free rollout slots: by re-prefill (a
        suspended session's KV is gone), at no cost for the oracle, from the prompt after an abort."""
        if not self.suspended:
            return
        free = int(((self.role == ROLLOUT) * (self.k - self.inflight)).sum())
        m = min(free, len(self.suspended))
        if m == 0:
            return
        batch = [self.suspended.popleft() for _ in range(m)]
        if self.mode == "free":
            done, dur, v0, tok = (np.asarray(x) for x in zip(*batch))
            self._place_free(done, dur, v0.astype(np.int64), tok, t)
            return
        ctx = [min(tok, done / dur * tok) for done, dur, _, tok in batch]
        moves = [(None, RequestSummary(i, int(x), 0)) for i, x in enumerate(ctx)]
        dests = choose_destinations(self.snapshot(t), moves, self.cost)
        for (done, dur, v0, tok), x, d in zip(batch, ctx, dests):
            if d.path == "suspend":
                self.suspended.append((done, dur, v0, tok))
            else:
                self._place(int(d.cell_id), done, dur, v0, tok, t, d.path, int(x))

    def _drain_free(self, slots: np.ndarray, t: float) -> None:
        """The oracle's drain: every session into a free rollout slot, in cell order, at no
        cost (no planner); the rest wait, their progress kept."""
        self.decode_slot_s += float((t - self.occ[slots]).sum())
        self.end[slots] = INF
        cells = slots // self.k
        self.inflight -= np.bincount(cells, minlength=self.n)
        self._dirty[cells] = True
        self._place_free(t - self.t0[slots], self.dur[slots].copy(), self.v0[slots].copy(),
                         self.tok[slots].copy(), t)

    def _place_free(self, done: np.ndarray, dur: np.ndarray, v0: np.ndarray, tok: np.ndarray,
                    t: float) -> None:
        free = np.flatnonzero((self.end == INF) & np.repeat(self.role == ROLLOUT, self.k))[: done.size]
        m = free.size
        self.t0[free] = t - done[:m]
        self.occ[free] = t
        self.dur[free] = dur[:m]
        self.end[free] = self.t0[free] + dur[:m]
        self.v0[free] = v0[:m]
        self.tok[free] = tok[:m]
        cells = free // self.k
        self.inflight += np.bincount(cells, minlength=self.n)
        self._dirty[cells] = True
        self.moved["kv"] += m
        self.moved["suspend"] += done.size - m
        self.suspended.extend(zip(done[m:].tolist(), dur[m:].tolist(), v0[m:].tolist(), tok[m:].tolist()))

    def _discard(self, tokens: float, slot_s: float) -> None:
        self.decoded_tokens += tokens
        self.discarded_tokens += tokens
        self.discarded_slot_s += slot_s

    def _close(self, s: int, t: float) -> None:
        self.decode_slot_s += t - self.occ[s]
        self.end[s] = INF
        c = s // self.k
        self.inflight[c] -= 1
        self._dirty[c] = True

    def _pause(self, c: int, seconds: float) -> None:
        """Cell `c` stops decoding for `seconds` (it prefills, or takes in a KV copy)."""
        base = c * self.k
        live = base + np.flatnonzero(self.end[base:base + self.k] < INF)
        self.t0[live] += seconds
        self.end[live] += seconds
        self.pause_slot_s += seconds * live.size

    def _place(self, c: int, done: float, dur: float, v0: int, tok: float, t: float, path: str,
               ctx: int, src: int | None = None) -> float:
        """Put one session on cell `c` by `path`; returns the seconds its source spent sending."""
        if path == "kv" and self.mode != "kv":
            path = "reprefill"  # a suspended session's KV is gone
        if self.mode == "abort":  # from the prompt: the destination prefills it again
            path, seconds = "abort", float(self.wl.prefill_s(self.wl.prompt_tokens))
            self.recomputed_tokens += self.wl.prompt_tokens
        elif path == "kv":
            same = src is not None and self.nodes[src] == self.nodes[c]
            seconds = ctx * self.wl.kv_bytes_per_token / (
                self.wl.intra_node_bytes_per_s if same else self.wl.inter_node_bytes_per_s)
        else:
            path, seconds = "reprefill", float(self.wl.prefill_s(ctx))
            self.recomputed_tokens += ctx
        if seconds > 0:
            self._pause(c, seconds)  # the destination's own sessions wait for it
        base = c * self.k
        s = base + int(np.flatnonzero(self.end[base:base + self.k] == INF)[0])
        self.t0[s] = t + seconds - done
        self.occ[s] = t
        self.dur[s] = dur
        self.end[s] = self.t0[s] + dur
        self.v0[s] = v0
        self.tok[s] = tok
        self.inflight[c] += 1
        self._dirty[c] = True
        if path != "abort":
            self.moved[path if path in self.moved else "kv"] += 1
        self.pause_slot_s += seconds
        return seconds if path == "kv" else 0.0

    def abort_all(self, t: float) -> None:
        """Cut every running session (a sync round's timeout): its decoded tokens are discarded."""
        slots = np.flatnonzero(self.end < INF)
        if slots.size == 0:
            return
        ctx = self.context_tokens(slots, t)
        done = np.maximum(0.0, t - self.occ[slots])
        self.decode_slot_s += float(done.sum())
        self.decoded_tokens += float(ctx.sum())
        self.discarded_tokens += float(ctx.sum())
        self.discarded_slot_s += float(done.sum())
        self.end[slots] = INF
        self.inflight[:] = 0
        self._dirty[:] = True

    # ------------------------------------------------------------ planner view
    def snapshot(self, t: float, rates: Rates | None = None) -> Snapshot:
        """Rebuild summaries of changed cells and return the planner's view, every field filled
        as the controller fills it (rates measured by `rates`, the same `scheduler.control.rates.Rates`).
        Changes nothing but the summary cache."""
        # in-flight tokens grow while cells decode: a summary more than TOKENS_SLACK off is rebuilt
        tokens = self._tokens_per_cell(t)
        stale = np.abs(tokens - self._tokens) > TOKENS_SLACK * np.maximum(self._tokens, 1)
        dirty = np.flatnonzero(self._dirty | stale)
        if dirty.size:
            busy = set(self.train_order[: self._busy_count])
            self._tokens[dirty] = tokens[dirty]
            k, bps, export, nodes, out = self.k, self.blocks_per_session, self.can_export_kv, self.nodes, self._summaries
            total = k * bps
            for c, role, inflight, gen, tok in zip(dirty.tolist(), self.role[dirty].tolist(),
                                                   self.inflight[dirty].tolist(), self.gen[dirty].tolist(),
                                                   tokens[dirty].tolist()):
                out[c] = CellSummary(c, nodes[c], ROLE_NAMES[role], 0, inflight, k,
                                     (k - inflight) * bps if role != TRAINING else 0, total, gen,
                                     export, c in busy, tok)
            self._dirty[:] = False
        tr, r = self.trainer, rates or Rates()
        return Snapshot(
            cells=tuple(self._summaries),  # type: ignore[arg-type]
            finished_waiting=tr.queue.size, batch_size=tr.batch_size,
            training_in_progress=tr.step is not None, min_rollout_cells=1,
            # what the scheduler sees waiting: suspended requests (a harness's new sessions are
            # admitted into free slots at the tick, or refused; they never queue)
            queued_sessions=len(self.suspended),
            version=tr.version, staleness_bound=self.wl.staleness_bound,
            steps_in_progress=len(tr.steps), max_cells_per_step=tr.width,
            finish_rate_per_slot_s=r.finish_rate_per_slot_s(), slot_occupancy=r.slot_occupancy(),
            new_session_rate_per_slot_s=r.new_session_rate_per_slot_s, new_session_rate_trend=r.new_session_rate_trend,
            new_session_rate_period_s=r.new_session_swings.period_s(), new_session_rate_swing=r.new_session_swings.swing(),
            train_rate_per_cell_s=r.train_rate_per_cell_s, train_step_s=r.train_step_s,
            tokens_per_step=r.tokens_per_step, max_concurrent_steps=1)

    def _tokens_per_cell(self, t: float) -> np.ndarray:
        """Context tokens of every cell's in-flight sessions at `t` (vectorized over all slots)."""
        live = self.end < INF
        progress = np.clip((t - self.t0) / self.dur, 0.0, 1.0)
        ctx = np.where(live, (progress * self.tok).astype(np.int64), 0)
        return ctx.reshape(self.n, self.k).sum(axis=1)

    def check_integrity(self) -> None:
        """Assert the invariants between the arrays (tests call it every tick)."""
        live = (self.end < INF).reshape(self.n, self.k)
        assert (live.sum(axis=1) == self.inflight).all(), "inflight disagrees with occupied slots"
        assert not live[self.role == TRAINING].any(), "a training cell holds sessions"
        assert sorted(self.train_order) == np.flatnonzero(self.role == TRAINING).tolist()
        assert self.trainer.cells == len(self.train_order), "trainer cell count out of date"
        slots = np.flatnonzero(self.end < INF)
        assert (self.end[slots] >= self.occ[slots]).all() and (self.dur[slots] > 0).all()

    def occupied_decoding(self, t: float) -> int:
        """Slots decoding at time t."""
        return int(((self.end < INF) & (self.occ <= t)).sum())

    def new_sessions(self, since: float) -> tuple[float, int]:
        """(tokens a second together, count) of the sessions admitted (not moved) since `since`."""
        new = (self.end < INF) & (self.occ >= since) & (self.t0 >= self.occ)
        return float((self.tok[new] / self.dur[new]).sum()), int(new.sum())

    def close_books(self) -> None:
        """Count the decode time of sessions still running at the horizon."""
        h = self.horizon_s
        live = (self.end < INF) & (self.occ < h)
        self.decode_slot_s += float((h - self.occ[live]).sum())
        self.decoded_tokens += float(self.context_tokens(np.flatnonzero(live), h).sum())
        self.trainer.run_until(h)
