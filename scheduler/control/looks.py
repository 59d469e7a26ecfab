"""What a reader kept by change must look at again: the cells named since its last look.

Each of the tick's readers that keep a fleet-wide view by change (`snapshot.CellSummaries`,
`served.ServedVersions`, `tally.Tally`, `holders.VersionHolders`) takes, per look, the cells
the store's change log named (rows written) plus those the registry marked (admitted, dropped,
a summary that moved what readers keep); a rolled-back transaction since the last look means
the log may have lost names, so the reader starts over from every cell."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.control.context import Context


class CellLooks:
    def __init__(self, ctx: Context) -> None:
        self.changes = ctx.store.changes.reader()
        self.watched = ctx.registry.watch()
        self.rollbacks = -1
        """`Store.changes.rollbacks` at the last look (-1: never looked)."""

    def take(self) -> set[str] | None:
        """The cells to look at again (empty: none), or None: every cell (the first look, or a
        rollback since the last)."""
        touched: set[str] | None = self.changes.take() | self.watched
        self.watched.clear()
        if self.changes.rollbacks != self.rollbacks:
            self.rollbacks, touched = self.changes.rollbacks, None
        return touched
