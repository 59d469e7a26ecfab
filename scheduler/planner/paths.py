"""What moving a request costs: a path's estimated seconds, and the cheapest path both ends
support (pure functions of the cells' and request's summaries and a `LinkCostModel`)."""

from __future__ import annotations

from scheduler.planner.types import CellSummary, Destination, LinkCostModel, RequestSummary

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


def cheapest_path(src: CellSummary | None, dst: CellSummary, req: RequestSummary,
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
