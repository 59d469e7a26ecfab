"""Which live cell in a scoring role holds which weight version, kept by change.

The scoring pass asks, for each version with unscored tokens, which cells hold it (a cell's
summary's `versions_held`, while the cell is live, not down and in a scoring role). Walking the
fleet for that each pass cost a visit of every cell (10,000 at a time, five passes a second);
here a look re-reads only the cells the store's triggers (`Store.changes`) or the registry
(`Registry.watch`: admitted, dropped, a summary with other versions held, ...) named since the
last one, and all of them after a rolled-back transaction. Reads only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.control.looks import CellLooks

if TYPE_CHECKING:
    from scheduler.control.context import Context
    from scheduler.control.served import ServedVersions

SCORING_ROLES = ("rollout", "draining")
"""Cell states whose engine holds weights it can score with."""


class VersionHolders:
    def __init__(self, ctx: Context, served: ServedVersions) -> None:
        self.ctx = ctx
        self.served = served
        self.looks = CellLooks(ctx)
        self.held: dict[str, tuple[int, ...]] = {}
        """cell → the versions it holds (cells in a scoring role holding any)."""
        self.by_version: dict[int, set[str]] = {}

    def of(self, version: int) -> list[str]:
        """The cells holding `version`, in id order."""
        self._refresh()
        return sorted(self.by_version.get(version, ()))

    def _refresh(self) -> None:
        touched = self.looks.take()
        if touched is not None and not touched:
            return
        self.served.refresh()
        cells, registry = self.served.cells, self.ctx.registry
        for cid in (set(self.held) | set(cells)) if touched is None else touched:
            kept, s = cells.get(cid), registry.summary(cid)
            new = tuple(s.versions_held) if kept is not None and kept[0] in SCORING_ROLES and s is not None else ()
            old = self.held.get(cid, ())
            if new == old:
                continue
            for v in old:
                left = self.by_version[v]
                left.discard(cid)
                if not left:
                    del self.by_version[v]
            for v in new:
                self.by_version.setdefault(v, set()).add(cid)
            if new:
                self.held[cid] = new
            else:
                del self.held[cid]
