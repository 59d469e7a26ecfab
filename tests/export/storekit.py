"""Finished sessions written straight into a store (prompt, sampled turns with their request
rows and exact old log-probs, a migration), for the export tests."""

from __future__ import annotations

import random
import struct
from typing import Any

from scheduler.contract.records import TokenRecords
from scheduler.store.owners import MigrationRow, RequestRow


def add_session(store: Any, sid: str, *, turns: list[tuple[list[int], list[int], list[float], int]],
                reward: float, group: str | None = "g", cell: str = "c1", moved_to: str | None = None,
                params: dict | None = None) -> None:
    """`turns`: (prompt ids, sampled ids, their behaviour log-probs, version) each; old log-probs
    are the behaviour ones (exact). `moved_to`: the first turn's request moved there by re-prefill."""
    with store.tx(durable=False):
        for k, (prompt, sampled, lps, version) in enumerate(turns):
            start = store.sessions.append_prompt(sid, prompt) - len(prompt)
            base = start + len(prompt)
            rid = f"{sid}-r{k}"
            store.owners.put_request(RequestRow(rid, sid, base, start if k == 0 else 0, len(sampled),
                                                params or {"temperature": 1.0, "seed": 7, "max_tokens": 64},
                                                cell, 0, "finished", "stop"))
            store.sessions.append_sampled(sid, base, TokenRecords(sampled, lps, [version] * len(sampled),
                                                                  [False] * len(sampled)), 0, cell)
            store.sessions.fill_old_logprobs(sid, base, list(lps), "exact", version)
            if moved_to and k == 0:
                store.owners.put_migration(MigrationRow(f"m-{sid}", rid, cell, moved_to, 1, "committed",
                                                        "reprefill", finished_at=1.0))
    store.sessions.finish(sid, reward, group)


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def random_session(store: Any, sid: str, seed: int, version: int = 1, n_turns: int = 2) -> None:
    g = random.Random(seed)
    turns = []
    for _ in range(n_turns):
        n = g.randint(2, 6)
        turns.append(([g.randrange(1000) for _ in range(g.randint(2, 5))], [g.randrange(1000) for _ in range(n)],
                      [_f32(-g.random() * 3) for _ in range(n)], version))
    add_session(store, sid, turns=turns, reward=g.choice([0.0, 1.0]))
