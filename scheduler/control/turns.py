"""What a cell is sent to start a request: the whole context, or on a sticky turn what is new.

One line: the session's previous request ended on this cell in this segment → `StartCmd` with
the prefix's length and digest (scheduler/store/context.py, caught up from the new tokens
only) and the tokens after it; otherwise, or when the cell answers `PrefixMissingEvent`, the
whole context from the store. The cell checks the digest against its own (cells/agent/held.py)
before it starts anything, so a delta start is token-exact or not started at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.contract.protocol import StartCmd

if TYPE_CHECKING:
    from scheduler.store.db import Store
    from scheduler.store.owners import RequestRow


def held_prefix(store: Store, req: RequestRow, cell_id: str) -> tuple[int, str] | None:
    """(length, digest) of the segment's tokens `cell_id` should hold for `req`: the session's
    previous request finished there, in this segment, having been started there (not carried
    in by a KV copy). None when a full start is due."""
    if req.num_generated:
        return None  # a resumed request: its own tokens are news to any cell
    prev = store.context.previous_request(req.session_id, req.id)
    if prev is None:
        return None
    cell, state, prompt_start, end, by_kv = prev
    if cell != cell_id or state != "finished" or prompt_start != req.prompt_start or not prompt_start < end <= req.base:
        return None
    if by_kv:  # a KV copy carried the request there, not a start: the cell holds no context of it
        return None
    h = store.context.segment_hash(req.session_id, req.prompt_start, end)
    return end - req.prompt_start, h.digest()


def start_command(store: Store, req: RequestRow, cell_id: str, path: str | None,
                  full: bool = False) -> tuple[Callable[[int], StartCmd], bool]:
    """The `start` for `req` on `cell_id` (a command id → command), and whether it is a delta
    start: one when the cell should hold the session's prefix (a request placed afresh, not
    `full`), else the whole context."""
    held = None if full or path is not None else held_prefix(store, req, cell_id)
    prefix_len, digest = held if held is not None else (0, None)
    first = req.prompt_start + prefix_len
    token_ids = store.sessions.token_ids(req.session_id, first, req.base + req.num_generated)
    prompt_len = req.base - req.prompt_start
    rid, epoch, sid, n, params = req.id, req.epoch, req.session_id, req.num_generated, req.sampling()
    return lambda i: StartCmd(i, rid, epoch, sid, token_ids, prompt_len, n, params, path, prefix_len, digest), held is not None
