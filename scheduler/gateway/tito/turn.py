"""One turn in flight: write the prompt, stream the sampled tokens, then commit.

Commit reads back what the backend recorded, counts drift against what it reported
sampling, parses the assistant message and stores the gateway state the next turn's plan
extends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from scheduler.gateway.tito.backend import CompletionBackend, GatewayCounters, Rewind, TokenOut
from scheduler.gateway.tito.fingerprints import message_fingerprint
from scheduler.gateway.tito.planning import STATE_VERSION, TurnPlan
from scheduler.gateway.tito.render import ChatRenderer

__all__ = ["TurnDeps", "TurnResult", "TurnRun", "assistant_message", "tool_call_id"]


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


def tool_call_id(session_id: str, segment: int, turn: int, index: int) -> str:
    """A tool call's id, the same every time this call of this turn is parsed."""
    h = hashlib.blake2b(f"{session_id}\x00{segment}\x00{turn}\x00{index}".encode(), digest_size=12)
    return "call_" + h.hexdigest()


def assistant_message(
    renderer: ChatRenderer,
    plan: TurnPlan,
    completion: list[int],
    segment: int,
    stop_hit: str | None,
) -> dict[str, Any]:
    """The completion as an OpenAI assistant message (content cut at a stop string)."""
    parsed = renderer.parse_response(completion, plan.tools, plan.prompt_ids)
    content = parsed.content or ""
    if stop_hit is not None:
        cut = content.find(stop_hit)
        if cut >= 0:
            content = content[:cut]
    calls = [] if plan.tool_choice == "none" else _tool_calls(parsed, plan, segment)
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content if (content or not calls) else None,
    }
    if calls:
        msg["tool_calls"] = calls
    if parsed.reasoning_content:
        msg["reasoning_content"] = parsed.reasoning_content
    return msg


def _tool_calls(parsed: Any, plan: TurnPlan, segment: int) -> list[dict[str, Any]]:
    from renderers import ToolCallParseStatus

    # a sampled name that is not a non-empty string is no call: the response must
    # validate, and the harness's echo of it must be accepted on the next turn
    ok = [tc for tc in parsed.tool_calls
          if tc.status == ToolCallParseStatus.OK and isinstance(tc.name, str) and tc.name]
    calls = []
    for i, tc in enumerate(ok):
        args = tc.arguments
        args_text = (
            args
            if isinstance(args, str)
            else json.dumps(args if args is not None else {}, ensure_ascii=False)
        )
        calls.append(
            {
                "id": tool_call_id(plan.session_id, segment, plan.turn, i),
                "type": "function",
                "function": {"name": tc.name, "arguments": args_text},
            }
        )
    return calls


@dataclass(frozen=True)
class TurnDeps:
    """What a turn uses of its gateway: where tokens come from and go, how text is made and
    parsed, what it counts."""

    backend: CompletionBackend
    renderer: ChatRenderer
    counters: GatewayCounters
    stats: dict[str, int]
    """The gateway's per-path counts, shared (a turn adds its own)."""

    @property
    def tokenizer(self) -> Any:
        return self.renderer.tokenizer


class TurnRun:
    """One turn in flight: writes the prompt, streams sampled tokens, then commits."""

    def __init__(self, gw: TurnDeps, plan: TurnPlan) -> None:
        self.gw = gw
        self.plan = plan
        self.result: TurnResult | None = None
        self.segment = 0

    async def tokens(self, live: bool = True) -> AsyncIterator[TokenOut]:
        """Write the plan's prompt, then yield each sampled token; commit at the end. Not
        `live` (the whole answer is returned at the end): tokens the backend takes back
        before then are dropped (what was yielded of them is not the answer)."""
        await self._write_prompt()
        gw, plan = self.gw, self.plan
        sampled: list[TokenOut] = []
        stops = plan.stop
        window = max((len(s) for s in stops), default=0) + 8
        stop_hit: str | None = None
        finish: str | None = None
        agen = gw.backend.complete(plan.session_id, plan.prompt_ids, plan.params, live)
        try:
            async for tok in agen:
                if isinstance(tok, Rewind):
                    del sampled[tok.keep:]
                    continue
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

    async def _write_prompt(self) -> None:
        gw, plan = self.gw, self.plan
        sid = plan.session_id
        self.segment = plan.segment
        if plan.new_segment is not None:
            self.segment = await gw.backend.start_segment(sid, plan.new_segment)
            if plan.count_rewrite:
                gw.counters.history_rewrite()
        if plan.append_ids:
            await gw.backend.append_prompt_tokens(sid, plan.append_ids, 0)
        gw.stats[plan.path] += 1

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
        msg = assistant_message(gw.renderer, plan, completion, segment, stop_hit)
        finish_reason = (
            "tool_calls" if msg.get("tool_calls") else ("length" if finish == "length" else "stop")
        )
        await gw.backend.set_gateway_state(sid, _gateway_state(plan, msg, segment, length))
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
        async for _ in self.tokens(live=False):
            pass
        assert self.result is not None
        return self.result


def _gateway_state(plan: TurnPlan, msg: dict[str, Any], segment: int, length: int) -> dict:
    """What the next turn's plan extends: the conversation's fingerprints and its buffer."""
    return {
        "v": STATE_VERSION,
        "segment": segment,
        "turn": plan.turn + 1,
        "history": plan.fingerprints + [message_fingerprint(msg)],
        "tools_key": plan.tools_key,
        "prompt_end": len(plan.prompt_ids),
        "committed_len": length,
    }
