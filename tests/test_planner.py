"""The planner on plain snapshots: flip policy, cell choice, destinations (single and batched)."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.planner.destinations import (  # noqa: E402
    choose_destination,
    choose_destinations,
    move_seconds,
)
from scheduler.planner.plan import (  # noqa: E402
    choose_cells_to_flip,
    plan_flips,
    wanted_training_cells,
)
from scheduler.planner.types import (  # noqa: E402
    CellSummary,
    LinkCostModel,
    PlannerPolicy,
    RequestSummary,
    Snapshot,
)

B = 1024
FREE = PlannerPolicy(max_flip_fraction_per_tick=1.0, flip_into_room=False)
"""No per-tick limits: what the balance alone decides."""
SLOT_RATE = 1 / 7200.0  # one session per slot per 2 h
TRAIN_RATE = B / (32 * 3600.0)  # 1,024 sessions per 32 cell-hours


def cell(i, role="rollout", inflight=16, capacity=16, node=None, version=0, export=True,
         busy=False, tokens=0, blocks_free=None):
    free = (capacity - inflight) * 100 if blocks_free is None else blocks_free
    return CellSummary(i, node or f"n{i // 8}", role, version, inflight, capacity, free,
                       capacity * 100, 0, export, busy, tokens)


def snap(cells, waiting=0, steps=0, min_rollout=1, rate=SLOT_RATE, queued=10**6, **kw):
    return Snapshot(cells=tuple(cells), finished_waiting=waiting, batch_size=B,
                    training_in_progress=steps > 0, min_rollout_cells=min_rollout,
                    queued_sessions=queued, steps_in_progress=steps,
                    finish_rate_per_slot_s=rate, train_rate_per_cell_s=TRAIN_RATE, **kw)


# ------------------------------------------------------------------ flip policy

def test_balance_by_hand():
    # p = 16 / 7200 per rollout cell-second, q = 1024 / 115200: p / (p + q) = 0.2 exactly
    s = snap([cell(i) for i in range(10)], waiting=B)  # backlog at its target: no correction
    assert wanted_training_cells(s) == pytest.approx(2.0)
    # one batch above the target over the 8 h horizon (4 two-hour sessions) adds
    # (1024 / 28800) / (p + q) = 3.2 cells
    s2 = snap([cell(i) for i in range(100)], waiting=2 * B)
    assert wanted_training_cells(s2) == pytest.approx(20.0 + 3.2)


def test_flips_cheapest_cells_to_training():
    cells = [cell(i, tokens=1000 * (10 - i)) for i in range(10)]
    cells[0] = cell(0, inflight=0, tokens=0)  # empty: nothing to move
    s = snap(cells, waiting=B)
    d = plan_flips(s, FREE)
    assert [x.cell_id for x in d] == [0, 9]
    assert [x.cell_id for x in plan_flips(s)] == [0]  # default: 5% of the cells a tick, at least one
    assert all(x.to == "training" for x in d) and "want 2.0" in d[0].reason


def test_no_flip_before_anything_finished():
    s = snap([cell(i) for i in range(10)], waiting=0, rate=0.0)
    assert plan_flips(s) == []


def test_no_flip_to_training_without_a_ready_batch():
    # the balance wants 2 cells, but with no batch ready and no step running they would idle
    s = snap([cell(i) for i in range(10)], waiting=B - 1)
    assert wanted_training_cells(s) > 1.5
    assert plan_flips(s) == []


def test_never_below_min_rollout():
    s = snap([cell(i) for i in range(4)], waiting=50 * B, min_rollout=3)
    d = plan_flips(s)
    assert len(d) == 1
    assert choose_cells_to_flip(s, "training", 10) == [0]
    s0 = snap([cell(i) for i in range(3)], waiting=50 * B, min_rollout=3)
    assert plan_flips(s0) == [] and choose_cells_to_flip(s0, "training", 5) == []


def test_flips_idle_training_cells_back_only():
    cells = [cell(i) for i in range(6)] + [cell(6 + i, "training", inflight=0, busy=i < 2)
                                           for i in range(4)]
    s = snap(cells, waiting=0, steps=1)  # want (p*10 - 1024/3600)/(p+q) < 0 -> 0
    d = plan_flips(s, FREE)
    assert {x.cell_id for x in d} == {8, 9}  # the two idle ones, never a busy one
    assert all(x.to == "rollout" for x in d)


def test_deadband_holds():
    cells = [cell(i) for i in range(8)] + [cell(8, "training", inflight=0), cell(9, "training", inflight=0)]
    s = snap(cells, waiting=B, steps=1)  # want exactly 2, have 2
    assert plan_flips(s) == []
    # 160 sessions over the target add 160/28800/(p+q) = 0.5 cell: inside the one-cell deadband
    s_in = snap(cells, waiting=B + 160, steps=1)
    assert wanted_training_cells(s_in) == pytest.approx(2.5)
    assert plan_flips(s_in, FREE) == []
    s_out = snap(cells, waiting=B + 400, steps=1)  # 3.25 wanted: one more cell
    assert [x.to for x in plan_flips(s_out, FREE)] == ["training"]


def test_flip_into_room_limits_a_tick():
    # 20 full rollout cells and one with 16 free slots: room for one cell's sessions
    cells = [cell(i) for i in range(20)] + [cell(20, inflight=16, capacity=32)]
    s = snap(cells, waiting=40 * B)
    assert len(plan_flips(s, FREE)) == 20  # 21 flexible cells want 20 training, keep 1 rollout
    assert [x.cell_id for x in plan_flips(s, replace(FREE, flip_into_room=True))] == [0]
    # with no room at all, still one cell a tick (its sessions suspend) so a flip can progress
    full = [cell(i) for i in range(21)]
    assert len(plan_flips(snap(full, waiting=40 * B), replace(FREE, flip_into_room=True))) == 1


def test_choose_cells_to_flip_prefers_cheap_moves():
    cells = [cell(0, tokens=50_000), cell(1, tokens=10_000, export=False), cell(2, tokens=20_000)]
    # KV: 20k tokens * 96 KiB / 50 GB/s = 0.04 s; re-prefill of 10k tokens at 20k/s = 0.5 s
    assert choose_cells_to_flip(snap(cells, min_rollout=0), "training", 2) == [2, 0]
    tr = [cell(0, "training", inflight=0, busy=True), cell(1, "training", inflight=0)]
    assert choose_cells_to_flip(snap(tr), "rollout", 2) == [1, 0]
    assert choose_cells_to_flip(snap(tr), "rollout", 2, idle_only=True) == [1]
    # cells with a flip under way are neither picked nor counted toward the rollout floor
    assert choose_cells_to_flip(snap(cells, min_rollout=0), "training", 2, exclude={2}) == [0, 1]
    assert choose_cells_to_flip(snap(cells, min_rollout=1), "training", 3, exclude={2}) == [0]
    assert choose_cells_to_flip(snap(tr), "rollout", 2, exclude={1}) == [0]
    with pytest.raises(ValueError):
        choose_cells_to_flip(snap(tr), "down", 1)


# ------------------------------------------------------------------ destinations

def req(i=0, tokens=8000, version=0):
    return RequestSummary(i, tokens, version)


def test_destination_order_version_then_load_then_node():
    src = cell(0, inflight=3, node="a")
    cells = [src,
             cell(1, inflight=1, node="b", version=1),   # least loaded but other version
             cell(2, inflight=5, node="b"),
             cell(3, inflight=5, node="a"),              # same load as 2, same node as source
             cell(4, inflight=6, node="a")]
    d = choose_destination(snap(cells), 0, req())
    assert d.cell_id == 3 and d.path == "kv"
    assert d.seconds == pytest.approx(8000 * 96 * 1024 / 450e9)
    cells[3] = cell(3, inflight=7, node="a")
    d = choose_destination(snap(cells), 0, req())
    assert d.cell_id == 2 and d.seconds == pytest.approx(8000 * 96 * 1024 / 50e9)
    # no same-version room: the other version, by re-prefill on its weights
    only_other = [src, cells[1], cell(2, "training", inflight=0)]
    d = choose_destination(snap(only_other), 0, req())
    assert (d.cell_id, d.path) == (1, "reprefill")
    assert d.seconds == pytest.approx(8000 / 20000)


def test_destination_paths():
    cells = [cell(0, inflight=2, export=False), cell(1, inflight=0)]
    assert choose_destination(snap(cells), 0, req()).path == "reprefill"  # SGLang source
    full = [cell(0), cell(1), cell(2, "training", inflight=0), cell(3, "loading", inflight=0)]
    assert choose_destination(snap(full), 0, req()) .path == "suspend"
    assert choose_destination(snap(full), 0, req()).cell_id is None
    # a cell with a free slot but too few free KV blocks is skipped
    tight = [cell(0), cell(1, inflight=4, blocks_free=10), cell(2, inflight=9)]
    assert choose_destination(snap(tight), 0, req(tokens=8000)).cell_id == 2
    assert choose_destination(snap(tight), 0, req(tokens=100)).cell_id == 1
    # re-prefill wins when it is cheaper than the copy (a very slow link)
    slow = LinkCostModel(inter_node_bytes_per_s=1e6)
    d = choose_destination(snap([cell(0, node="a"), cell(1, inflight=0, node="b")]), 0, req(), slow)
    assert d.path == "reprefill"
    assert move_seconds(1000, False, "kv", slow) > move_seconds(1000, False, "reprefill", slow)


def test_kv_store_path_weighed_against_copy_and_reprefill():
    def sgl(i, store="s", **kw):
        return replace(cell(i, export=False, **kw), kv_store=store)

    r = req(tokens=8000)
    # two SGLang cells on one shared store: load from the store (cheaper than recomputing)
    assert choose_destination(snap([sgl(0), sgl(1, inflight=0)]), 0, r).path == "kv_store"
    # another store, no store, or another version: nothing to reuse
    assert choose_destination(snap([sgl(0), sgl(1, "t", inflight=0)]), 0, r).path == "reprefill"
    assert choose_destination(snap([sgl(0), sgl(1, None, inflight=0)]), 0, r).path == "reprefill"
    assert choose_destination(snap([sgl(0), sgl(1, inflight=0, version=1)]), 0, r).path == "reprefill"
    # a store slower than recomputing loses to re-prefill
    slow = LinkCostModel(store_bytes_per_s=1e6)
    d = choose_destination(snap([sgl(0), sgl(1, inflight=0)]), 0, r, slow)
    assert d.path == "reprefill" and d.seconds == move_seconds(8000, False, "reprefill", slow)
    # both ends export KV and share a store: the cheaper of the two KV paths
    both = [replace(cell(0), kv_store="s"), replace(cell(1, inflight=0), kv_store="s")]
    assert choose_destination(snap(both), 0, r).path == "kv"
    fast_store = LinkCostModel(store_bytes_per_s=1e15, store_hit_ratio=1.0)
    assert choose_destination(snap(both), 0, r, fast_store).path == "kv_store"
    # the cost: the share found in the store is read, the rest recomputed
    c = LinkCostModel(kv_bytes_per_token=1000, store_bytes_per_s=1e6, store_hit_ratio=0.75,
                      prefill_tokens_per_s=100.0)
    assert move_seconds(400, False, "kv_store", c) == pytest.approx(300 * 1e-3 + 100 / 100.0)
    with pytest.raises(ValueError, match="kv_store"):
        move_seconds(1, False, "carrier_pigeon")


def test_cheapest_rollout_counts_a_shared_store_as_cheaper_to_drain():
    cells = [cell(0, export=False, tokens=10_000), replace(cell(1, export=False, tokens=10_000), kv_store="s"),
             cell(2, export=False, tokens=10_000)]
    assert choose_cells_to_flip(snap(cells, min_rollout=2), "training", 1) == [1]


def test_batched_uses_up_room_and_keeps_input_order():
    cells = [cell(0), cell(1, inflight=15, blocks_free=9999), cell(2, inflight=14, blocks_free=9999),
             cell(3, inflight=15, blocks_free=9999)]
    moves = [(0, req(i, tokens=1000 * (i + 1))) for i in range(5)]
    out = choose_destinations(snap(cells), moves)
    placed = [d.cell_id for d in out]
    assert sorted(x for x in placed if x is not None) == [1, 2, 2, 3]
    assert placed[0] is None  # the smallest context is placed last and finds no room
    assert [d.path for d in out].count("suspend") == 1


def _reference(snapshot, moves, cost=LinkCostModel()):
    """Naive O(cells) per request, same order of preference, applied one after another."""
    cells = list(snapshot.cells)
    by_id = {c.cell_id: i for i, c in enumerate(cells)}
    sources = {s for s, _ in moves}
    out = [None] * len(moves)
    for k in sorted(range(len(moves)), key=lambda k: -moves[k][1].context_tokens):
        s, r = moves[k]
        src = cells[by_id[s]]
        need = -(-r.context_tokens // cost.block_size)
        ok = [c for c in cells if c.role == "rollout" and c.cell_id not in sources
              and c.inflight < c.capacity and c.kv_blocks_free > 0 and c.kv_blocks_free >= need]
        if not ok:
            out[k] = None
            continue
        best = min(ok, key=lambda c: (c.version != r.version, c.inflight,
                                       c.node != src.node if c.version == r.version else 0,
                                       by_id[c.cell_id]))
        out[k] = best.cell_id
        i = by_id[best.cell_id]
        cells[i] = replace(best, inflight=best.inflight + 1, kv_blocks_free=best.kv_blocks_free - need)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batched_matches_sequential_reference(seed):
    rnd = random.Random(seed)
    cells = [cell(i, role=rnd.choice(["rollout"] * 4 + ["training", "loading"]),
                  inflight=rnd.randint(0, 4), capacity=4, node=f"n{rnd.randint(0, 3)}",
                  version=rnd.randint(0, 1), blocks_free=rnd.choice([0, 200, 2000, 9000]))
             for i in range(40)]
    sources = rnd.sample(range(40), 4)
    moves = [(s, req(f"{s}-{j}", tokens=rnd.randint(1, 60) * 1000, version=rnd.randint(0, 1)))
             for s in sources for j in range(rnd.randint(1, 8))]
    got = choose_destinations(snap(cells), moves)
    want = _reference(snap(cells), moves)
    assert [d.cell_id for d in got] == want
    assert all(cells[c].role == "rollout" and c not in sources for c in want if c is not None)
    for d, (_s, r) in zip(got, moves):
        if d.cell_id is not None:
            same = cells[d.cell_id].version == r.version
            assert d.path == ("kv" if same else "reprefill")


# ------------------------------------------------------------------ measured rates, not constants

def test_rollout_rate_is_per_occupied_slot():
    # 80 % of the slots occupied: the rollout side produces 80 % of a full one, so the balance
    # gives training less: p = 0.8 * 16 / 7200, q = 1024 / 115200 -> T = N p / (p + q)
    cells = [cell(i) for i in range(100)]
    full = wanted_training_cells(snap(cells, waiting=B))
    part = wanted_training_cells(snap(cells, waiting=B, slot_occupancy=0.8))
    p, q = 0.8 * 16 / 7200, TRAIN_RATE
    assert full == pytest.approx(20.0)
    assert part == pytest.approx(100 * p / (p + q))


def test_backlog_horizon_follows_measured_durations():
    from scheduler.planner.plan import backlog_horizon_s

    pol = PlannerPolicy()
    cells = [cell(i) for i in range(10)]
    # two-hour sessions: 4 sessions = 8 h; two-minute sessions: 480 s, or 4 steps of 150 s
    assert backlog_horizon_s(snap(cells), pol) == pytest.approx(28800.0)
    minutes = snap(cells, rate=1 / 120.0, train_step_s=15.0)
    assert backlog_horizon_s(minutes, pol) == pytest.approx(480.0)
    assert backlog_horizon_s(snap(cells, rate=1 / 120.0, train_step_s=150.0), pol) == pytest.approx(600.0)
    assert backlog_horizon_s(snap(cells, rate=0.0), pol) == pol.backlog_horizon_s  # nothing measured


def test_backlog_is_corrected_no_faster_than_cells_can_move():
    # training-heavy: the balance wants 90 of 100 cells; the 10 rollout cells free
    # 10 / 7200 slots a second, so moving 90 cells' sessions takes 90 * 7200 / 10 s = 64,800 s,
    # longer than the 4-session horizon (28,800 s): a batch over the target adds less
    cells = [cell(i) for i in range(10)] + [cell(10 + i, "training", inflight=0) for i in range(90)]
    p = 16 * SLOT_RATE
    q = p / 9
    s = replace(snap(cells, waiting=2 * B), train_rate_per_cell_s=q)
    assert wanted_training_cells(s) == pytest.approx(90.0 + B / 64800.0 / (p + q))
    # a light training side moves fast: the session horizon stands (test_balance_by_hand)


def test_idle_training_cells_return_when_the_trainer_cannot_use_them():
    # the balance wants more training cells than there are, but no step runs and no batch is
    # ready: the idle ones decode instead of waiting
    cells = [cell(i) for i in range(6)] + [cell(6 + i, "training", inflight=0) for i in range(4)]
    s = snap(cells, waiting=B - 1, steps=0, rate=SLOT_RATE * 20)
    assert wanted_training_cells(s) > 4
    d = plan_flips(s, FREE)
    assert sorted(x.cell_id for x in d) == [6, 7, 8, 9] and all(x.to == "rollout" for x in d)
    # with a step running they stay (and the balance adds more)
    d = plan_flips(snap(cells, waiting=B - 1, steps=1, rate=SLOT_RATE * 20), FREE)
    assert d and all(x.to == "training" for x in d)


def test_one_update_at_a_time_bounds_the_useful_cells():
    # three ready batches but one RL update at a time: one step's width is all the trainer can use
    cells = [cell(i) for i in range(300)]
    s = snap(cells, waiting=3 * B, max_cells_per_step=50)
    assert len(plan_flips(s, FREE)) == 50
    s2 = snap(cells, waiting=3 * B, max_cells_per_step=50, max_concurrent_steps=3)
    assert len(plan_flips(s2, FREE)) > 50


def test_choose_destinations_in_order_serves_a_queue_oldest_first():
    """One free slot: by size the larger (younger) request takes it; in order, the oldest does."""
    cells = [cell(0, inflight=15), cell(1, inflight=16)]
    moves = [(None, RequestSummary("old", 100, 0)), (None, RequestSummary("young", 900, 0))]
    by_size = choose_destinations(snap(cells), moves)
    in_order = choose_destinations(snap(cells), moves, in_order=True)
    assert [d.cell_id for d in by_size] == [None, 0]
    assert [d.cell_id for d in in_order] == [0, None]
