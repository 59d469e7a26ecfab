"""What the command handlers and the migration threads need of the cell agent, named as
protocols: they take these, not the agent (cells/agent/cell.py implements both), so neither
module imports the agent's."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from cells.agent.owned import Owned

if TYPE_CHECKING:
    from cells.agent.held import HeldContexts
    from cells.client import SchedulerClient
    from cells.engine.base import Engine
    from cells.roles import CellRole
    from cells.training.worker import TrainingWorker
    from cells.transport.store import StoreHost
    from cells.versions import CellVersions
    from scheduler.contract.config import CellflipConfig
    from scheduler.contract.protocol import AnyEvent


class MovesHost(Protocol):
    """The agent as the migration threads see it: its requests, engine, identity and locks."""

    cell_id: str
    incarnation: str
    cfg: CellflipConfig
    engine: Engine
    client: SchedulerClient
    store_host: StoreHost
    owned: dict[str, Owned]
    events: list[AnyEvent]

    def access(self) -> AbstractContextManager[Any]: ...
    def quiesce(self) -> AbstractContextManager[Any]: ...
    def wake(self) -> None: ...


class CommandsHost(Protocol):
    """The agent as the command handlers see it: requests, role, versions, training, moves."""

    cell_id: str
    cfg: CellflipConfig
    engine: Engine
    owned: dict[str, Owned]
    held: HeldContexts
    """The sessions' contexts held here (cells/agent/held.py): what a delta start extends."""
    role: CellRole
    training: TrainingWorker
    versions: CellVersions
    moves: Any
    """The agent's `Moves` (cells/agent/moves.py): the handlers of the migration commands."""

    def events_append(self, event: AnyEvent) -> None: ...
    def forget(self, rid: str, abort_engine: bool) -> None: ...
