"""In-memory reference :class:`~scheduler.gateway.tito.backend.CompletionBackend` and replay engine.

:class:`ReplayEngine` is a deterministic stand-in for a cell's inference engine: it "samples"
token ids scripted per session (or a fixed default reply), with log-probs that are a pure
function of (seed, request id, token index), honours ``max_tokens`` and stop token ids, and
keeps its own record of every token it emitted -- the ground truth tests compare the session
store against.

:class:`InMemoryBackend` keeps the session store in dicts and routes each session to one of a
few named cells, sticky across turns (the cell's cached prefix is reused) until
:meth:`InMemoryBackend.migrate` moves it. It is meant for tests, the bench and examples.
"""

from __future__ import annotations

import json
import zlib
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from scheduler.contract.prefixhash import prefix_digest
from scheduler.contract.sampling import SamplingParams
from scheduler.gateway.tito.backend import (
    BackendBusy,
    SessionFinished,
    SessionNotFound,
    SessionTokens,
    TokenOut,
)

__all__ = ["InMemoryBackend", "ReplayEngine", "Segment", "StoredSession"]


def replay_logprob(seed: int, request_id: str, index: int) -> float:
    """Deterministic stand-in log-prob in (-4, 0]."""
    h = zlib.crc32(f"{seed}:{request_id}:{index}".encode())
    return -(h % 4000) / 1000.0


class ReplayEngine:
    """Replays scripted completions as if sampled; records what it emitted."""

    def __init__(self, default_reply: Iterable[int] = (), version: int = 0) -> None:
        self.default_reply = list(default_reply)
        self.version = version
        self._scripts: dict[str, deque[list[int]]] = defaultdict(deque)
        self.sampled: dict[str, list[list[int]]] = defaultdict(list)
        """Per session, every completion's token ids exactly as emitted (the engine's record)."""
        self.requests = 0

    def script(self, session_id: str, completions: Iterable[Iterable[int]]) -> None:
        """Queue completions (token id lists) the session's next requests will replay."""
        for c in completions:
            self._scripts[session_id].append(list(c))

    def pending(self, session_id: str) -> int:
        return len(self._scripts.get(session_id, ()))

    def next_completion(self, session_id: str) -> list[int]:
        q = self._scripts.get(session_id)
        return q.popleft() if q else list(self.default_reply)

    async def generate(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[TokenOut]:
        """Yield the session's next scripted completion, cut by max_tokens / stop ids."""
        self.requests += 1
        ids = self.next_completion(session_id)
        stop = set(params.stop_token_ids)
        max_tokens = params.max_tokens if "max_tokens" in params.model_fields_set else None  # unset: no cut
        seed = params.seed
        record: list[int] = []
        self.sampled[session_id].append(record)
        n = len(ids)
        for i, tid in enumerate(ids):
            last = i == n - 1
            finish = None
            if tid in stop:
                finish, last = "stop", True
            elif max_tokens is not None and i + 1 >= max_tokens:
                finish, last = ("stop" if i == n - 1 else "length"), True
            elif last:
                finish = "stop"
            record.append(tid)
            yield TokenOut(tid, replay_logprob(seed, request_id, i), self.version, finish)
            if last:
                return


@dataclass
class Segment:
    reason: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)


@dataclass
class StoredSession:
    segments: list[Segment] = field(default_factory=lambda: [Segment("start")])
    gateway_state: dict[str, Any] | None = None
    finished: bool = False
    reward: float | None = None
    group_id: str | None = None
    cell: str | None = None

    @property
    def current(self) -> Segment:
        return self.segments[-1]


class InMemoryBackend:
    """Dict-backed session store + sticky cell routing over a :class:`ReplayEngine`."""

    def __init__(
        self,
        engine: ReplayEngine | None = None,
        cells: Iterable[str] = ("cell-0", "cell-1"),
        max_sessions_per_cell: int | None = None,
    ) -> None:
        self.engine = engine or ReplayEngine()
        self.cells = list(cells)
        self.max_sessions_per_cell = max_sessions_per_cell
        self.sessions: dict[str, StoredSession] = {}
        self.trajectories: dict[str, dict[str, Any]] = {}
        self._kv: dict[str, dict[str, int]] = {c: {} for c in self.cells}
        """Per cell: session id -> number of leading tokens whose KV the cell holds."""
        self.turn_log: list[dict[str, Any]] = []
        """One entry per completion: session, cell, prompt length, tokens reused from KV."""
        self._req = 0

    # ------------------------------------------------------------------ routing / cells
    def _load(self, cell: str) -> int:
        return sum(1 for s in self.sessions.values() if s.cell == cell and not s.finished)

    def _route(self, session_id: str, sess: StoredSession) -> str:
        if sess.cell is None:
            cell = min(self.cells, key=self._load)
            if (
                self.max_sessions_per_cell is not None
                and self._load(cell) >= self.max_sessions_per_cell
            ):
                raise BackendBusy("no rollout cell has room for a new session", retry_after_s=1.0)
            sess.cell = cell
        return sess.cell

    def cell_of(self, session_id: str) -> str | None:
        s = self.sessions.get(session_id)
        return None if s is None else s.cell

    def migrate(self, session_id: str, to_cell: str) -> None:
        """Move a session (and its cached KV) to another cell."""
        sess = self.sessions[session_id]
        if to_cell not in self._kv:
            raise KeyError(to_cell)
        if sess.cell is not None:
            cached = self._kv[sess.cell].pop(session_id, 0)
            self._kv[to_cell][session_id] = cached
        sess.cell = to_cell

    # ---------------------------------------------------------------------- the protocol
    def _get(self, session_id: str) -> StoredSession:
        sess = self.sessions.get(session_id)
        if sess is None:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return sess

    async def complete(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, live: bool = True
    ) -> AsyncIterator[TokenOut]:
        sess = self._get(session_id)
        if sess.finished:
            raise SessionFinished(f"session {session_id!r} is finished")
        seg = sess.current
        if seg.token_ids != prompt_ids:
            raise ValueError("prompt_ids must equal the session's current segment")
        cell = self._route(session_id, sess)
        cached = self._kv[cell].get(session_id, 0)
        reused = cached if prompt_ids[:cached] == seg.token_ids[:cached] else 0
        self.turn_log.append(
            {
                "session": session_id,
                "cell": cell,
                "prompt_tokens": len(prompt_ids),
                "reused_tokens": reused,
            }
        )
        self._req += 1
        rid = f"{session_id}:{self._req}"
        async for tok in self.engine.generate(session_id, prompt_ids, params, rid):
            # Recorded before any client sees it.
            seg.token_ids.append(tok.token_id)
            seg.loss_mask.append(1)
            seg.logprobs.append(tok.logprob)
            seg.versions.append(tok.version)
            self._kv[cell][session_id] = len(seg.token_ids)
            yield tok

    async def get_session_tokens(self, session_id: str, start: int = 0) -> SessionTokens | None:
        sess = self.sessions.get(session_id)
        if sess is None:
            return None
        seg = sess.current
        return SessionTokens(
            token_ids=seg.token_ids[start:],
            loss_mask=seg.loss_mask[start:],
            segment=len(sess.segments) - 1,
            length=len(seg.token_ids),
            finished=sess.finished,
            logprobs=seg.logprobs[start:],
            versions=seg.versions[start:],
        )

    async def session_digest(self, session_id: str) -> str | None:
        """The current segment's running-hash digest (hashed whole here: a reference, not a
        store that keeps it)."""
        sess = self.sessions.get(session_id)
        return None if sess is None else prefix_digest(sess.current.token_ids)

    async def append_prompt_tokens(
        self, session_id: str, ids: list[int], loss_mask: int = 0
    ) -> None:
        sess = self.sessions.setdefault(session_id, StoredSession())
        if sess.finished:
            raise SessionFinished(f"session {session_id!r} is finished")
        seg = sess.current
        seg.token_ids.extend(ids)
        seg.loss_mask.extend([loss_mask] * len(ids))
        seg.logprobs.extend([None] * len(ids))
        seg.versions.extend([None] * len(ids))

    async def start_segment(self, session_id: str, reason: str) -> int:
        sess = self.sessions.setdefault(session_id, StoredSession())
        if sess.current.token_ids:
            sess.segments.append(Segment(reason))
        else:
            sess.current.reason = reason
        if sess.cell is not None:
            self._kv[sess.cell].pop(session_id, None)  # a new context: nothing cached applies
        return len(sess.segments) - 1

    async def get_gateway_state(self, session_id: str) -> dict[str, Any] | None:
        sess = self.sessions.get(session_id)
        return None if sess is None else sess.gateway_state

    async def set_gateway_state(self, session_id: str, state: dict[str, Any]) -> None:
        self.sessions.setdefault(session_id, StoredSession()).gateway_state = state

    async def finish_session(
        self, session_id: str, reward: float | None, group_id: str | None
    ) -> dict[str, Any]:
        sess = self._get(session_id)
        if sess.finished:
            raise SessionFinished(f"session {session_id!r} is already finished")
        sess.finished, sess.reward, sess.group_id = True, reward, group_id
        if sess.cell is not None:
            self._kv[sess.cell].pop(session_id, None)
        traj = {
            "session_id": session_id,
            "reward": reward,
            "group_id": group_id,
            "segments": len(sess.segments),
            "tokens": sum(len(s.token_ids) for s in sess.segments),
            "sampled_tokens": sum(sum(s.loss_mask) for s in sess.segments),
        }
        self.trajectories[session_id] = traj
        return traj


# -- a harness writing its history back (for tests and the drift bench) ----------------
def reserialise(arguments: str, mode: str) -> str:
    """How a harness writes tool-call arguments back into its history."""
    obj = json.loads(arguments)
    if mode == "python_repr":
        return str(obj)  # False / None / single quotes
    if mode == "json_sorted_compact":
        return json.dumps(obj, sort_keys=True, separators=(",", ":"))
    if mode == "json_indent":
        return json.dumps(obj, indent=2)
    if mode == "json_default":
        return json.dumps(obj)
    return arguments



def echo_assistant(message: dict, mode: str) -> dict:
    """The assistant message as the harness appends it (reasoning dropped)."""
    out: dict = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": tc["id"],
                "type": "function",
                "function": {
                    "name": tc["function"]["name"],
                    "arguments": reserialise(tc["function"]["arguments"], mode),
                },
            }
            for tc in message["tool_calls"]
        ]
    return out


