"""What the table modules use of the store (`db.Store` is the one implementation): statements,
transactions, the change feed, and the retention table's reads. A protocol here, so no table
module imports the store that composes it."""

from __future__ import annotations

import sqlite3
from contextlib import AbstractContextManager
from typing import Any, Protocol


class Database(Protocol):
    changes: Any
    """The cells changed since each reader last looked (`counters.Changes`)."""
    retention: Any
    """What training did with each trajectory, and the exporters' acks (`retention.RetentionStore`)."""
    messages: Any
    """The messages the gateway was sent, per turn (`messages.MessageStore`)."""

    def tx(self, durable: bool = True) -> AbstractContextManager[None]: ...
    def execute(self, sql: str, params: tuple | list = ()) -> sqlite3.Cursor: ...
    def executemany(self, sql: str, rows: list) -> sqlite3.Cursor: ...
