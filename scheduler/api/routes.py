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

ROUTERS = (ops.router, cells.router, flips.router, versions.router, versions.exports_router, sessions.router,
           completions.router, internal.router, trainer.router, tokens.router,
           export.router, jobs.router)
