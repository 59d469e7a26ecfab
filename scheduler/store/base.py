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


VALUES_ROWS = 400
"""Rows one `update_by_key` statement carries at most (its bound values stay far below
SQLite's limit)."""


def update_by_key(db: Database, table: str, key: str, cols: tuple[str, ...], rows: list[tuple],
                  also: str = "", also_params: tuple = ()) -> None:
    """`UPDATE table SET col = value, ... WHERE key = k` for many rows as one statement per
    `VALUES_ROWS` rows (an `UPDATE ... FROM (VALUES ...)`), not one execution per row: each row
    is (k, value, ...) in `cols` order; keys must be distinct (a repeated key would take one of
    its rows' values, unspecified which: refused). `also`: further `SET` terms, every row the
    same (`also_params` bind them)."""
    if len({r[0] for r in rows}) != len(rows):
        raise ValueError(f"update_by_key on {table}: a key appears twice")
    width = len(cols) + 1
    sets = ", ".join(f"{c} = v.column{k + 2}" for k, c in enumerate(cols)) + (f", {also}" if also else "")
    for at in range(0, len(rows), VALUES_ROWS):
        part = rows[at:at + VALUES_ROWS]
        marks = ",".join(["(" + ",".join("?" * width) + ")"] * len(part))
        params = [*also_params, *(x for r in part for x in r)]
        db.execute(f"UPDATE {table} SET {sets} FROM (VALUES {marks}) AS v WHERE {table}.{key} = v.column1", params)
