"""The whole control-loop tick at 10,000 cells and 1,000,000 sessions (bench/scheduler_scale.py's
first part).

Timed: `Controller.tick(defer_sync=True)` — the reconcile tick the running scheduler runs
(scheduler/control/reconcile.py): leases, version progress and retirement, the fleet tally,
migrations' timeouts, flips, role alignment, the owners' report sweep, placement of waiting
requests, version catch-up, scoring and the planner's own flips, and its commits. Nothing is
left out but the fsync of the WAL that makes those commits durable: the running loop has a
worker thread do it after the tick (scheduler/control/durability.py), the loop serving requests
meanwhile, and the tick's commands reach the cells once it returns. That wait is timed apart
(`sync_p50_ms`, `sync_p99_ms`: from the tick's end until its effects ran) — the delay a cell
sees on top of the tick, not time the loop is held.

Between ticks (untimed) a simulated fleet moves through the store and the registry as the cells
would:

- a `churn` share of the cells sync, in a fixed rotation (cells that sync at a steady period,
  each once every 1/churn ticks; at 100 % every cell every tick): each syncs new KV blocks in
  use (the registry marks it) and its row is written (the store's triggers mark it) — what a
  cell that synced tokens or changed KV blocks looks like to the loop's change readers;
- 2 % of the cells also sync after finishing a few sessions, admitting new ones and decoding
  further (SQL on the requests table, committed as token syncs commit: not durably), the
  trainer runs up to 8 steps at once and the backlog of finished trajectories swings from
  empty to four batches and back every `SWING_TICKS` ticks (with jitter), so the planner flips
  cells both ways a few times a run;
- a syncing cell takes the commands queued for it (they travel in its sync's answer, as the
  protocol has it) and its sync reports their outcome: `set_role` as the cell's role,
  `load_version` as the version it serves; starts and aborts are taken (the requests' owners
  are the store's already: the bench runs the "reprefill" path, where a move changes the owner
  at once);
- every `PUBLISH_EVERY` ticks the trainer publishes a new weight version (every rollout cell
  is told to load it and reports it at its next sync; it becomes active when they all serve
  it, and the one before retires). At 10 % churn the loop sees the fleet's new versions over
  ten ticks, a tenth a tick, as a steadily syncing fleet reports them; at 100 % all at once.

GC: "shipped" steps the scheduler's GC policy after each tick, as the running loop does
(scheduler/contract/gcpolicy.py: the fleet's long-lived state frozen out of the automatic
collections, a full collection on a schedule, the young generation's threshold raised to 50,000); "automatic"
leaves CPython's collector as it is (nothing frozen, its default thresholds 700/10/10). Both are run and reported.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

from scheduler.contract.config.scheduler import MigrationConfig, SchedulerConfig
from scheduler.contract.protocol import (
    AbortCmd,
    LoadVersionCmd,
    SetRoleCmd,
    StartCmd,
    Summary,
    SuspendCmd,
)
from scheduler.control.controller import Controller
from scheduler.control.rates import TrainerDemand
from scheduler.store import Store

CAPACITY = 128
"""Sessions per rollout cell (1,000,000 sessions on ~9,000 rollout cells)."""
BATCH = 1024
TRAIN_RATE = BATCH / (32 * 3600.0)
SLOT_RATE = TRAIN_RATE / 9 / CAPACITY
"""Per-slot finish rate that puts the balance at about 10 % training cells."""
STEPS_AT_ONCE = 8
TOKENS_PER_SESSION = 20_000
BLOCK = 16
KV_BLOCKS = CAPACITY * TOKENS_PER_SESSION // BLOCK
FINISHED = 32 * BATCH
"""Of the session rows, finished ones (no live request): the trainer's backlog swings in them."""
SESSION_CHURN = 0.02
"""Share of the cells that also finish, admit and decode sessions between ticks."""
SWING_TICKS = 200
"""The backlog of finished trajectories swings from empty to `SWING_TOP` and back in this many
ticks (a triangle), so the planner flips cells both ways a few times a run, whatever the seed."""
SWING_TOP = 4 * BATCH
JITTER = BATCH // 8
"""...plus up to this much either way, drawn each tick."""
AUTO_THRESHOLDS = (700, 10, 10)
"""CPython's own collector thresholds (the "automatic" mode)."""
PUBLISH_EVERY = 100
"""Ticks between two published weight versions."""
CAPS = json.dumps({"kv_export": True, "block_size": BLOCK})
HOST = {"host": "trainer", "port": 29500}
_REQ = ("INSERT INTO requests(id, session_id, base, prompt_start, num_generated, params, cell_id, epoch, "
        "state, reason, created_at, updated_at) VALUES (?,?,?,0,?,'{}',?,1,'running',NULL,?,?)")
_SESSION = ("INSERT INTO sessions(id, state, length, segment_starts, created_at) "
            "VALUES (?, 'open', ?, '[0]', ?)")


def _spread(rng: random.Random, cells: list[str], sessions: int) -> dict[str, int]:
    """Sessions per rollout cell, even with some jitter, at most CAPACITY each."""
    out, left = {}, sessions
    for k, c in enumerate(cells):
        share = left // (len(cells) - k)
        out[c] = min(CAPACITY, max(0, share + rng.randint(-8, 8)))
        left -= out[c]
    return out


class StoreFleet:
    """A controller over a store with the fleet and its sessions, and the cells' side of it."""

    def __init__(self, path: str, cells: int, sessions: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ids = [f"cell-{i:05d}" for i in range(cells)]
        n_train = cells // 10
        self.store = Store(path)
        self.seq = 0
        self.role = {c: "training" if i < n_train else "rollout" for i, c in enumerate(self.ids)}
        self.version = dict.fromkeys(self.ids, 0)
        self.blocks = dict.fromkeys(self.ids, 0)
        self.held: dict[str, set[str]] = {c: set() for c in self.ids}
        """cell → the request ids it holds (reports)."""
        inflight = _spread(self.rng, self.ids[n_train:], sessions - FINISHED)
        now = time.time()
        with self.store.tx(durable=False):
            self.store.executemany(
                "INSERT INTO sessions(id, state, length, segment_starts, finish_seq, created_at) "
                "VALUES (?, 'finished', ?, '[0]', ?, ?)",
                [(f"f{j}", TOKENS_PER_SESSION, j + 1, now) for j in range(FINISHED)])
            self.store.executemany(
                "INSERT INTO cells(id, incarnation, state, generation, version, address, store_port, capabilities, "
                "kv_blocks_total, kv_blocks_used, max_running, history, trust) "
                "VALUES (?,?,?,1,0,?,1,?,?,0,?,'[]','verified')",
                [(c, f"inc-{c}", self.role[c], f"node{i // 8}:{20000 + i}", CAPS,
                  KV_BLOCKS, CAPACITY) for i, c in enumerate(self.ids)])
            for c, n in inflight.items():
                self._admit(c, n, now)
            self.store.execute("INSERT INTO versions(v, state, created_at, history, source) "
                               "VALUES (0, 'active', ?, '[]', ?)", (now, json.dumps(HOST)))
        cfg = SchedulerConfig(db_path=path, min_rollout_cells=1, lease_s=1e9, stall_timeout_s=1e9,
                              staleness_bound=40)
        self.ctl = Controller(self.store, cfg, MigrationConfig(path="reprefill"))
        self.ctl.register_version_host(HOST["host"], HOST["port"])
        self.ctl.rates.on_trainer_report(TrainerDemand(BATCH, max(1, cells // 10 // 128), 128, STEPS_AT_ONCE))
        self.ctl.rates.train_rate_per_cell_s = TRAIN_RATE
        self.ctl.rates.finishes, self.ctl.rates.occupied_slot_s = 1e6, 1e6 / SLOT_RATE
        for c in self.ids:
            self._sync(c)
        self.rotation = list(self.ids)
        self.rng.shuffle(self.rotation)
        self.turn = 0
        """Where the rotation of syncing cells goes on from."""
        self.waiting = 2 * BATCH
        self.published = 0
        self.ticks = 0

    def _admit(self, cell: str, n: int, now: float) -> None:
        first = self.seq
        self.seq += n
        ids = [f"s{j}" for j in range(first, self.seq)]
        self.store.executemany(_SESSION, [(s, TOKENS_PER_SESSION, now) for s in ids])
        ctx = [self.rng.randint(1000, TOKENS_PER_SESSION) for _ in ids]
        self.store.executemany(_REQ, [(f"r-{s}", s, t // 2, t - t // 2, cell, now, now) for s, t in zip(ids, ctx)])
        self.held[cell].update(f"r-{s}" for s in ids)

    def _sync(self, cell: str) -> None:
        """The cell's sync: its KV blocks in use, the version it serves, its role."""
        self.blocks[cell] += 1
        self.ctl.ctx.registry.renew(cell, 1e9, Summary(
            kv_blocks_used=self.blocks[cell] % KV_BLOCKS, kv_blocks_total=KV_BLOCKS, version=self.version[cell],
            role=self.role[cell], versions_held=[self.version[cell]], max_running=CAPACITY, block_size=BLOCK,
            inflight=len(self.held[cell]), request_ids=list(self.held[cell])))

    def sessions(self) -> int:
        return self.store.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]

    def answer(self, syncing: set[str]) -> None:
        """The syncing cells take their queued commands (a sync's answer carries them)."""
        live = self.ctl.ctx.registry.live
        for cid in syncing:
            entry = live.get(cid)
            if entry is None or not entry.commands:
                continue
            for cmd in self.ctl.ctx.registry.take(cid):
                if isinstance(cmd, SetRoleCmd):
                    self.role[cid] = cmd.role
                    if cmd.version is not None:
                        self.version[cid] = cmd.version
                elif isinstance(cmd, LoadVersionCmd):
                    self.version[cid] = cmd.version
                elif isinstance(cmd, StartCmd):  # it decodes: its first token lands
                    self.held[cid].add(cmd.request_id)
                    self.ctl.ownership.advanced(cmd.request_id, tokens=True)
                elif isinstance(cmd, (AbortCmd, SuspendCmd)):
                    self.held[cid].discard(cmd.request_id)

    def _due(self, share: float) -> list[str]:
        """The next `share` of the cells in the rotation (every cell once every 1/share ticks)."""
        n, order = int(share * len(self.ids)), self.rotation
        out = [order[(self.turn + k) % len(order)] for k in range(n)]
        self.turn = (self.turn + n) % len(order)
        return out

    def churn(self, share: float) -> None:
        """Between ticks: `share` of the cells sync (their rows change) and take their commands,
        a few more finish, admit and decode sessions and sync; the backlog swings."""
        now, st = time.time(), self.store
        self.ticks += 1
        if self.ticks % PUBLISH_EVERY == 0:
            self.published += 1
            self.ctl.publish_version(self.published, HOST)
        busy = [c for c in self.rng.sample(self.ids, int(SESSION_CHURN * len(self.ids))) if self.role[c] == "rollout"]
        syncing = set(self._due(share)) | set(busy)
        self.answer(syncing)
        with st.tx(durable=False):
            for c in busy:
                if self.role[c] == "rollout":
                    self._sessions(c, now)
            st.executemany("UPDATE cells SET kv_blocks_used=? WHERE id=?",
                           [(self.blocks[c] % KV_BLOCKS, c) for c in syncing])
        for c in syncing:
            self._sync(c)
        phase = (self.ticks % SWING_TICKS) / SWING_TICKS
        swing = SWING_TOP * (2 * phase if phase < 0.5 else 2 - 2 * phase)
        self.waiting = min(FINISHED, max(0, round(swing) + self.rng.randint(-JITTER, JITTER)))
        self.ctl.staleness.trajectory_cursor = FINISHED - self.waiting  # the trainer fetched the rest

    def _sessions(self, c: str, now: float) -> None:
        st = self.store
        live = [r[0] for r in st.execute("SELECT id FROM requests WHERE cell_id=? AND state='running' LIMIT 3", (c,))]
        done = live[: self.rng.randint(0, len(live))]
        st.executemany("UPDATE requests SET state='finished' WHERE id=?", [(r,) for r in done])
        self.held[c].difference_update(done)
        room = CAPACITY - self.store.owners.load_of(c)[0]
        self._admit(c, max(0, min(room, self.rng.randint(0, 3))), now)
        st.execute("UPDATE requests SET num_generated = num_generated + 16 WHERE cell_id=? AND state='running'", (c,))


def run_ticks(fleet: StoreFleet, share: float, ticks: int, shipped_gc: bool) -> dict:
    """`ticks` timed reconcile ticks after five warm-up ones, `share` of the cells changed
    before each; with the shipped GC policy stepped after each tick, or automatic GC."""
    times: list[float] = []
    syncs: list[float] = []
    flips0 = _flips(fleet)
    if not shipped_gc:
        gc.unfreeze()
        gc.set_threshold(*AUTO_THRESHOLDS)  # the shipped policy raised the young threshold
    for k in range(5 + ticks):
        fleet.churn(share)
        t0 = time.perf_counter()
        fleet.ctl.tick(defer_sync=True)  # as the running loop ticks: its commits' sync off the loop
        t1 = time.perf_counter()
        fleet.ctl.ctx.tail.settle()  # the cells hear of the tick once the WAL is synced
        t2 = time.perf_counter()
        if shipped_gc:
            fleet.ctl.gc_policy.step()  # as the running loop does after each tick
        if k >= 5:
            times.append((t1 - t0) * 1e3)
            syncs.append((t2 - t1) * 1e3)
    return {**_p(times, ""), **_p(syncs, "sync_"),
            "flips_per_tick": round((_flips(fleet) - flips0) / (5 + ticks), 2)}


def _p(ms: list[float], prefix: str) -> dict:
    ms = sorted(ms)
    return {f"{prefix}p50_ms": round(statistics.median(ms), 2),
            f"{prefix}p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2), f"{prefix}max_ms": round(ms[-1], 2)}


def _flips(fleet: StoreFleet) -> int:
    return fleet.store.execute("SELECT COUNT(*) FROM flips").fetchone()[0]


def gc_full_ms(fleet: StoreFleet) -> float:
    """The scheduled full collection (once every FULL_EVERY_S in production): its pause."""
    policy = fleet.ctl.gc_policy
    pauses: list[float] = []
    policy.observe, policy.last_full = pauses.append, float("-inf")
    policy.step()
    return round(pauses[0] * 1e3, 1)
