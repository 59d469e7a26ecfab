"""Token-in/token-out (TITO) session logic: the session buffer is the source of truth.

Agent harnesses speak OpenAI Chat Completions and resend the whole conversation every turn.
Re-rendering that conversation and re-encoding it drifts away from what the policy sampled
(BPE merges, JSON whitespace, ``false`` -> ``False``, special tokens), so the gateway never
does it for history it has recorded:

1. The sampled token ids of each completion are recorded in the session's buffer by the
   backend, before any client sees them.
2. Messages are bookkeeping: the gateway keeps a fingerprint per message of the conversation
   it recorded (assistant turns by content and by tool-call id, name and *parsed*
   arguments, so a harness that re-serialises arguments with other spacing or as Python
   literals still matches). Parsed tool calls only route.
3. Each new turn extends the buffer without re-rendering history: the new messages (tool
   results, user follow-ups) are appended with ``bridge_to_next_turn`` over the exact
   previous prompt and sampled completion, or, when the bridge declines, as the difference
   of two renders with and without *all* of the turn's new messages over the same dummy
   prefix (see :meth:`ChatRenderer.render_diff`), after the canonical turn-closing token if
   the completion was truncated. Appended tokens carry loss mask 0.
4. The TITO invariant -- ``prompt[k+1]`` starts with ``prompt[k] + completion[k]`` -- is
   checked on every turn against the buffer; ``retokenization_drift_total`` counts recorded
   completion tokens that differ from what the engine reported sampling (it must stay 0).

History rewrites and the loss-mask rule
---------------------------------------
A request whose messages do not extend the recorded conversation -- the harness edited,
dropped or reordered an earlier message, changed the tool list (where the template renders
it), injected an assistant turn
the policy did not sample, or retried an earlier turn -- starts a new *segment* of the
session (``start_segment(reason="history_rewrite")``, counted in ``history_rewrites_total``).
The new segment is a full render of the request's messages. Loss-mask rule:

- Every token of a segment's re-rendered prompt has loss mask 0, *including* re-rendered
  copies of assistant turns sampled earlier: in this context they are text the template
  produced, not tokens the policy sampled, and they may differ from the sampled ones.
- Tokens sampled in earlier segments keep loss mask 1 in the segment where they were sampled,
  next to the exact context and behaviour log-probs they were sampled with; segments are
  never edited after the fact.
- Only tokens sampled after the new prompt get loss mask 1 in the new segment.

So every policy-sampled token has loss mask 1 exactly once, in its own context, and the
trainer treats each segment as its own sequence. Starting a segment for other reasons (a
session the gateway has no record of, a buffer that no longer matches the records) is not
counted as a rewrite.

Request validation (message shapes, tool-call ids, tool choice, sizes) finishes before the
first write to the store: a rejected request records nothing.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from scheduler.gateway.backend import CompletionBackend, GatewayCounters, SimpleCounters, TokenOut
from scheduler.gateway.openai_schema import ChatCompletionRequest
from scheduler.gateway.render import ChatRenderer, RenderDiffError

__all__ = [
    "GatewayError",
    "TitoGateway",
    "TurnPlan",
    "TurnResult",
    "TurnRun",
    "canonical_arguments",
    "message_fingerprint",
    "naive_rerender_drift",
]

STATE_VERSION = 1


class GatewayError(Exception):
    """A request the gateway refuses; becomes an OpenAI-style error object."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


# ---------------------------------------------------------------------- fingerprints
def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments in one canonical JSON form (sorted keys, compact).

    Accepts an object, JSON text with any spacing, or Python-literal text (``False``,
    ``None``, single quotes) as some harnesses re-serialise it; anything else is kept as
    stripped text. Numbers compare by value, as JSON means them (``1.0``, ``1`` and ``1e0``
    are one number, as a JavaScript harness re-serialises them).
    """
    obj: Any
    if isinstance(arguments, str):
        text = arguments.strip()
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = text
            if len(text) <= 1_000_000:
                try:
                    obj = ast.literal_eval(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    obj = text
    else:
        obj = arguments
    try:
        return json.dumps(_numbers_by_value(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return json.dumps(str(obj))


def _numbers_by_value(obj: Any, depth: int = 0) -> Any:
    """Integral floats as ints (below 2**53, where both are exact), recursively."""
    if depth > 200:
        raise RecursionError("arguments nested too deeply")
    if isinstance(obj, float) and obj.is_integer() and abs(obj) < 2**53:
        return int(obj)
    if isinstance(obj, dict):
        return {k: _numbers_by_value(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_numbers_by_value(v, depth + 1) for v in obj]
    return obj


def message_fingerprint(msg: dict[str, Any]) -> str:
    """A digest of what a (renderer-form) message means for the conversation."""
    role = msg["role"]
    if role == "assistant":
        calls = [
            [
                tc.get("id"),
                tc["function"]["name"],
                canonical_arguments(tc["function"].get("arguments", {})),
            ]
            for tc in msg.get("tool_calls") or ()
        ]
        key: list[Any] = ["assistant", (msg.get("content") or "").strip(), calls]
    elif role == "tool":
        key = ["tool", msg.get("tool_call_id"), msg.get("content") or ""]
    else:
        key = [role, msg.get("content") or ""]
    raw = json.dumps(key, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def _tools_key(tools: list[dict] | None) -> str:
    if not tools:
        return ""
    raw = json.dumps(tools, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, p in enumerate(content):
        if getattr(p, "type", None) != "text" or not hasattr(p, "text"):
            raise GatewayError(
                400,
                f"content part of type {getattr(p, 'type', '?')!r} is not supported; only text parts are",
                param=f"{where}.content[{j}]",
                code="unsupported_content",
            )
        parts.append(p.text)
    return "".join(parts)


# --------------------------------------------------------------------------- planning
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
    params: dict[str, Any]
    stop: list[str]
    tool_choice: Any
    prev_len: int
    """len(prompt[k] + completion[k]) that prompt[k+1] must start with (0 on a new segment)."""
    invariant_ok: bool = True
    segment: int = 0
    """Index of the segment the buffer is in now (a new segment, if any, comes after it)."""


@dataclass
class TurnResult:
    session_id: str
    segment: int
    turn: int
    prompt_len: int
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    message: dict[str, Any]
    """The assistant message as returned (OpenAI form)."""
    drift: int
    path: str
    kind: str
    invariant_ok: bool


@dataclass
class _Lock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class TitoGateway:
    """Per-session TITO logic over a :class:`CompletionBackend` (no HTTP here)."""

    def __init__(
        self,
        backend: CompletionBackend,
        renderer: ChatRenderer,
        counters: GatewayCounters | None = None,
        *,
        use_bridge: bool = True,
        default_max_tokens: int | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.backend = backend
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.counters = counters if counters is not None else SimpleCounters()
        self.use_bridge = use_bridge
        self.default_max_tokens = default_max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self._locks: dict[str, _Lock] = {}
        self.stats: dict[str, int] = {
            "bridge": 0,
            "render_diff": 0,
            "full_render": 0,
            "invariant_violations": 0,
        }

    # ---------------------------------------------------------------- session locks
    def session_lock(self, session_id: str) -> _SessionLock:
        """Serialises turns of one session (concurrent requests wait their turn)."""
        return _SessionLock(self, session_id)

    def forget(self, session_id: str) -> None:
        entry = self._locks.get(session_id)
        if entry is not None and entry.users == 0:
            self._locks.pop(session_id, None)

    # -------------------------------------------------------------- validation
    def convert_messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        """OpenAI messages -> renderer messages, validating their structure."""
        out: list[dict[str, Any]] = []
        open_calls: set[str] | None = None  # ids of the latest assistant's unanswered calls
        all_ids: set[str] = set()
        for i, m in enumerate(req.messages):
            where = f"messages[{i}]"
            role = m.role
            if role in ("system", "developer"):
                out.append({"role": "system", "content": _text(m.content, where)})
                open_calls = None
            elif role == "user":
                out.append({"role": "user", "content": _text(m.content, where)})
                open_calls = None
            elif role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": _text(m.content, where)}
                if m.reasoning_content:
                    msg["reasoning_content"] = m.reasoning_content
                ids: set[str] = set()
                if m.tool_calls:
                    calls = []
                    for j, tc in enumerate(m.tool_calls):
                        if tc.id in ids or tc.id in all_ids:
                            raise GatewayError(
                                400,
                                f"tool call id {tc.id!r} is used more than once",
                                param=f"{where}.tool_calls[{j}].id",
                                code="duplicate_tool_call_id",
                            )
                        ids.add(tc.id)
                        calls.append(
                            {
                                "id": tc.id,
                                "type": "function",
                                "function": {
                                    "name": tc.function.name,
                                    "arguments": tc.function.arguments,
                                },
                            }
                        )
                    msg["tool_calls"] = calls
                all_ids |= ids
                open_calls = ids
                out.append(msg)
            else:  # tool
                if open_calls is None or m.tool_call_id not in open_calls:
                    raise GatewayError(
                        400,
                        f"tool message refers to unknown tool call id {m.tool_call_id!r} (it must answer "
                        "a tool call of the assistant message before it, once)",
                        param=f"{where}.tool_call_id",
                        code="unknown_tool_call_id",
                    )
                open_calls.discard(m.tool_call_id)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": m.tool_call_id,
                        "content": _text(m.content, where),
                    }
                )
        if out[-1]["role"] == "assistant":
            raise GatewayError(
                400,
                "the last message must not be an assistant message (continuing a prefilled "
                "assistant turn is not supported)",
                param=f"messages[{len(out) - 1}]",
                code="assistant_prefill_unsupported",
            )
        return out

    def _tools(self, req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        if not req.tools:
            if req.tool_choice not in (None, "none", "auto"):
                raise GatewayError(
                    400, "tool_choice needs tools", param="tool_choice", code="invalid_tool_choice"
                )
            return None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise GatewayError(
                400, "tool names must be unique", param="tools", code="duplicate_tool_name"
            )
        tc = req.tool_choice
        if tc is not None and not isinstance(tc, str) and tc.function.name not in names:
            raise GatewayError(
                400,
                f"tool_choice names unknown tool {tc.function.name!r}",
                param="tool_choice",
                code="invalid_tool_choice",
            )
        return tools

    def _params(self, req: ChatCompletionRequest) -> dict[str, Any]:
        if req.n not in (None, 1):
            raise GatewayError(400, "only n=1 is supported", param="n", code="unsupported_value")
        stop_ids = list(self.renderer.stop_token_ids)
        for j, t in enumerate(req.stop_token_ids or ()):
            if not 0 <= t < self.tokenizer.vocab_size:
                raise GatewayError(
                    400,
                    f"stop token id {t} is outside the vocabulary",
                    param=f"stop_token_ids[{j}]",
                )
            if t not in stop_ids:
                stop_ids.append(t)
        max_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens
        return {
            "max_tokens": max_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "top_k": -1 if req.top_k is None else req.top_k,
            "seed": req.seed,
            "stop_token_ids": stop_ids,
            "logprobs": bool(req.logprobs),
            "top_logprobs": req.top_logprobs or 0,
        }

    # ------------------------------------------------------------------- planning
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
        messages = self.convert_messages(req)
        tools = self._tools(req)
        params = self._params(req)
        # A changed tool list changes the context only where the template renders it.
        tools_key = _tools_key(tools) if self.renderer.renders_tools else ""
        fps = [message_fingerprint(m) for m in messages]
        tokens = await self.backend.get_session_tokens(session_id)
        if tokens is not None and tokens.finished:
            raise GatewayError(
                409,
                f"session {session_id!r} is finished",
                param="X-Session-Id",
                code="session_finished",
            )
        state = await self.backend.get_gateway_state(session_id)
        common = dict(
            session_id=session_id,
            messages=messages,
            fingerprints=fps,
            tools=tools,
            tools_key=tools_key,
            params=params,
            stop=list(req.stop or ()),
            tool_choice=req.tool_choice,
        )
        S = tokens.token_ids if tokens is not None else []
        turn = int(state.get("turn", 0)) if state else 0
        plan: TurnPlan | None = None
        reason = "start"
        if (
            state
            and state.get("v") == STATE_VERSION
            and tokens is not None
            and state.get("segment") == tokens.segment
        ):
            hist: list[str] = state["history"]
            n = len(hist)
            committed = int(state["committed_len"])
            extends = (
                len(fps) > n
                and fps[:n] == hist
                and state.get("tools_key", "") == tools_key
                and all(m["role"] != "assistant" for m in messages[n:])
            )
            if extends and len(S) >= committed:
                plan, reason = self._plan_extend(S, state, messages[n:], turn, common)
            elif extends:
                reason = "buffer_mismatch"
            else:
                reason = "history_rewrite"
        elif tokens is not None and tokens.length:
            reason = "untracked_buffer"
        if plan is None:
            prompt = self.renderer.render_ids(messages, tools, add_generation_prompt=True)
            if S and S == prompt[: len(S)] and not any(tokens.loss_mask):
                # A prompt recorded by a turn that never got a completion: reuse it.
                new_seg, append = None, prompt[len(S) :]
            else:
                new_seg = None if not S else reason
                append = prompt
            plan = TurnPlan(
                kind="new"
                if not state
                else ("rewrite" if reason == "history_rewrite" else "resegment"),
                path="full_render",
                prompt_ids=prompt,
                append_ids=append,
                new_segment=new_seg,
                count_rewrite=new_seg == "history_rewrite",
                turn=turn,
                prev_len=0,
                **common,
            )
        plan.segment = tokens.segment if tokens is not None else 0
        if self.max_prompt_tokens is not None and len(plan.prompt_ids) > self.max_prompt_tokens:
            raise GatewayError(
                400,
                f"the prompt has {len(plan.prompt_ids)} tokens, over the limit of {self.max_prompt_tokens}",
                param="messages",
                code="context_length_exceeded",
            )
        return plan

    def _plan_extend(
        self, S: list[int], state: dict[str, Any], new_messages: list[dict], turn: int, common: dict
    ) -> tuple[TurnPlan | None, str]:
        """Extend the recorded buffer with the new messages; (None, reason) if impossible."""
        committed = int(state["committed_len"])
        prompt_end = int(state["prompt_end"])
        prev = S[:committed]
        prev_prompt, prev_completion = prev[:prompt_end], prev[prompt_end:]
        tools = common["tools"]
        prompt: list[int] | None = None
        path = "bridge"
        if self.use_bridge:
            b = self.renderer.bridge(prev_prompt, prev_completion, new_messages, tools)
            if b is not None and len(b) > committed and b[:committed] == prev:
                prompt = b
        if prompt is None:
            path = "render_diff"
            try:
                diff = self.renderer.render_diff(new_messages, tools)
            except RenderDiffError:
                return None, "render_diff_failed"
            close = (
                [] if self.renderer.ends_turn(prev_completion) else [self.renderer.close_token_id]
            )
            prompt = prev + close + diff
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

    # ---------------------------------------------------------------------- running
    def start(self, plan: TurnPlan) -> TurnRun:
        return TurnRun(self, plan)

    def tool_call_id(self, session_id: str, segment: int, turn: int, index: int) -> str:
        h = hashlib.blake2b(
            f"{session_id}\x00{segment}\x00{turn}\x00{index}".encode(), digest_size=12
        )
        return "call_" + h.hexdigest()

    def build_message(
        self, plan: TurnPlan, completion: list[int], segment: int, stop_hit: str | None
    ) -> dict[str, Any]:
        from renderers import ToolCallParseStatus

        parsed = self.renderer.parse_response(completion, plan.tools, plan.prompt_ids)
        content = parsed.content or ""
        if stop_hit is not None:
            cut = content.find(stop_hit)
            if cut >= 0:
                content = content[:cut]
        calls = []
        if plan.tool_choice != "none":
            # a sampled name that is not a non-empty string is no call: the response must
            # validate, and the harness's echo of it must be accepted on the next turn
            ok = [tc for tc in parsed.tool_calls
                  if tc.status == ToolCallParseStatus.OK and isinstance(tc.name, str) and tc.name]
            for i, tc in enumerate(ok):
                args = tc.arguments
                args_text = (
                    args
                    if isinstance(args, str)
                    else json.dumps(args if args is not None else {}, ensure_ascii=False)
                )
                calls.append(
                    {
                        "id": self.tool_call_id(plan.session_id, segment, plan.turn, i),
                        "type": "function",
                        "function": {"name": tc.name, "arguments": args_text},
                    }
                )
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": content if (content or not calls) else None,
        }
        if calls:
            msg["tool_calls"] = calls
        if parsed.reasoning_content:
            msg["reasoning_content"] = parsed.reasoning_content
        return msg


class _SessionLock:
    def __init__(self, gw: TitoGateway, session_id: str) -> None:
        self.gw, self.sid = gw, session_id

    async def __aenter__(self) -> None:
        entry = self.gw._locks.setdefault(self.sid, _Lock())
        entry.users += 1
        try:
            await entry.lock.acquire()
        except BaseException:
            entry.users -= 1
            raise

    async def __aexit__(self, *exc: Any) -> None:
        entry = self.gw._locks[self.sid]
        entry.lock.release()
        entry.users -= 1
        if entry.users == 0:  # nobody holds or waits: drop it (no await since the check)
            self.gw._locks.pop(self.sid, None)


class TurnRun:
    """One turn in flight: writes the prompt, streams sampled tokens, then commits."""

    def __init__(self, gw: TitoGateway, plan: TurnPlan) -> None:
        self.gw = gw
        self.plan = plan
        self.result: TurnResult | None = None
        self.segment = 0

    async def tokens(self) -> AsyncIterator[TokenOut]:
        gw, plan = self.gw, self.plan
        backend = gw.backend
        sid = plan.session_id
        self.segment = plan.segment
        if plan.new_segment is not None:
            self.segment = await backend.start_segment(sid, plan.new_segment)
            if plan.count_rewrite:
                gw.counters.history_rewrite()
        if plan.append_ids:
            await backend.append_prompt_tokens(sid, plan.append_ids, 0)
        gw.stats[plan.path] += 1
        sampled: list[TokenOut] = []
        stops = plan.stop
        window = max((len(s) for s in stops), default=0) + 8
        stop_hit: str | None = None
        finish: str | None = None
        agen = backend.complete(sid, plan.prompt_ids, plan.params)
        try:
            async for tok in agen:
                sampled.append(tok)
                yield tok
                if stops:
                    tail = gw.tokenizer.decode([t.token_id for t in sampled[-window:]])
                    stop_hit = next((s for s in stops if s in tail), None)
                    if stop_hit is not None:
                        finish = "stop"
                        break
                if tok.finish_reason is not None:
                    finish = tok.finish_reason
                    break
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await aclose()
        await self._commit(sampled, finish or "stop", stop_hit)

    async def _commit(self, sampled: list[TokenOut], finish: str, stop_hit: str | None) -> None:
        gw, plan = self.gw, self.plan
        sid = plan.session_id
        completion = [t.token_id for t in sampled]
        rec = await gw.backend.get_session_tokens(sid, start=len(plan.prompt_ids))
        if rec is None:  # pragma: no cover - the session was just written
            rec_ids: list[int] = []
            segment, length = 0, 0
        else:
            rec_ids, segment, length = rec.token_ids, rec.segment, rec.length
        drift = sum(1 for a, b in zip(rec_ids, completion, strict=False) if a != b) + abs(
            len(rec_ids) - len(completion)
        )
        if drift:
            gw.counters.retokenization_drift(drift)
        self.segment = segment
        msg = gw.build_message(plan, completion, segment, stop_hit)
        finish_reason = (
            "tool_calls" if msg.get("tool_calls") else ("length" if finish == "length" else "stop")
        )
        history = plan.fingerprints + [message_fingerprint(msg)]
        state = {
            "v": STATE_VERSION,
            "segment": segment,
            "turn": plan.turn + 1,
            "history": history,
            "tools_key": plan.tools_key,
            "prompt_end": len(plan.prompt_ids),
            "committed_len": length,
        }
        await gw.backend.set_gateway_state(sid, state)
        self.result = TurnResult(
            session_id=sid,
            segment=segment,
            turn=plan.turn,
            prompt_len=len(plan.prompt_ids),
            completion_ids=completion,
            logprobs=[t.logprob for t in sampled],
            versions=[t.version for t in sampled],
            finish_reason=finish_reason,
            message=msg,
            drift=drift,
            path=plan.path,
            kind=plan.kind,
            invariant_ok=plan.invariant_ok,
        )

    async def run(self) -> TurnResult:
        async for _ in self.tokens():
            pass
        assert self.result is not None
        return self.result


# --------------------------------------------------------------------- naive baseline
def naive_rerender_drift(
    renderer: ChatRenderer,
    turns: list[tuple[list[dict], list[int]]],
    tools: list[dict] | None,
) -> int:
    """Drifted tokens of the naive loop: re-render every turn's messages and re-encode.

    ``turns[k] = (messages sent at turn k, completion ids sampled at turn k)``. The naive loop
    records ``render(messages[k])`` as prompt k and then trusts the re-rendered conversation;
    its record of completion k is what the re-render of turn k+1 holds at those positions.
    Returns how many of the sampled tokens it records wrongly (0 = no drift).
    """
    drift = 0
    for k in range(len(turns) - 1):
        msgs_k, comp_k = turns[k]
        p_k = renderer.render_ids(msgs_k, tools, add_generation_prompt=True)
        p_next = renderer.render_ids(turns[k + 1][0], tools, add_generation_prompt=True)
        seen = p_next[len(p_k) : len(p_k) + len(comp_k)]
        if p_next[: len(p_k)] != p_k:
            # The prefix itself moved: everything after the first difference is misplaced.
            drift += len(comp_k)
            continue
        drift += sum(1 for a, b in zip(seen, comp_k, strict=False) if a != b) + (
            len(comp_k) - len(seen)
        )
    return drift
