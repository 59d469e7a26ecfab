"""The cell's own record of its role, on the one cell machine (`CELL`,
scheduler/contract/states.py) with its reasons and history. The cell starts `joining`, serves
in `rollout`, and reports the role it is ready for in every sync (`ready_role`); a flip to
training passes `draining` when the cell is told to train (the scheduler drained it), and a
fenced cell goes `down`, then joins again as a new incarnation.
"""

from __future__ import annotations

import time

from scheduler.contract.states import CELL, set_state


class CellRole:
    def __init__(self) -> None:
        self.state = "joining"
        self.history: list[tuple[str, float, str]] = [("joining", time.time(), "process started")]

    def set(self, new: str, detail: str = "") -> None:
        """Move to `new` along the machine's edges, each state passed recorded with its
        reason, `new` with `detail`; re-asserting the current state changes nothing. Raises
        `IllegalTransition` when no edge leads there."""
        if new == self.state:
            return
        *passed, _ = CELL.path(self.state, new)
        for s in passed:
            set_state(CELL, self, s)
        set_state(CELL, self, new, detail)

    def ready_role(self) -> str | None:
        return self.state if self.state in ("rollout", "training") else None
