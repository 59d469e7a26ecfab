"""Where a restarted trainer resumes: the newest commit any cell (reconnected to its store)
or the checkpoint holds. Cells announce the state they hold (`protocol.holds_key`) when they
connect; a checkpoint's manifest names the commit it was written for."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from cells.training import protocol as P
from cells.training import state_files
from cells.transport.store import get_json

log = logging.getLogger("cellflip.training")


def find_committed(store, cells: list[str], checkpoint: Path | None, *, wait_s: float = 10.0
                   ) -> tuple[dict[str, Any], list[str], str | None] | None:
    """(commit, cells holding it, checkpoint path or None) of the newest committed state;
    None when nothing holds one (a fresh run). Waits up to `wait_s` for cells that hold state
    to reconnect (each sets its `alive` key when it does)."""
    ckpt = state_files.load_commit(checkpoint) if checkpoint is not None else None
    deadline = time.monotonic() + wait_s
    while True:
        held = {c: get_json(store, P.holds_key(c)) for c in cells if store.check([P.holds_key(c)])}
        alive = [c for c in cells if store.check([P.alive_key(c)])]
        if len(alive) == len(cells) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    best = max((h["commit"] for h in held.values()), key=lambda c: (c["version"], c["step"]), default=None)
    if ckpt is not None and (best is None or (ckpt["version"], ckpt["step"]) > (best["version"], best["step"])):
        best = ckpt
    if best is None:
        return None
    holders = [c for c, h in held.items() if h["tag"] == best["tag"]]
    path = str(checkpoint.resolve()) if ckpt is not None and ckpt["tag"] == best["tag"] else None
    log.info("resuming at version %s (step %s) from %s", best["version"], best["step"],
             holders or path)
    return best, holders, path
