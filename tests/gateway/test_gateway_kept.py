"""The gateway's kept render state: a turn reads only the tokens recorded since the last one,
checked against the backend's digest of the segment, and plans exactly what a whole read (and
a full render of a canonical conversation) gives."""

from __future__ import annotations

import asyncio
import copy

from test_gateway_tito import TOOLS, answer, req, tool_completion

from scheduler.gateway.tito.backend import SimpleCounters
from scheduler.gateway.tito.memory import InMemoryBackend, ReplayEngine
from scheduler.gateway.tito.tito import TitoGateway


class Counting(InMemoryBackend):
    """Counts the token ids the gateway reads back; `digests`: False hides `session_digest`."""

    def __init__(self, engine, digests: bool = True) -> None:
        super().__init__(engine)
        self.read = 0
        if not digests:
            self.session_digest = None

    async def get_session_tokens(self, session_id, start=0):
        out = await super().get_session_tokens(session_id, start)
        self.read += 0 if out is None else len(out.token_ids)
        return out


def _conversation(r, backend_digests: bool, corrupt_at: int | None = None, tool_call: bool = True):
    """Five turns of one session (tool call, tool result, answers, user follow-ups); returns
    (each turn's prompt, each turn's tokens read, the gateway, the final messages)."""
    engine = ReplayEngine()
    backend = Counting(engine, backend_digests)
    gw = TitoGateway(backend, r, SimpleCounters())
    completions = [tool_completion(r, '{"path": "a.py"}') if tool_call else answer(r, "Let me see.")]
    completions += [answer(r, f"Answer {k}.") for k in range(4)]
    engine.script("s", completions)
    prompts, reads = [], []

    async def go():
        msgs = [{"role": "user", "content": "read a.py"}]
        for k in range(len(completions)):
            if corrupt_at == k:  # negative control: the store's segment changed behind the kept copy
                ids = backend.sessions["s"].current.token_ids
                ids[3] = (ids[3] + 1) % 1000
            before = backend.read
            async with gw.session_lock("s"):
                res = await gw.start(await gw.plan("s", req(copy.deepcopy(msgs)))).run()
            prompts.append(backend.sessions["s"].current.token_ids[:res.prompt_len])
            reads.append(backend.read - before)
            msgs = msgs + [res.message]
            call = (res.message.get("tool_calls") or [None])[0]
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "x = 1"} if call
                        else {"role": "user", "content": f"and then {k}?"})
        return msgs

    msgs = asyncio.run(go())
    return prompts, reads, gw, msgs


def test_kept_turns_plan_what_a_whole_read_and_a_full_render_give(renderers):
    r = renderers["qwen3"]
    kept, reads, gw, msgs = _conversation(r, backend_digests=True)
    whole, whole_reads, gw_whole, _ = _conversation(r, backend_digests=False)
    assert kept == whole and gw.counters.retokenization_drift_total == 0
    # the first turn finds no session, the second reads it whole once, the rest are kept
    assert gw.planner.kept.stats["kept"] == len(kept) - 2 and gw_whole.planner.kept.stats["kept"] == 0
    # each later turn reads back only the previous turn's appended prompt and completion
    for k in range(2, len(kept)):
        assert reads[k] < len(kept[k - 1]) // 2 < whole_reads[k]
    # canonical answers only: each incremental prompt is the full render of the conversation
    plain, _, _, msgs = _conversation(r, backend_digests=True, tool_call=False)
    for k, prompt in enumerate(plain):
        full = r.render_ids(msgs[:2 * k + 1], TOOLS, add_generation_prompt=True)
        assert prompt == full
        wrong = copy.deepcopy(msgs[:2 * k + 1])
        wrong[-1]["content"] += "!"  # negative control: one message changed renders otherwise
        assert r.render_ids(wrong, TOOLS, add_generation_prompt=True) != prompt


def test_a_kept_copy_that_differs_from_the_store_is_read_again(renderers):
    r = renderers["qwen3"]
    good, *_ = _conversation(r, backend_digests=True)
    bad, _, gw, _ = _conversation(r, backend_digests=True, corrupt_at=3)
    assert bad[:3] == good[:3] and bad[3] != good[3]
    # the digest told the kept copy from the store's segment: the turn read it whole and
    # extended what the store holds, not the stale copy
    assert bad[3][3] == (good[3][3] + 1) % 1000 and bad[3][:3] + bad[3][4:] == good[3][:3] + good[3][4:]
    assert gw.planner.kept.stats["whole"] == 3 and gw.planner.kept.stats["kept"] == len(good) - 3
