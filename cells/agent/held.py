"""The sessions' contexts this cell holds, so a sticky turn's start carries only what is new.

Per session: the token ids of its latest request here (prompt, then each token the engine
sampled for it) and their running hash (scheduler/contract/prefixhash.py, extended only by
what was appended since it was last asked). A delta `StartCmd` names the prefix it builds on
by length and digest; `context` gives the whole context only when this cell's own record has
exactly that length and digest — otherwise None, and the agent answers `PrefixMissingEvent`
(the scheduler then sends the whole context). So a delta start is token-exact or not started.

Bounded: at most `max_tokens` ids over all sessions, least recently started sessions dropped
first (a dropped one costs its next turn a full start, nothing else). Ids are kept as lists
(~36 bytes an id; a 4-byte array costs every delta start a 128k-id conversion, ~4 ms).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler.contract.prefixhash import PrefixHash
from scheduler.contract.protocol import StartCmd

HELD_TOKENS_MAX = 1 << 22
"""Token ids kept over all sessions (~150 MB): 32 sessions of 128k tokens."""


@dataclass(slots=True)
class Held:
    request_id: str
    ids: list[int]
    hash: PrefixHash = field(default_factory=PrefixHash)
    """Over ids[:hash.length]; caught up when asked."""

    def digest_at(self, n: int) -> str | None:
        if n != len(self.ids):
            return None
        self.hash.extend(self.ids[self.hash.length:])
        return self.hash.digest()


class HeldContexts:
    def __init__(self, max_tokens: int = HELD_TOKENS_MAX) -> None:
        self.max_tokens = max_tokens
        self.sessions: OrderedDict[str, Held] = OrderedDict()
        self.session_of: dict[str, str] = {}
        """request id → its session, for the requests whose tokens extend a held context."""
        self.num_tokens = 0

    def length(self, session_id: str) -> int:
        h = self.sessions.get(session_id)
        return 0 if h is None else len(h.ids)

    def context(self, cmd: StartCmd) -> list[int] | None:
        """The whole context `cmd` starts (its token ids after the prefix it names); None when
        this cell does not hold that prefix."""
        if cmd.prefix_hash is None:
            return cmd.token_ids
        h = self.sessions.get(cmd.session_id)
        if h is None or h.digest_at(cmd.prefix_len) != cmd.prefix_hash:
            return None
        return h.ids + list(cmd.token_ids)

    def began(self, cmd: StartCmd, ids: list[int]) -> None:
        """The engine took `cmd` with context `ids`: it is the session's context here now."""
        old = self.sessions.pop(cmd.session_id, None)
        if old is not None:
            self.num_tokens -= len(old.ids)
            self.session_of.pop(old.request_id, None)
        if cmd.prefix_hash is not None and old is not None:  # the prefix was verified: keep its hash
            old.ids.extend(cmd.token_ids)
            held = Held(cmd.request_id, old.ids, old.hash)
        else:
            held = Held(cmd.request_id, list(ids))  # a copy: the engine appends to its own
        self.sessions[cmd.session_id] = held
        self.session_of[cmd.request_id] = cmd.session_id
        self.num_tokens += len(held.ids)
        self._bound()

    def sampled(self, request_id: str, token_id: int) -> None:
        """The engine sampled `token_id` for `request_id` (a no-op for a request not held)."""
        sid = self.session_of.get(request_id)
        if sid is None:
            return
        self.sessions[sid].ids.append(token_id)
        self.num_tokens += 1

    def ended(self, request_id: str) -> None:
        """The request is gone from this cell (aborted, moved away): its context is not held."""
        sid = self.session_of.pop(request_id, None)
        if sid is not None:
            h = self.sessions.pop(sid)
            self.num_tokens -= len(h.ids)

    def _bound(self) -> None:
        while self.num_tokens > self.max_tokens and len(self.sessions) > 1:
            _, h = self.sessions.popitem(last=False)
            self.num_tokens -= len(h.ids)
            self.session_of.pop(h.request_id, None)
