"""One APIRouter per resource; handlers validate, call the controller, return."""

from scheduler.api import (
           cells,
           completions,
           export,
           flips,
           internal,
           jobs,
           ops,
           sessions,
           tokens,
           trainer,
           versions,
)

ROUTERS = (internal.router, ops.router, cells.router, flips.router, versions.router, versions.exports_router,
           sessions.router, completions.router, trainer.router, tokens.router, export.router, jobs.router)
"""The cell protocol's routes first: every cell's sync each second is matched at the first try
(no other path starts with /internal)."""
