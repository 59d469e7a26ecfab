"""Store table of API tokens: each token's id, scope and SHA-256 (never the token itself), and
when it was revoked. Bootstrap tokens (the files beside the store) get a row too, so that a
revoked bootstrap token stays revoked across restarts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.store.base import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_tokens(
  id TEXT PRIMARY KEY, scope TEXT NOT NULL, hash TEXT NOT NULL UNIQUE, name TEXT NOT NULL,
  origin TEXT NOT NULL, created_at REAL NOT NULL, revoked_at REAL);
"""


@dataclass(slots=True)
class TokenRow:
    id: str
    scope: str
    hash: str
    name: str
    origin: str
    """`bootstrap` (a token file or variable the scheduler read at start) or `api` (created at run time)."""
    created_at: float
    revoked_at: float | None = None

    def to_api(self) -> dict[str, Any]:
        return {"id": self.id, "scope": self.scope, "name": self.name, "origin": self.origin,
                "created_at": self.created_at, "revoked_at": self.revoked_at}


_COLS = "id, scope, hash, name, origin, created_at, revoked_at"


class TokenStore:
    def __init__(self, store: Database) -> None:
        self.s = store

    def all(self) -> list[TokenRow]:
        return [TokenRow(*r) for r in self.s.execute(f"SELECT {_COLS} FROM api_tokens ORDER BY created_at, id")]

    def get(self, token_id: str) -> TokenRow | None:
        r = self.s.execute(f"SELECT {_COLS} FROM api_tokens WHERE id=?", (token_id,)).fetchone()
        return None if r is None else TokenRow(*r)

    def by_hash(self, digest: str) -> TokenRow | None:
        r = self.s.execute(f"SELECT {_COLS} FROM api_tokens WHERE hash=?", (digest,)).fetchone()
        return None if r is None else TokenRow(*r)

    def insert(self, row: TokenRow) -> None:
        with self.s.tx(durable=True):
            self.s.execute(f"INSERT INTO api_tokens({_COLS}) VALUES (?,?,?,?,?,?,?)",
                           (row.id, row.scope, row.hash, row.name, row.origin, row.created_at, row.revoked_at))

    def revoke(self, token_id: str) -> float:
        now = time.time()
        with self.s.tx(durable=True):
            self.s.execute("UPDATE api_tokens SET revoked_at=? WHERE id=? AND revoked_at IS NULL", (now, token_id))
        return now
