"""`Placement`: the fleet's rollout room as an index the controller keeps between planner calls.

Built from a snapshot's cells in O(cells) and kept up to date from the cells whose summary
changed, it answers where requests go (scheduler/planner/destinations.py) and which rollout
cells are cheapest to flip away (scheduler/planner/plan.py) in O(log cells). Its placements use
up room in it: the planner's functions take one as an explicit argument (the controller's kept
one, scheduler/control/snapshot.py), and with none they build a fresh one (`placement_for`), so
a call without one is pure. A `Snapshot` never carries one.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Container, Iterable, Sequence
from collections.abc import Set as AbstractSet

from scheduler.planner.paths import DEFAULT_COST, cheapest_path, move_seconds
from scheduler.planner.types import (
    CellId,
    CellSummary,
    Destination,
    LinkCostModel,
    RequestSummary,
    Snapshot,
)


def placement_for(snapshot: Snapshot, placement: Placement | None) -> Placement:
    """`placement` when given (a caller's kept index over `snapshot.cells`: what is placed
    uses up room there), else a fresh one over the snapshot's cells (the call is then pure)."""
    return placement if placement is not None else Placement(snapshot.cells)


def _has_room(c: CellSummary, blocks: int = 1) -> bool:
    """A rollout cell with a free request slot and at least `blocks` free KV blocks."""
    return c.role == "rollout" and c.inflight < c.capacity and c.kv_blocks_free >= blocks


class Placement:
    """The fleet's rollout room, kept between placements: where requests go, and which rollout
    cells are cheapest to flip away.

    Built from a snapshot's cells in O(cells); `update` takes the cells whose summary changed
    (O(changed log cells)), so a controller that keeps one beside its snapshot places a request
    in O(log cells) instead of walking the fleet. Lazy heaps keyed by (in flight, position,
    stamp) per version, per (version, node) and for any version; an entry is live while its
    stamp is the position's. A placement uses up the destination's room here at once (later
    placements see it) until the cell's next summary replaces it: the summary read after the
    move was recorded, or, for a placement its caller did not carry out, the cell's next change
    (meanwhile the cell only looks one request fuller).
    """

    def __init__(self, cells: Sequence[CellSummary]) -> None:
        self.cells = list(cells)
        self.position: dict[CellId, int] = {c.cell_id: i for i, c in enumerate(self.cells)}
        n = len(self.cells)
        self.inflight, self.kv_free, self.cap, self.stamp = [0] * n, [0] * n, [0] * n, [0] * n
        self.rollout = sum(1 for c in self.cells if c.role == "rollout")
        self._heaps: dict[object, list[tuple[int, int, int]]] | None = None
        """Placement heaps: version → heap, (version, node) → heap, `ANY` → any version; built
        on first use."""
        self._flip: list[tuple[float, int, int, int]] | None = None
        """Rollout cells by the cost of moving their sessions out; built on first use."""
        self._flip_stamp = [0] * n
        self._sizes: dict[object, int] = {}
        """Each placement heap's length when it was last built or compacted."""
        self._versions = Counter(c.version for c in self.cells)
        """Cells per version: a version's heaps go once no cell has it (a long run publishes
        thousands of versions)."""

    # ------------------------------------------------------------------ upkeep
    def update(self, changed: Iterable[tuple[int, CellSummary]]) -> None:
        """The summaries at these positions changed (same cells, same positions)."""
        heaps, flip, fstamp = self._heaps, self._flip, self._flip_stamp
        versions = self._versions
        for i, c in changed:
            old = self.cells[i]
            self.rollout += (c.role == "rollout") - (old.role == "rollout")
            if old.version != c.version:
                versions[c.version] += 1
                versions[old.version] -= 1
                if not versions[old.version]:
                    del versions[old.version]
                    self._drop_version(old.version)
            self.cells[i] = c
            if heaps is not None and self._same_slot(i, old, c):
                self.kv_free[i], self.cap[i] = c.kv_blocks_free, c.capacity  # its live entry stands
            else:
                self.stamp[i] += 1
                if heaps is not None:
                    self._load(i, c, heaps)
            if (flip is not None and old.role == c.role == "rollout" and old.inflight == c.inflight
                    and ((old.inflight_tokens == c.inflight_tokens and old.can_export_kv == c.can_export_kv
                          and old.kv_store == c.kv_store) or _flip_cost(old) == _flip_cost(c))):
                continue  # its live flip entry stands (the same cost inputs: the same cost)
            fstamp[i] += 1
            if flip is not None and c.role == "rollout":
                heapq.heappush(flip, (_flip_cost(c), c.inflight, i, fstamp[i]))
        if flip is not None and len(flip) > 2 * self.rollout + COMPACT_SLACK:
            flip[:] = [e for e in flip if e[3] == fstamp[e[2]]]
            heapq.heapify(flip)

    def _same_slot(self, i: int, old: CellSummary, c: CellSummary) -> bool:
        """Position `i`'s live heap entry stays right for `c`: same version, node and requests
        in flight, with room before (so the entry was not dropped as full) and after. Only its
        free blocks and slots change (a sync that moved KV blocks: most of a busy fleet's)."""
        return (old.version == c.version and old.node == c.node and self.inflight[i] == c.inflight
                and self.inflight[i] < self.cap[i] and self.kv_free[i] > 0 and _has_room(c))

    def _drop_version(self, version: int) -> None:
        """No cell has `version` any more: its heaps hold only dead entries."""
        if self._heaps is not None:
            for key in [k for k in self._heaps if k == version or (isinstance(k, tuple) and k[0] == version)]:
                del self._heaps[key]
                self._sizes.pop(key, None)

    def warm(self) -> Placement:
        """Build both heaps now (a kept index: its first placement then costs no fleet pass)."""
        self._placement_heaps()
        self._flip_heap()
        return self

    def _load(self, i: int, c: CellSummary, heaps: dict) -> None:
        """Position `i`'s room from its summary; one live entry when it has room."""
        room = _has_room(c)
        self.inflight[i] = c.inflight
        self.kv_free[i] = c.kv_blocks_free if room else 0
        self.cap[i] = c.capacity if room else 0
        if room:
            self._push(i, heaps)

    def _push(self, i: int, heaps: dict) -> None:
        c, entry = self.cells[i], (self.inflight[i], i, self.stamp[i])
        for key in (c.version, (c.version, c.node), ANY):
            h = heaps.get(key)
            if h is None:
                h = heaps[key] = []
            heapq.heappush(h, entry)
            if len(h) > 2 * self._sizes.get(key, 0) + COMPACT_SLACK:  # mostly dead entries: drop them
                stamp = self.stamp
                h[:] = [e for e in h if e[2] == stamp[e[1]]]
                heapq.heapify(h)
                self._sizes[key] = len(h)

    def _placement_heaps(self) -> dict:
        heaps = self._heaps
        if heaps is None:
            heaps = {}
            for i, c in enumerate(self.cells):  # O(cells), once per build
                room = _has_room(c)
                self.inflight[i], self.kv_free[i], self.cap[i] = (
                    (c.inflight, c.kv_blocks_free, c.capacity) if room else (c.inflight, 0, 0))
                if room:
                    entry = (c.inflight, i, self.stamp[i])
                    heaps.setdefault(c.version, []).append(entry)
                    heaps.setdefault((c.version, c.node), []).append(entry)
                    heaps.setdefault(ANY, []).append(entry)
            for h in heaps.values():
                heapq.heapify(h)
            self._heaps = heaps
            self._sizes = {key: len(h) for key, h in heaps.items()}
        return heaps

    def room_for(self, cell_id: CellId, context_tokens: int, cost: LinkCostModel = DEFAULT_COST) -> CellSummary | None:
        """The cell when it is a rollout cell with a free slot and the blocks for
        `context_tokens` (at least one), counting this index's placements; else None."""
        i = self.position.get(cell_id)
        if i is None:
            return None
        c = self.cells[i]
        need = max(1, -(-context_tokens // cost.block_size))
        if self._heaps is None:
            ok = _has_room(c, need)
        else:
            ok = self.inflight[i] < self.cap[i] and self.kv_free[i] >= need
        return c if ok else None

    def place(self, moves: Sequence[tuple[CellId | None, RequestSummary]], cost: LinkCostModel = DEFAULT_COST,
              in_order: bool = False, only: Container[CellId] | None = None) -> list[Destination]:
        """`choose_destinations` on this index: each destination's room is used up here. With
        `only`, no cell outside it is a destination (a job's own cells: O(cells) for the mask)."""
        heaps = self._placement_heaps()
        position, kv_free, cap, stamp = self.position, self.kv_free, self.cap, self.stamp
        sources = {position[s]: 0 for s, _ in moves if s is not None and s in position}
        if only is not None:
            sources.update((i, 0) for cid, i in position.items() if cid not in only)
        for i in sources:  # never a destination in this call: no room here until the end
            sources[i], cap[i] = cap[i], 0
        try:
            return self._place(moves, cost, in_order, heaps)
        finally:
            for i, room in sources.items():
                cap[i] = room
                stamp[i] += 1
                if self.inflight[i] < room and kv_free[i] > 0:
                    self._push(i, heaps)

    def _place(self, moves: Sequence[tuple[CellId | None, RequestSummary]], cost: LinkCostModel,
               in_order: bool, heaps: dict) -> list[Destination]:
        """The planner's hot loop, kept as one function on purpose: its heaps and per-cell
        arrays are locals a split would have to pass around."""
        cells, position = self.cells, self.position
        inflight, kv_free, cap, stamp = self.inflight, self.kv_free, self.cap, self.stamp
        heappush, heappop = heapq.heappush, heapq.heappop
        stash: list[tuple[list[tuple[int, int, int]], tuple[int, int, int]]] = []

        def top(heap: list[tuple[int, int, int]], need: int) -> tuple[int, int, int] | None:
            """Least-loaded cell of `heap` with room for `need` blocks; drops dead entries and
            sets aside (in `stash`) cells too full for this request only."""
            while heap:
                f, i, s = heap[0]
                if s != stamp[i] or f >= cap[i] or kv_free[i] <= 0:
                    heappop(heap)  # dead: a fresher entry was pushed, or the cell is full
                elif kv_free[i] < need:
                    stash.append((heap, heappop(heap)))
                else:
                    return heap[0]
            return None

        out: list[Destination | None] = [None] * len(moves)
        block, headroom, any_heap = cost.block_size, cost.headroom_blocks, heaps.get(ANY)
        tokens = [-r.context_tokens for _, r in moves]
        for k in range(len(moves)) if in_order else sorted(range(len(moves)), key=tokens.__getitem__):
            src_id, req = moves[k]
            si = position.get(src_id) if src_id is not None else None
            src = cells[si] if si is not None else None
            need = -(-req.context_tokens // block) + headroom
            heap = heaps.get(req.version) if req.version is not None else None
            pick = top(heap, need) if heap else None
            if pick is not None and src is not None:
                near_heap = heaps.get((req.version, src.node))
                near = top(near_heap, need) if near_heap else None
                if near is not None and near[0] <= pick[0]:
                    pick = near
            if pick is None and any_heap:
                pick = top(any_heap, need)
            for h, entry in stash:
                heappush(h, entry)
            stash.clear()
            if pick is None:
                out[k] = Destination(None, "suspend")
                continue
            d = pick[1]
            out[k] = cheapest_path(src, cells[d], req, cost)
            inflight[d] += 1
            kv_free[d] -= need
            stamp[d] += 1
            if inflight[d] < cap[d] and kv_free[d] > 0:
                self._push(d, heaps)
        return out  # type: ignore[return-value]

    def cheapest_rollout(self, count: int, exclude: AbstractSet[CellId] = frozenset(), keep: int = 0) -> list[int]:
        """Positions of up to `count` rollout cells not in `exclude`, cheapest to drain first
        (fewest seconds of in-flight work to move), leaving at least `keep` rollout cells.
        O(count log cells) once the heap stands."""
        cells = self.cells
        excluded = sum(1 for e in exclude if (i := self.position.get(e)) is not None and cells[i].role == "rollout")
        count = min(count, self.rollout - excluded - keep)
        if count <= 0:
            return []
        flip, fstamp = self._flip_heap(), self._flip_stamp
        out: list[int] = []
        kept: list[tuple[float, int, int, int]] = []
        while flip and len(out) < count:
            entry = heapq.heappop(flip)
            i = entry[2]
            if entry[3] != fstamp[i]:
                continue  # dead: the cell changed since
            kept.append(entry)
            if cells[i].cell_id not in exclude:
                out.append(i)
        for entry in kept:
            heapq.heappush(flip, entry)
        return out

    def _flip_heap(self) -> list[tuple[float, int, int, int]]:
        flip = self._flip
        if flip is None:
            fs = self._flip_stamp
            flip = self._flip = [(_flip_cost(c), c.inflight, i, fs[i]) for i, c in enumerate(self.cells)
                                 if c.role == "rollout"]
            heapq.heapify(flip)
        return flip


ANY = "*"
"""The key of the any-version placement heap."""
COMPACT_SLACK = 256
"""A heap is compacted (its dead entries dropped) once it holds twice its live size plus this."""
_PER_TOKEN = {path: move_seconds(1, False, path) for path in ("kv", "kv_store", "reprefill")}


def _flip_cost(c: CellSummary) -> float:
    """Seconds of in-flight work to move off a cell: its context tokens by its cheapest path."""
    path = "kv" if c.can_export_kv else "kv_store" if c.kv_store else "reprefill"
    return c.inflight_tokens * _PER_TOKEN[path]
