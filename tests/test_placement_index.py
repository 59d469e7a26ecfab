"""The kept placement index (`room.Placement`): after any run of summary updates and
placements it places exactly as a fresh index over the same cells, and as the naive reference."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.planner.destinations import choose_destinations  # noqa: E402
from scheduler.planner.plan import choose_cells_to_flip  # noqa: E402
from scheduler.planner.room import Placement  # noqa: E402
from tests.test_planner import _reference, cell, req, snap  # noqa: E402

ROLES = ["rollout"] * 5 + ["training", "loading", "draining"]


def _random_cell(rnd: random.Random, i: int):
    return cell(i, role=rnd.choice(ROLES), inflight=rnd.randint(0, 4), capacity=4, node=f"n{rnd.randint(0, 3)}",
                version=rnd.randint(0, 1), blocks_free=rnd.choice([0, 200, 2000, 9000]),
                tokens=rnd.randint(0, 50_000))


def _changed(rnd: random.Random, cells: list, k: int) -> list:
    """k random cells changed: load, role, version or blocks."""
    out = []
    for i in rnd.sample(range(len(cells)), k):
        c = _random_cell(rnd, i)
        cells[i] = c
        out.append((i, c))
    return out


def _evolving(seed: int, n: int, rounds: int, churn: int):
    """A kept index over `n` random cells, yielded after each round of up to `churn` changes
    (with the random source and the current cells)."""
    rnd = random.Random(seed)
    cells = [_random_cell(rnd, i) for i in range(n)]
    kept = Placement(cells)
    for _ in range(rounds):
        kept.update(_changed(rnd, cells, rnd.randint(0, churn)))
        yield rnd, cells, kept


@pytest.mark.parametrize("seed", range(8))
def test_kept_index_places_as_a_fresh_one_after_updates(seed):
    for rnd, cells, kept in _evolving(seed, 60, 12, 15):
        sources = [i for i in rnd.sample(range(60), 3)]
        moves = [(s, req(f"{s}-{j}", tokens=rnd.randint(1, 60) * 1000, version=rnd.randint(0, 1)))
                 for s in sources for j in range(rnd.randint(0, 6))]
        got = kept.place(moves)
        fresh = choose_destinations(snap(cells), moves)
        assert [(d.cell_id, d.path) for d in got] == [(d.cell_id, d.path) for d in fresh]
        assert [d.cell_id for d in got] == _reference(snap(cells), moves)
        # the store records the placements: the next summaries carry them
        bumped = {}
        for d, (_s, r) in zip(got, moves):
            if d.cell_id is not None:
                c = bumped.get(d.cell_id, cells[d.cell_id])
                bumped[d.cell_id] = replace(c, inflight=c.inflight + 1,
                                            kv_blocks_free=c.kv_blocks_free - -(-r.context_tokens // 16))
        for i, c in bumped.items():
            cells[i] = c
        kept.update(bumped.items())
        if rnd.random() < 0.3:  # a caller that did not carry its placements out: the next change heals it
            kept.update((i, cells[i]) for i in range(len(cells)))


def test_placements_use_up_room_across_calls_until_the_next_summary():
    cells = [cell(0, inflight=3, capacity=4), cell(1, inflight=3, capacity=4), cell(2, inflight=2, capacity=4)]
    kept = Placement(cells)
    first = [kept.place([(None, req(f"a{j}", tokens=100))])[0].cell_id for j in range(4)]
    assert first == [2, 0, 1, 2]  # fewest in flight first, ties by position: every slot taken
    assert kept.place([(None, req("b", tokens=100))])[0].path == "suspend"
    assert kept.room_for(2, 100) is None
    kept.update([(2, cells[2])])  # the store says cell 2 still has its two free slots
    assert kept.room_for(2, 100) == cells[2]
    assert kept.place([(None, req("c", tokens=100))])[0].cell_id == 2


@pytest.mark.parametrize("seed", range(6))
def test_kept_flip_choice_matches_a_fresh_one(seed):
    for rnd, cells, kept in _evolving(seed, 80, 10, 20):
        exclude = frozenset(rnd.sample(range(80), 5))
        count = rnd.randint(1, 30)
        got = kept.cheapest_rollout(count, exclude, keep=2)
        rollout = sorted((c.inflight_tokens, c.inflight, i) for i, c in enumerate(cells)
                         if c.role == "rollout" and i not in exclude)
        want = [i for _, _, i in rollout[: max(0, min(count, len(rollout) - 2))]]
        assert got == want
        assert choose_cells_to_flip(snap(cells, min_rollout=2), "training", count, exclude=exclude, placement=kept) \
            == choose_cells_to_flip(snap(cells, min_rollout=2), "training", count, exclude=exclude) == want


def test_a_version_no_cell_has_leaves_no_heaps_behind():
    cells = [cell(i, inflight=1, capacity=4, node=f"n{i % 3}") for i in range(12)]
    kept = Placement(cells).warm()
    for v in range(1, 60):  # the fleet moves through many versions, one cell at a time
        for i in range(12):
            cells[i] = replace(cells[i], version=v)
            kept.update([(i, cells[i])])
    assert {k for k in kept._heaps if k != "*"} == {59, *((59, f"n{j}") for j in range(3))}
    got = kept.place([(None, req("x", tokens=100, version=59))])
    assert got == choose_destinations(snap(cells), [(None, req("x", tokens=100, version=59))])
