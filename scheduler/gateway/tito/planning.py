"""A turn's plan: the prompt token ids a request extends the session's buffer with.

Reads the session's recorded tokens (those after the kept render state only, where the
backend keeps digests: scheduler/gateway/tito/kept.py) and gateway state, writes nothing. The recorded
conversation is extended (``bridge`` or ``render_diff``) when the request's messages extend
it; otherwise the request starts a new segment from a full render (see
:mod:`scheduler.gateway.tito.tito` for the loss-mask rule).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from scheduler.contract.sampling import SamplingParams
from scheduler.gateway.tito.backend import CompletionBackend, SessionTokens
from scheduler.gateway.tito.chat_request import convert_messages, request_tools, sampling_params
from scheduler.gateway.tito.errors import GatewayError
from scheduler.gateway.tito.fingerprints import FingerprintCache, tools_key
from scheduler.gateway.tito.kept import KeptRenders
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest
from scheduler.gateway.tito.render import ChatRenderer, RenderDiffError, message_texts

__all__ = ["STATE_VERSION", "TurnPlan", "TurnPlanner"]

STATE_VERSION = 1
"""Version of the gateway state a committed turn stores beside the session."""

RENDER_CONCURRENCY = 2
"""Turns rendered at once (each on a worker thread; more wait their turn)."""


@dataclass
class TurnPlan:
    """Everything a turn will write, computed (and validated) before the first write."""

    session_id: str
    kind: str
    """``new`` (first turn), ``extend`` (TITO extension), ``rewrite`` (history edited: new
    segment) or ``resegment`` (new segment for another reason, e.g. an unanswered turn)."""
    path: str
    """How the prompt was built: ``full_render``, ``bridge`` or ``render_diff``."""
    prompt_ids: list[int]
    append_ids: list[int]
    new_segment: str | None
    """Reason of the segment to start first, or None."""
    count_rewrite: bool
    messages: list[dict[str, Any]]
    fingerprints: list[str]
    tools: list[dict[str, Any]] | None
    tools_key: str
    turn: int
    params: SamplingParams
    stop: list[str]
    tool_choice: Any
    prev_len: int
    """len(prompt[k] + completion[k]) that prompt[k+1] must start with (0 on a new segment)."""
    invariant_ok: bool = True
    segment: int = 0
    """Index of the segment the buffer is in now (a new segment, if any, comes after it)."""


class TurnPlanner:
    """Plans turns over a backend's records; ``stats`` counts TITO invariant violations."""

    def __init__(
        self,
        backend: CompletionBackend,
        renderer: ChatRenderer,
        stats: dict[str, int],
        *,
        use_bridge: bool = True,
        default_max_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.stats = stats
        self.use_bridge = use_bridge
        self.default_max_tokens = default_max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self._slots: asyncio.Semaphore | None = None
        self.kept = KeptRenders()
        """Each session's recorded segment as last read: a turn reads only what came after."""
        self.fingerprint = FingerprintCache()
        """The resent messages' fingerprints, remembered."""

    async def plan(self, session_id: str, req: ChatCompletionRequest) -> TurnPlan:
        """Validate the request and compute the turn's prompt; writes nothing."""
        try:
            return await self._plan(session_id, req)
        except (ValueError, TypeError, KeyError, IndexError, AssertionError) as e:
            # Messages the chat template cannot express: the client's fault, not a 500.
            raise GatewayError(
                400, f"the messages cannot be rendered: {e}", param="messages", code="render_error"
            ) from e

    async def _plan(self, session_id: str, req: ChatCompletionRequest) -> TurnPlan:
        tokens = await self.kept.tokens(self.backend, session_id)
        state = await self.backend.get_gateway_state(session_id)
        # Rendering and tokenising are CPU work proportional to the request: off the event loop
        # (which serves every other request, the cells' heartbeats among them), a few at a time.
        async with self._render_slots():
            plan = await asyncio.to_thread(self._compose, session_id, req, state, tokens)
        if tokens is not None and tokens.finished:
            raise GatewayError(
                409,
                f"session {session_id!r} is finished",
                param="X-Session-Id",
                code="session_finished",
            )
        limit = self.prompt_limit()
        if limit is not None and len(plan.prompt_ids) > limit:
            raise GatewayError(
                400,
                f"the prompt has {len(plan.prompt_ids)} tokens, over the limit of {limit}",
                param="messages",
                code="context_length_exceeded",
            )
        admit = getattr(self.backend, "admit", None)
        if admit is not None:  # the backend's refusals, before the turn records anything
            await admit(session_id, plan.prompt_ids, plan.params, new_ids=plan.append_ids)
        return plan

    def _compose(self, session_id: str, req: ChatCompletionRequest, state: dict[str, Any] | None,
                 tokens: SessionTokens | None) -> TurnPlan:
        """The turn's plan from what the backend holds: pure, run on a worker thread."""
        self._check_size(req)
        common = self._request_fields(session_id, req)
        plan, reason = self._extend_if_possible(state, tokens, common)
        if plan is None:
            plan = self._full_render(state, tokens, reason, common)
        plan.segment = tokens.segment if tokens is not None else 0
        return plan

    def _render_slots(self) -> asyncio.Semaphore:
        """At most RENDER_CONCURRENCY renders at once (made on first use, on the serving loop)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(RENDER_CONCURRENCY)
        return self._slots

    def prompt_limit(self) -> int | None:
        """The longest prompt a turn may have: the configured limit, or the backend's (the
        model's context length) where that is shorter."""
        limits = [x for x in (self.max_prompt_tokens, getattr(self.backend, "max_prompt_tokens", lambda: None)())
                  if x]
        return min(limits) if limits else None

    def byte_bound(self) -> int | None:
        """Most text bytes a prompt within the limit can hold (None: no limit). Computing the
        tokenizer's longest token the first time walks its vocabulary: call it off the loop."""
        limit = self.prompt_limit()
        return None if limit is None else limit * self.renderer.tokenizer.max_token_bytes

    def _check_size(self, req: ChatCompletionRequest) -> None:
        """A prompt whose text alone is longer than the prompt limit in tokens of the longest
        token the tokenizer has cannot fit: refused before any rendering."""
        limit = self.prompt_limit()
        if limit is None:
            return
        size = sum(len(t.encode("utf-8", "surrogatepass"))
                   for t in message_texts([m.model_dump(exclude_none=True) for m in req.messages]))
        if size > limit * self.renderer.tokenizer.max_token_bytes:
            raise GatewayError(
                400,
                f"the messages hold {size} bytes of text, more than {limit} tokens can",
                param="messages",
                code="context_length_exceeded",
            )

    def _request_fields(self, session_id: str, req: ChatCompletionRequest) -> dict[str, Any]:
        """The plan's fields that depend on the request alone (validated)."""
        messages = convert_messages(req.messages)
        tools = request_tools(req)
        params = sampling_params(
            req,
            self.renderer.stop_token_ids,
            self.renderer.tokenizer.vocab_size,
            self.default_max_tokens,
        )
        return dict(
            session_id=session_id,
            messages=messages,
            fingerprints=[self.fingerprint(m) for m in messages],
            tools=tools,
            # A changed tool list changes the context only where the template renders it.
            tools_key=tools_key(tools) if self.renderer.renders_tools else "",
            params=params,
            stop=list(req.stop or ()),
            tool_choice=req.tool_choice,
        )

    def _extend_if_possible(
        self, state: dict[str, Any] | None, tokens: SessionTokens | None, common: dict
    ) -> tuple[TurnPlan | None, str]:
        """The extension of the recorded conversation, or (None, why a new segment)."""
        if not (
            state
            and state.get("v") == STATE_VERSION
            and tokens is not None
            and state.get("segment") == tokens.segment
        ):
            return None, "untracked_buffer" if tokens is not None and tokens.length else "start"
        hist: list[str] = state["history"]
        n = len(hist)
        committed = int(state["committed_len"])
        fps, messages = common["fingerprints"], common["messages"]
        extends = (
            len(fps) > n
            and fps[:n] == hist
            and state.get("tools_key", "") == common["tools_key"]
            and all(m["role"] != "assistant" for m in messages[n:])
        )
        if not extends:
            return None, "history_rewrite"
        if len(tokens.token_ids) < committed:
            return None, "buffer_mismatch"
        turn = int(state.get("turn", 0))
        return self._plan_extend(tokens.token_ids, state, messages[n:], turn, common)

    def _full_render(
        self,
        state: dict[str, Any] | None,
        tokens: SessionTokens | None,
        reason: str,
        common: dict,
    ) -> TurnPlan:
        """A plan whose prompt is a full render of the request's messages."""
        S = tokens.token_ids if tokens is not None else []
        prompt = self.renderer.render_ids(
            common["messages"], common["tools"], add_generation_prompt=True
        )
        sampled = tokens is not None and (any(tokens.loss_mask) if tokens.any_sampled is None else tokens.any_sampled)
        if S and S == prompt[: len(S)] and not sampled:
            # A prompt recorded by a turn that never got a completion: reuse it.
            new_seg, append = None, prompt[len(S) :]
        else:
            new_seg = None if not S else reason
            append = prompt
        if not state:
            kind = "new"
        else:
            kind = "rewrite" if reason == "history_rewrite" else "resegment"
        return TurnPlan(
            kind=kind,
            path="full_render",
            prompt_ids=prompt,
            append_ids=append,
            new_segment=new_seg,
            count_rewrite=new_seg == "history_rewrite",
            turn=int(state.get("turn", 0)) if state else 0,
            prev_len=0,
            **common,
        )

    def _plan_extend(
        self, S: list[int], state: dict[str, Any], new_messages: list[dict], turn: int, common: dict
    ) -> tuple[TurnPlan | None, str]:
        """Extend the recorded buffer with the new messages; (None, reason) if impossible."""
        committed = int(state["committed_len"])
        prev = S if len(S) == committed else S[:committed]  # no copy of a 128k context when none is due
        prompt, path = self._extended_prompt(prev, int(state["prompt_end"]), new_messages, common)
        if prompt is None:
            return None, "render_diff_failed"
        # TITO invariant: prompt[k+1] starts with prompt[k] + completion[k].
        ok = prompt[:committed] == prev
        if not ok:  # pragma: no cover - both constructions guarantee it
            self.stats["invariant_violations"] += 1
            return None, "tito_invariant"
        if len(S) > committed:
            # Tokens recorded after the last turn (a prompt whose completion never came, or a
            # completion the harness never saw). Keep them only if they are this prompt's start.
            if prompt[: len(S)] != S:
                return None, "orphan_tokens"
            append = prompt[len(S) :]
        else:
            append = prompt[committed:]
        plan = TurnPlan(
            kind="extend",
            path=path,
            prompt_ids=prompt,
            append_ids=append,
            new_segment=None,
            count_rewrite=False,
            turn=turn,
            prev_len=committed,
            invariant_ok=ok,
            **common,
        )
        return plan, ""

    def _extended_prompt(
        self, prev: list[int], prompt_end: int, new_messages: list[dict], common: dict
    ) -> tuple[list[int] | None, str]:
        """``prev`` + the new messages, by the renderer's bridge or else by render_diff (each
        renders the new messages only, against the tail of ``prev``)."""
        tools = common["tools"]
        if self.use_bridge:
            ext = self.renderer.bridge_extension(prev, prompt_end, new_messages, tools)
            if ext is not None:
                return prev + ext, "bridge"
        try:
            diff = self.renderer.render_diff(new_messages, tools)
        except RenderDiffError:
            return None, "render_diff"
        close = [] if self.renderer.ends_turn(prev[prompt_end:]) else [self.renderer.close_token_id]
        return prev + close + diff, "render_diff"
