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

The parts: :mod:`~scheduler.gateway.tito.chat_request` (request -> messages, tools, sampling
params), :mod:`~scheduler.gateway.tito.fingerprints` (what the records are compared by),
:mod:`~scheduler.gateway.tito.planning` (the turn's prompt ids), :mod:`~scheduler.gateway.tito.turn`
(writing, streaming and committing a turn), :mod:`~scheduler.gateway.tito.session_locks`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from scheduler.gateway.tito.backend import CompletionBackend, GatewayCounters, SimpleCounters
from scheduler.gateway.tito.errors import GatewayError
from scheduler.gateway.tito.fingerprints import canonical_arguments, message_fingerprint
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest
from scheduler.gateway.tito.planning import TurnPlan, TurnPlanner
from scheduler.gateway.tito.render import ChatRenderer
from scheduler.gateway.tito.session_locks import SessionLocks
from scheduler.gateway.tito.turn import TurnDeps, TurnResult, TurnRun

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


class TitoGateway:
    """Per-session TITO logic over a :class:`CompletionBackend` (no HTTP here).

    A turn is ``plan`` (validate, compute the prompt; writes nothing) then ``start(plan)``
    (write, stream, commit), both under ``session_lock``.
    """

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
        self.stats: dict[str, int] = {
            "bridge": 0,
            "render_diff": 0,
            "full_render": 0,
            "invariant_violations": 0,
        }
        self.planner = TurnPlanner(
            backend,
            renderer,
            self.stats,
            use_bridge=use_bridge,
            default_max_tokens=default_max_tokens,
            max_prompt_tokens=max_prompt_tokens,
        )
        self.locks = SessionLocks()

    def session_lock(self, session_id: str) -> AbstractAsyncContextManager[None]:
        """Serialises turns of one session (concurrent requests wait their turn)."""
        return self.locks.hold(session_id)

    def forget(self, session_id: str) -> None:
        self.locks.forget(session_id)
        self.planner.kept.forget(session_id)

    async def plan(self, session_id: str, req: ChatCompletionRequest) -> TurnPlan:
        """Validate the request and compute the turn's prompt; writes nothing."""
        return await self.planner.plan(session_id, req)

    def start(self, plan: TurnPlan) -> TurnRun:
        return TurnRun(TurnDeps(self.backend, self.renderer, self.counters, self.stats), plan)


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
