"""The cell agent: the process that owns one cell's engine and talks to the scheduler.

- cell.py: `CellAgent` — registration, the engine loop and the sync loop, ownership of
  requests and their unsynced tokens.
- commands.py: the scheduler's commands, routed through a type → handler table.
- moves.py: the cell's migration threads (out, in, cancel) and their outcomes.
- owned.py: per-request bookkeeping.
"""

from cells.agent.cell import HANDOFF_S, IDLE_WAIT_S, STALL_LOG_S, CellAgent
from cells.agent.owned import Owned

__all__ = ["HANDOFF_S", "IDLE_WAIT_S", "STALL_LOG_S", "CellAgent", "Owned"]
