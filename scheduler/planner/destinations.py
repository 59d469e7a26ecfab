"""Where moved and new requests go: pure functions of a `Snapshot`.

    choose_destination(snapshot, source, request)    -> Destination     one migration
    choose_destinations(snapshot, moves)             -> [Destination]   a whole drain, one heap pass
    move_seconds(context_tokens, same_node, path)    -> float           a path's estimated cost

A destination is a rollout cell with room, same version first (a KV copy needs the version the
KV was computed with), then fewest in flight, then the source's node; the path is a KV copy when
both ends can and it is cheaper than a re-prefill.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from scheduler.planner.types import (
    CellId,
    CellSummary,
    Destination,
    LinkCostModel,
    RequestSummary,
    Snapshot,
)

DEFAULT_COST = LinkCostModel()


def move_seconds(context_tokens: int, same_node: bool, path: str,
                 cost: LinkCostModel = DEFAULT_COST) -> float:
    """Estimated seconds to move a request by `path`: 'kv' (cell-to-cell copy), 'kv_store'
    (the destination loads the share of the context the shared store holds and recomputes
    the rest) or 'reprefill' (the destination recomputes it all)."""
    if path == "kv":
        bw = cost.intra_node_bytes_per_s if same_node else cost.inter_node_bytes_per_s
        return context_tokens * cost.kv_bytes_per_token / bw
    if path == "kv_store":
        hit = cost.store_hit_ratio
        return context_tokens * (hit * cost.kv_bytes_per_token / cost.store_bytes_per_s
                                 + (1.0 - hit) / cost.prefill_tokens_per_s)
    if path == "reprefill":
        return context_tokens / cost.prefill_tokens_per_s
    raise ValueError(f"path must be 'kv', 'kv_store' or 'reprefill', got {path!r}")


def choose_destination(snapshot: Snapshot, source_cell_id: CellId | None, request: RequestSummary,
                       cost: LinkCostModel = DEFAULT_COST) -> Destination:
    """Where one request goes: a rollout cell with room, same version first, then fewest in
    flight, then same node; by KV copy when both ends can and it is cheaper than re-prefill.
    `source_cell_id` None places a new or suspended request. Pure."""
    return choose_destinations(snapshot, [(source_cell_id, request)], cost)[0]


def choose_destinations(snapshot: Snapshot,
                        moves: Sequence[tuple[CellId | None, RequestSummary]],
                        cost: LinkCostModel = DEFAULT_COST, in_order: bool = False) -> list[Destination]:
    """Place many requests in one pass; earlier placements use up room for later ones.

    Larger contexts are placed first (they gain most from a same-version KV copy); with
    `in_order`, in the order of `moves` (a queue served oldest first). Source
    cells are never destinations. Lazy heaps keyed by (inflight, index) per version and per
    (version, node): O((cells + moves) log cells). Results are in the order of `moves`. Pure.

    The planner's hot loop, kept as one function on purpose: a drain of thousands of requests
    over a fleet of thousands of cells runs it inside one scheduler tick, and its heaps and
    per-cell arrays are locals a split would have to pass around or rebuild per call.
    """
    cells = snapshot.cells
    src_ids = {s for s, _ in moves if s is not None}
    index: dict[CellId, int] = {c.cell_id: i for i, c in enumerate(cells) if c.cell_id in src_ids}
    src_nodes = {cells[i].node for i in index.values()}
    n = len(cells)
    inflight = [0] * n
    kv_free = [0] * n
    cap = [0] * n
    by_v: dict[int, list[tuple[int, int]]] = {}
    by_vn: dict[tuple[int, str], list[tuple[int, int]]] = {}  # only the sources' nodes
    last_v, heap = None, []
    for i, c in enumerate(cells):  # O(cells): the cost of a call with few moves
        if c.role != "rollout":
            continue
        f, cp, kf = c.inflight, c.capacity, c.kv_blocks_free
        if f >= cp or kf <= 0 or c.cell_id in src_ids:
            continue
        inflight[i], kv_free[i], cap[i] = f, kf, cp
        v = c.version
        if v != last_v:
            heap = by_v.setdefault(v, [])
            last_v = v
        heap.append((f, i))
        if c.node in src_nodes:
            by_vn.setdefault((v, c.node), []).append((f, i))
    # one version (the usual case): the any-version heap is that version's heap
    any_v = next(iter(by_v.values())) if len(by_v) == 1 else [e for h in by_v.values() for e in h]
    for h in (*by_v.values(), *by_vn.values()):
        heapq.heapify(h)
    if len(by_v) != 1:
        heapq.heapify(any_v)
    heappush, heappop = heapq.heappush, heapq.heappop
    stash: list[tuple[list[tuple[int, int]], tuple[int, int]]] = []

    def top(heap: list[tuple[int, int]], need: int) -> tuple[int, int] | None:
        """Least-loaded cell of `heap` with room for `need` blocks; drops stale entries and
        sets aside (in `stash`) cells too full for this request but not for smaller ones."""
        while heap:
            f, i = heap[0]
            if f != inflight[i] or f >= cap[i] or kv_free[i] <= 0:
                heappop(heap)  # stale: a fresher entry was pushed, or the cell is full
            elif kv_free[i] < need:
                stash.append((heap, heappop(heap)))
            else:
                return heap[0]
        return None

    out: list[Destination | None] = [None] * len(moves)
    block, headroom = cost.block_size, cost.headroom_blocks
    tokens = [-r.context_tokens for _, r in moves]
    for k in range(len(moves)) if in_order else sorted(range(len(moves)), key=tokens.__getitem__):
        src_id, req = moves[k]
        si = index.get(src_id)
        src = cells[si] if si is not None else None
        need = -(-req.context_tokens // block) + headroom
        heap = by_v.get(req.version)
        pick = top(heap, need) if heap else None
        if pick is not None and src is not None:
            near_heap = by_vn.get((req.version, src.node))
            near = top(near_heap, need) if near_heap else None
            if near is not None and near[0] <= pick[0]:
                pick = near
        if pick is None:
            pick = top(any_v, need)
        if stash:
            for h, entry in stash:
                heappush(h, entry)
            stash.clear()
        if pick is None:
            out[k] = Destination(None, "suspend")
            continue
        d = pick[1]
        dst = cells[d]
        out[k] = _path(src, dst, req, cost)
        inflight[d] += 1
        kv_free[d] -= need
        if inflight[d] < cap[d] and kv_free[d] > 0:
            entry = (inflight[d], d)
            h = by_v[dst.version]
            heappush(h, entry)
            if h is not any_v:
                heappush(any_v, entry)
            h = by_vn.get((dst.version, dst.node))
            if h is not None:
                heappush(h, entry)
    return out  # type: ignore[return-value]


def _path(src: CellSummary | None, dst: CellSummary, req: RequestSummary,
          cost: LinkCostModel) -> Destination:
    """The cheapest path both ends support: a KV copy (both engines export KV), a load from a
    shared KV store (both use the same one), or re-prefill. KV is reused only under the
    version it was computed with, so both KV paths need the request's version at the
    destination. Ties go to the earlier path in that order."""
    tokens = req.context_tokens
    best = Destination(dst.cell_id, "reprefill", move_seconds(tokens, False, "reprefill", cost))
    if src is None or req.version != dst.version:
        return best
    same_node = src.node == dst.node
    if src.kv_store is not None and src.kv_store == dst.kv_store:
        s = move_seconds(tokens, same_node, "kv_store", cost)
        if s <= best.seconds:
            best = Destination(dst.cell_id, "kv_store", s)
    if src.can_export_kv and dst.can_export_kv:
        s = move_seconds(tokens, same_node, "kv", cost)
        if s <= best.seconds:
            best = Destination(dst.cell_id, "kv", s)
    return best
