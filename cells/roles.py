"""The cell's own view of its role: a table of allowed edges (each with its reason) and a
history. The scheduler keeps the authoritative machine (scheduler/contract/states.py, which adds
`joining`, `draining` and `down`); the cell reports the role it is ready for in every sync.
"""

from __future__ import annotations

import time

ROLE_TRANSITIONS: dict[str, dict[str, str]] = {
    "init": {
        "rollout": "registered: serve rollouts with the held weight version",
    },
    "rollout": {
        "rollout": "re-registered after being fenced: a new incarnation serves rollouts",
        "training": "flip to training: nothing left to decode (migrated, finished or suspended)",
    },
    "training": {
        "loading": "flip to rollout began: load the current weight version",
        "rollout": "re-registered after being fenced",
    },
    "loading": {
        "rollout": "weights loaded and verified",
        "training": "loading failed: the flip rolls back",
    },
}


class IllegalRoleTransition(RuntimeError):
    pass


class CellRole:
    def __init__(self) -> None:
        self.state = "init"
        self.history: list[tuple[str, float, str]] = [("init", time.time(), "process started")]

    def set(self, new: str, detail: str = "") -> None:
        if new == self.state and new not in ROLE_TRANSITIONS[self.state]:
            return  # idempotent re-assertion
        if new not in ROLE_TRANSITIONS[self.state]:
            raise IllegalRoleTransition(f"cell role {self.state} -> {new} is not allowed")
        reason = ROLE_TRANSITIONS[self.state][new]
        self.state = new
        self.history.append((new, time.time(), detail or reason))

    def ready_role(self) -> str | None:
        return self.state if self.state in ("rollout", "training") else None
