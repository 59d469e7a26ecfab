"""Which live cell serves which weight version, kept by change instead of by scan.

`Versions.progress` (is a broadcast version served by every rollout cell?), `Versions.catch_up`
(which cells lag the target?), `Versions.serving` and the scoring's version holders used to walk
every cell of the fleet each tick: at 10,000 cells, with every cell syncing, that re-decoded
every cell row each tick. Here a refresh re-reads only the cells the store's triggers
(`Store.changes`) or the registry (`Registry.watch`: admitted, dropped, first seen, a new
version) named since the last one — all of them after a rolled-back transaction — and keeps:

- each live, not-down cell's (state, version served, seen), and which of them are verified;
- per version, the live cells serving it, and the seen rollout cells serving it (with their
  total), so "every rollout cell serves v" is one comparison;
- `dirty`: the cells whose kept values changed since its reader (`Versions.catch_up`) last
  emptied it.

Reads only.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from scheduler.control.looks import CellLooks

if TYPE_CHECKING:
    from scheduler.control.context import Context


_NONE: list[int] = []
"""No version loading (shared: never changed)."""


class ServedVersions:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.looks = CellLooks(ctx)
        self.cells: dict[str, tuple[str, int | None, bool]] = {}
        """live, not-down cell → (state, version it serves as last reported, seen)."""
        self.verified: set[str] = set()
        """Of `cells`, those whose trust is verified."""
        self.live_by_version: Counter[int | None] = Counter()
        """version → live cells serving it."""
        self.rollout_by_version: Counter[int | None] = Counter()
        """version → seen live cells in state rollout serving it."""
        self.rollout = 0
        """Seen live cells in state rollout."""
        self.loads: dict[str, list[int]] = {}
        """cell → the versions it last reported loading (empty lists left out)."""
        self.dirty: set[str] = set()
        """Cells whose (state, version, seen), trust or versions loading changed, or that left,
        since the reader (`Versions.catch_up`) last emptied this: a sync that moved only load (KV
        blocks, tokens) leaves a cell out, so a tick at full churn visits only the cells whose
        versions moved."""

    def refresh(self) -> None:
        touched = self.looks.take()
        if touched is not None and not touched:
            return
        # of the cells looked at, those with no row (down) or no live entry: what the loop leaves
        gone = set(self.cells) if touched is None else set(touched)
        live = self.ctx.registry.live
        cells, verified = self.cells, self.verified
        dirty, loads = self.dirty, self.loads
        for row in self.ctx.store.fleet.planning_rows(touched):  # not down
            cid, entry = row.cell_id, live.get(row.cell_id)
            if entry is None:
                continue
            gone.discard(cid)
            summary = entry.summary
            kept = (row.state, summary.version if summary is not None else row.version, entry.seen)
            load = summary.loading if summary is not None else _NONE
            if load != loads.get(cid, _NONE):  # a fetch began or ended: catch_up looks again
                if load:
                    loads[cid] = load
                else:
                    loads.pop(cid, None)
                dirty.add(cid)
            if cells.get(cid) == kept and (cid in verified) == (row.trust == "verified"):
                continue  # a sync that moved neither its state, version nor trust
            self._forget(cid)
            cells[cid] = kept
            self._count(kept, 1)
            if row.trust == "verified":
                verified.add(cid)
            dirty.add(cid)
        for cid in gone:
            if cid in cells:
                self._forget(cid)
                dirty.add(cid)
            loads.pop(cid, None)

    def _forget(self, cid: str) -> None:
        kept = self.cells.pop(cid, None)
        self.verified.discard(cid)
        if kept is not None:
            self._count(kept, -1)

    def _count(self, kept: tuple[str, int | None, bool], sign: int) -> None:
        state, version, seen = kept
        self.live_by_version[version] += sign
        if state == "rollout" and seen:
            self.rollout_by_version[version] += sign
            self.rollout += sign

    def all_rollout_serve(self, version: int) -> bool:
        """Every seen live rollout cell serves `version` (true of none)."""
        self.refresh()
        return self.rollout_by_version[version] == self.rollout

    def serving(self) -> dict[int, list[str]]:
        """version → live cells serving it (as last reported)."""
        self.refresh()
        out: dict[int, list[str]] = {}
        for cid, (_, v, _) in self.cells.items():
            if v is not None:
                out.setdefault(v, []).append(cid)
        return out

    def serves_any(self, version: int) -> bool:
        self.refresh()
        return self.live_by_version[version] > 0
