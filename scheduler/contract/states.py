"""State machines of cells, flips, weight versions, migrations and requests.

Each machine is a dict from a state to its allowed next states, every edge with the reason it
exists (the comment doubles as the default history detail). `set_state` refuses an illegal
edge with `IllegalTransition` (a 409) and appends `(state, t, detail)` to the record's
history, so `GET /v1/flips/{id}` and `GET /v1/cells/{id}` show how they got where they are.

The cell machine (`CELL`) is the one role machine: the scheduler's record of each cell, the
cell's own record of its role (cells/roles.py) and the planner's `Role` (scheduler/planner/)
are all its states.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from scheduler.contract.errors import Conflict


class IllegalTransition(Conflict):
    """The requested edge is not in the machine."""

    code = "illegal_transition"


CellState = Literal["joining", "rollout", "draining", "training", "loading", "down"]
"""A cell's state (`CELL`'s states): joining -> rollout <-> draining -> training <-> loading
-> rollout, plus down."""

CELL_TRANSITIONS: dict[str, dict[str, str]] = {
    "joining": {
        "rollout": "first sync after registering, serving a version it may serve: it serves rollouts",
        "loading": "first sync after registering, serving a version it may not serve (older than the "
                   "staleness bound allows): it fetches the current one first",
        "down": "lease lost (or fenced by a new incarnation) before the first sync",
    },
    "rollout": {
        "draining": "a flip to training began: in-flight requests migrate out",
        "down": "lease lost or fenced by a new incarnation",
    },
    "draining": {
        "training": "nothing left on the cell and it reported the training role",
        "rollout": "flip rolled back: the cell keeps serving rollouts",
        "down": "lease lost mid-drain: its requests re-prefill elsewhere",
    },
    "training": {
        "loading": "a flip to rollout began: the cell loads the current weight version",
        "down": "lease lost or fenced by a new incarnation",
    },
    "loading": {
        "rollout": "weights loaded and verified (the flip's version, or a fresh cell's fetch of the "
                   "current one): the cell serves rollouts",
        "training": "loading failed: flip rolled back, the cell stays in training",
        "down": "lease lost while loading",
    },
    "down": {
        "joining": "a new incarnation registered under the same cell id",
    },
}

FLIP_TRANSITIONS: dict[str, dict[str, str]] = {
    "pending": {
        "draining": "flip to training started: the cell drains",
        "loading": "flip to rollout started: the cell loads weights",
        "failed": "the cell was lost or the flip became illegal before it started",
    },
    "draining": {
        "done": "the cell holds no request and reported the training role",
        "rolled_back": "rollout capacity fell below the minimum: the cell stays in rollout",
        "failed": "the cell was lost mid-drain (its requests were re-placed)",
    },
    "loading": {
        "done": "the cell reported the rollout role",
        "rolled_back": "the cell could not load the weights: it stays in training",
        "failed": "the cell was lost while loading",
    },
    "done": {},
    "failed": {},
    "rolled_back": {},
}

VERSION_TRANSITIONS: dict[str, dict[str, str]] = {
    "broadcasting": {
        "active": "every rollout cell serves it (or none is there to wait for)",
        "retired": "abandoned before activation; nothing left unscored",
    },
    "active": {"retiring": "a newer version became active"},
    "retiring": {"retired": "no cell serves it and every sampled token has an old log-prob"},
    "retired": {},
}

MIGRATION_TRANSITIONS: dict[str, dict[str, str]] = {
    "pending": {
        "committed": "destination imported the KV and won the ownership compare-and-set",
        "aborted": "a party gave up, timed out, finished or was lost before commit",
    },
    "committed": {},
    "aborted": {},
}

REQUEST_TRANSITIONS: dict[str, dict[str, str]] = {
    "queued": {
        "running": "placed on a rollout cell (start command sent)",
        "failed": "dropped by policy",
    },
    "running": {
        "migrating": "a migration to another cell is pending",
        "queued": "owner lost or revoked: re-prefill from the session store elsewhere",
        "suspended": "drain deadline passed with no destination",
        "parked": "drain deadline passed with no destination: KV parked in the owner's host memory",
        "finished": "the owner reported a finish reason",
        "failed": "dropped by policy",
    },
    "migrating": {
        "running": "migration committed (new owner) or aborted (source keeps decoding)",
        "queued": "source lost mid-migration: re-prefill elsewhere",
        "suspended": "drain deadline passed during the migration",
        "parked": "a move out of the parked copy was aborted: it stays parked",
        "finished": "the source finished the request before the commit",
        "failed": "dropped by policy",
    },
    "parked": {
        "migrating": "capacity came back: moved out of the parked copy by KV migration",
        "queued": "parked copy lost (owner fenced) or unusable: re-prefill from the session store",
        "finished": "the owner finished the request before it parked",
        "failed": "dropped by policy",
    },
    "suspended": {
        "running": "capacity came back: resumed by re-prefill",
        "failed": "dropped by policy",
    },
    "finished": {},
    "failed": {},
}


class Stateful(Protocol):
    state: str
    history: list


@dataclass(frozen=True)
class Machine:
    """A named transition table."""

    name: str
    transitions: dict[str, dict[str, str]]

    def check(self, current: str, new: str) -> str:
        """Return the edge's reason, or raise `IllegalTransition`. Mutates nothing."""
        edges = self.transitions.get(current)
        if edges is None or new not in edges:
            allowed = sorted(edges or ())
            raise IllegalTransition(f"{self.name} cannot go {current} -> {new} (allowed: {allowed})")
        return edges[new]

    def can(self, current: str, new: str) -> bool:
        return new in self.transitions.get(current, {})

    def path(self, current: str, new: str) -> list[str]:
        """The states from `current` to `new` along the fewest edges (`new` last, `current`
        not included; empty when they are equal). Raises `IllegalTransition` when none leads there."""
        came: dict[str, str] = {current: current}
        todo = deque([current])
        while todo and new not in came:
            s = todo.popleft()
            for nxt in self.transitions.get(s, ()):
                if nxt not in came:
                    came[nxt] = s
                    todo.append(nxt)
        if new not in came:
            raise IllegalTransition(f"{self.name} cannot get from {current} to {new}")
        out = []
        while new != current:
            out.append(new)
            new = came[new]
        return out[::-1]

    def is_terminal(self, state: str) -> bool:
        return not self.transitions[state]

    def terminal_states(self) -> frozenset[str]:
        return frozenset(s for s, e in self.transitions.items() if not e)


CELL = Machine("cell", CELL_TRANSITIONS)
FLIP = Machine("flip", FLIP_TRANSITIONS)
VERSION = Machine("version", VERSION_TRANSITIONS)
MIGRATION = Machine("migration", MIGRATION_TRANSITIONS)
REQUEST = Machine("request", REQUEST_TRANSITIONS)


def set_state(machine: Machine, record: Stateful, new: str, detail: str = "", t: float | None = None) -> None:
    """Move `record` to `new` along a legal edge and append `(new, t, detail)` to its history."""
    reason = machine.check(record.state, new)
    record.state = new
    record.history.append((new, time.time() if t is None else t, detail or reason))


ROLLOUT_SIDE: frozenset[str] = frozenset({"joining", "rollout", "loading"})
"""Cell states that serve (or are about to serve) rollouts: the planner's rollout side."""
TRAINING_SIDE: frozenset[str] = frozenset({"draining", "training"})
"""Cell states committed to training (draining cells are on their way there)."""


def role_of(cell_state: str) -> str | None:
    """The role a cell in `cell_state` plays: draining cells still serve rollouts."""
    if cell_state in ("rollout", "draining"):
        return "rollout"
    if cell_state in ("training", "loading"):
        return "training"
    return None
