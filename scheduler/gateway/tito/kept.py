"""The gateway's kept render state: each session's recorded segment as the gateway last read it.

A turn's plan extends the session's recorded tokens (scheduler/gateway/tito/planning.py).
Reading the whole segment back every turn costs O(context); instead the gateway keeps the
ids it read, with their running hash (scheduler/contract/prefixhash.py), and each turn reads
only the tokens recorded after them (the previous turn's prompt and completion) and checks
the extended hash against the backend's digest of the segment (`session_digest`, kept by the
store: scheduler/store/context.py). Equal digests: the kept ids plus the new ones are the
segment, token for token; anything else (another segment, a cut buffer, a scheduler that
restarted, a backend without digests) reads the segment whole, as before.

Bounded: at most `max_tokens` ids over all sessions, least recently used sessions dropped
first (a dropped one costs its next turn one whole read). The ids are kept as the list the
planner reads (~36 bytes an id: a 4-byte array would cost every turn a 128k-id conversion,
~4 ms); the list is handed out as is, never copied, and must not be changed by its reader.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.contract.prefixhash import PrefixHash
from scheduler.gateway.tito.backend import CompletionBackend, SessionTokens

__all__ = ["KeptRenders"]

KEPT_TOKENS_MAX = 1 << 22
"""Token ids kept over all sessions (~150 MB): 32 sessions of 128k tokens."""


@dataclass(slots=True)
class _Kept:
    segment: int
    ids: list[int]
    hash: PrefixHash
    sampled: bool
    """Whether any of the ids was sampled (loss mask 1)."""


class KeptRenders:
    def __init__(self, max_tokens: int = KEPT_TOKENS_MAX) -> None:
        self.max_tokens = max_tokens
        self.kept: OrderedDict[str, _Kept] = OrderedDict()
        self.num_tokens = 0
        self.stats = {"kept": 0, "whole": 0}
        """Turns served from the kept state, turns that read the segment whole."""

    async def tokens(self, backend: CompletionBackend, session_id: str) -> SessionTokens | None:
        """The session's current segment, as `backend.get_session_tokens(session_id)` returns it
        (`any_sampled` set, `loss_mask` and the other columns of the new tokens only when kept)."""
        digest_of = getattr(backend, "session_digest", None)
        k = self._pop(session_id)
        if digest_of is None:
            return await backend.get_session_tokens(session_id)
        if k is not None:
            tail = await backend.get_session_tokens(session_id, start=len(k.ids))
            if tail is not None and tail.segment == k.segment and tail.length == len(k.ids) + len(tail.token_ids):
                h = k.hash.copy().extend(tail.token_ids)
                if h.digest() == await digest_of(session_id):
                    k.ids.extend(tail.token_ids)
                    k.hash, k.sampled = h, k.sampled or any(tail.loss_mask)
                    self._keep(session_id, k)
                    self.stats["kept"] += 1
                    return SessionTokens(k.ids, list(tail.loss_mask), tail.segment, tail.length,
                                         tail.finished, any_sampled=k.sampled)
        whole = await backend.get_session_tokens(session_id)
        self.stats["whole"] += 1
        if whole is not None and len(whole.token_ids) == whole.length:
            self._keep(session_id, _Kept(whole.segment, list(whole.token_ids),
                                         PrefixHash.of(whole.token_ids), any(whole.loss_mask)))
        return whole

    def forget(self, session_id: str) -> None:
        self._pop(session_id)

    def _pop(self, session_id: str) -> _Kept | None:
        k = self.kept.pop(session_id, None)
        if k is not None:
            self.num_tokens -= len(k.ids)
        return k

    def _keep(self, session_id: str, k: _Kept) -> None:
        self.kept[session_id] = k
        self.num_tokens += len(k.ids)
        while self.num_tokens > self.max_tokens and len(self.kept) > 1:
            _, old = self.kept.popitem(last=False)
            self.num_tokens -= len(old.ids)
