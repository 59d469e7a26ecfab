"""Weight exports: a committed version written as a Hugging Face directory by a cell that holds
it (`cellflip export-weights`, POST /v1/versions/{v}/exports).

The trainer is not asked: the version is taken from a verified live cell that holds it (its
summary's `versions_held`), which writes it below its `cells.export_root` on a thread of its
own and answers with an `exported` event. Exports are kept in this process's memory (the
newest MAX_KEPT): after a scheduler restart an unknown export id is a 404 and the export can
be asked again (an existing directory is never overwritten: the cell then answers why). An
export whose cell went down before answering fails with that reason.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict, Invalid, NotFound
from scheduler.contract.exports import DTYPES, check_export_path
from scheduler.contract.protocol import ExportCmd, ExportedEvent

if TYPE_CHECKING:
    from scheduler.control.context import Context, Effects
    from scheduler.control.trust import Trust

MAX_KEPT = 1024
HOLDER_STATES = ("rollout", "draining", "training")


@dataclass
class Export:
    id: str
    version: int
    path: str
    dtype: str
    cell: str
    state: str = "pending"
    """pending | done | failed"""
    reason: str = ""
    written_to: str = ""
    bytes: int = 0
    seconds: float = 0.0
    created_at: float = 0.0


class Exports:
    def __init__(self, ctx: Context, trust: Trust) -> None:
        self.ctx, self.trust = ctx, trust
        self.exports: OrderedDict[str, Export] = OrderedDict()

    def holders(self, version: int) -> list[str]:
        """Verified live cells whose last summary holds `version`."""
        out = []
        for c in self.ctx.store.fleet.list_cells():
            s = self.ctx.registry.summary(c.id)
            held = s is not None and (version in s.versions_held or s.version == version)
            if c.state in HOLDER_STATES and held and self.trust.counts(c.id, c):
                out.append(c.id)
        return out

    def start(self, version: int, path: str, dtype: str = "float32") -> dict[str, Any]:
        why = check_export_path(path)
        if why is not None:
            raise Invalid(why, code="bad_export_path")
        if dtype not in DTYPES:
            raise Invalid(f"dtype {dtype!r} is not one of {list(DTYPES)}", code="bad_dtype")
        holders = self.holders(version)
        if not holders and self.ctx.store.fleet.get_version(version) is None:
            raise NotFound(f"unknown version {version}")  # (the cells' start weights are held, never published)
        if not holders:
            raise Conflict(f"no live verified cell holds version {version} (a retired version is kept only by "
                           "its exports and checkpoints)", code="version_not_held")
        # the holder with the fewest exports in flight
        busy = {h: sum(e.cell == h and e.state == "pending" for e in self.exports.values()) for h in holders}
        cell = min(holders, key=lambda h: (busy[h], h))
        ex = Export(f"exp-{uuid.uuid4().hex[:12]}", version, path, dtype, cell, created_at=time.time())
        with self.ctx.txn(durable=False) as fx:
            eid = ex.id
            fx.send(cell, lambda i: ExportCmd(i, eid, version, path, dtype))
        self.exports[ex.id] = ex
        while len(self.exports) > MAX_KEPT:
            self.exports.popitem(last=False)
        return asdict(ex)

    def get(self, export_id: str) -> dict[str, Any]:
        ex = self.exports.get(export_id)
        if ex is None:
            raise NotFound(f"unknown export {export_id!r}")
        if ex.state == "pending":
            row = self.ctx.store.fleet.get_cell(ex.cell)
            if row is None or row.state == "down":
                ex.state, ex.reason = "failed", f"{ex.cell} went down before it answered"
        return asdict(ex)

    def on_exported(self, fx: Effects, cell_id: str, e: ExportedEvent) -> None:
        ex = self.exports.get(e.export_id)
        if ex is None or ex.cell != cell_id or ex.state != "pending":
            return  # not ours, or already settled
        ex.state = "done" if e.ok else "failed"
        ex.reason, ex.written_to, ex.bytes, ex.seconds = e.reason, e.path, e.bytes, e.seconds
