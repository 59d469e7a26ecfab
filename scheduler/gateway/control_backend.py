"""The gateway's backend on the real control plane: the durable session store and the cells.

Satisfies `scheduler.gateway.tito.backend.CompletionBackend`: the chat gateway appends rendered
prompt tokens to the session's buffer, then `complete` submits the buffer as a token-in
completion (owned by a cell, fenced, migratable) and yields each sampled token once the store
has committed it — so a token reaches the store before any client sees it. The control
plane's refusals (scheduler/contract/errors.py) are the gateway's `BackendError`s: they pass through
unchanged (429 with Retry-After when no cell has room or the staleness bound holds admission,
409 for a session with a request in flight or already finished).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from scheduler.api.principal import ROUTED_JOB, current_agent, current_job
from scheduler.contract.errors import Conflict
from scheduler.contract.sampling import SamplingParams
from scheduler.gateway import recording
from scheduler.gateway.tito.backend import (
    Rewind,
    SessionFinished,
    SessionNotFound,
    SessionTokens,
    TokenOut,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from scheduler.control.controller import Controller
    from scheduler.store.owners import RequestRow
    from scheduler.store.sessions import SessionRow

class ControlPlaneBackend:
    def __init__(self, app: FastAPI) -> None:
        self.app = app

    @property
    def ctl(self) -> Controller:
        return self.app.state.controller  # built by the app's lifespan

    def max_prompt_tokens(self) -> int | None:
        """The fleet model's context length (scheduler/control/trust.py), once a cell reported it."""
        limits = self.ctl.trust.limits
        return limits.max_context if limits is not None and limits.max_context else None

    def route_model(self, model: str | None) -> None:
        """The RL job a chat turn's `model` field names, for the rest of the request
        (scheduler/control/jobs.py `resolve`: 404 for no such job, 403 for another job's)."""
        ROUTED_JOB.set(self.ctl.jobs.resolve(model, current_job()))

    def job(self) -> str:
        """The job of this request's turn: as routed, else the caller's own."""
        return ROUTED_JOB.get() or self.ctl.jobs.resolve(None, current_job())

    async def admit(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    new_ids: list[int] | None = None) -> None:
        """Every refusal a turn can get, before the gateway records anything of it: another
        agent's session, a job's admission (draining, its `max_sessions`, another job's
        session), a turn in flight, what a cell would refuse, the staleness bound's
        admission and rollout capacity (scheduler/control/completions.py). `new_ids`: the ids
        the turn appends, the only ones checked (the rest were checked when recorded)."""
        ctl, job = self.ctl, self.job()
        is_new = ctl.store.sessions.get(session_id) is None
        ctl.jobs.admit_session(job, session_id, is_new)
        if is_new:  # its job recorded before the capacity check: placement reads it
            ctl.jobs.tag_session(session_id, job, new=True)
        ctl.completions.check(session_id, prompt_ids, params, current_agent(), new_ids=new_ids)
        ctl.completions.admissible(session_id, len(prompt_ids))

    async def session_digest(self, session_id: str) -> str | None:
        """The current segment's running-hash digest (scheduler/store/context.py: caught up from
        the tokens recorded since it was last asked)."""
        row = self._visible(session_id)
        if row is None:
            return None
        return self.ctl.store.context.segment_hash(session_id, row.segment_starts[-1], row.length).digest()

    def submit(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestRow:
        """Start the completion on a cell (its refusals are BackendErrors). The gateway recorded
        the prompt already (it is the current segment): the completion continues the buffer,
        nothing to send or compare again."""
        ctl = self.ctl
        row = ctl.store.sessions.get(session_id)
        if row is not None and row.length - row.segment_starts[-1] == len(prompt_ids):
            prompt_ids = []
        return ctl.submit_completion(session_id, list(prompt_ids), params, agent=current_agent())

    async def complete(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                       live: bool = True) -> AsyncIterator[TokenOut | Rewind]:
        ctl = self.ctl
        req = self.submit(session_id, prompt_ids, params)
        if (sent := recording.SENT.get()) is not None:  # a chat turn: its messages beside its request
            recording.SENT.set(None)
            ctl.store.messages.record(session_id, req.id, sent, ctl.cfg.store.messages_bytes)
        held = None  # one token held back so the last one can carry the finish reason
        out = 0  # tokens yielded
        async for start, rows, cur in ctl.follow_request(req.id, live):
            if start < out + (held is not None):  # taken back (only when not live)
                held = None
                if start < out:
                    out = start
                    yield Rewind(start)
            for token_id, logprob, version in zip(rows.token_ids, rows.logprobs, rows.versions):
                if held is not None:
                    out += 1
                    yield held
                held = TokenOut(token_id, logprob, version)
            if cur.state in ("finished", "failed"):
                if held is not None:
                    yield TokenOut(held.token_id, held.logprob, held.version, cur.reason or "stop")
                return
        if held is not None:
            yield held

    async def get_session_tokens(self, session_id: str, start: int = 0) -> SessionTokens | None:
        sessions = self.ctl.store.sessions
        row = self._visible(session_id)
        if row is None:
            return None
        seg_start = row.segment_starts[-1]
        t = sessions.read(session_id, seg_start + start, None)
        return SessionTokens(
            token_ids=list(t.token_ids), loss_mask=list(t.loss_mask), segment=len(row.segment_starts) - 1,
            length=row.length - seg_start, finished=row.state == "finished",
            logprobs=list(t.logprobs), versions=list(t.versions))

    async def append_prompt_tokens(self, session_id: str, ids: list[int], loss_mask: int = 0) -> None:
        if loss_mask != 0:
            raise ValueError("the gateway appends only non-sampled tokens")
        self._require_open(session_id, create=True)
        self._require_idle(session_id)
        self.ctl.jobs.tag_session(session_id, self.job())
        self.ctl.store.sessions.append_prompt(session_id, [int(t) for t in ids], current_agent())

    async def start_segment(self, session_id: str, reason: str) -> int:
        sessions = self.ctl.store.sessions
        self._require_open(session_id, create=True)
        self._require_idle(session_id)
        sessions.new_segment(session_id, current_agent())  # counted by the router's history_rewrites counter
        return len(sessions.require(session_id).segment_starts) - 1

    async def get_gateway_state(self, session_id: str) -> dict[str, Any] | None:
        self._visible(session_id)
        return self.ctl.store.sessions.gateway_state(session_id)

    async def set_gateway_state(self, session_id: str, state: dict[str, Any]) -> None:
        self._visible(session_id)
        self.ctl.store.sessions.put_gateway_state(session_id, state)

    async def finish_session(self, session_id: str, reward: float | None, group_id: str | None) -> dict[str, Any]:
        return self.ctl.finish_session(session_id, 0.0 if reward is None else reward, group_id)

    def _visible(self, session_id: str) -> SessionRow | None:
        """The session (None if new); another agent's session is refused as unknown (404)."""
        row = self.ctl.store.sessions.get(session_id)
        agent = current_agent()
        if row is not None and agent is not None and row.agent != agent:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return row

    def _require_idle(self, session_id: str) -> None:
        """One turn at a time per session, whichever route runs it: a turn racing another
        (a `/v1/generate` on the same session) is refused before it records anything."""
        if self.ctl.store.owners.active_request_for_session(session_id) is not None:
            raise Conflict(f"session {session_id!r} has a request in flight", code="session_busy")

    def _require_open(self, session_id: str, create: bool) -> None:
        row = self._visible(session_id)
        if row is None and not create:
            raise SessionNotFound(f"unknown session {session_id!r}")
        if row is not None and row.state == "finished":
            raise SessionFinished(f"session {session_id!r} is finished")

