"""The warm-up's teacher and its demonstrations.

The teacher (`Demonstrator`) is the oracle, optionally with lapses (answering `unknown`
without using the tool): the warm-up learns the skills from the good episodes and inherits
the lapse rate, which leaves room that only the reward teaches.

Warm-up data (`demo_token_sequences`) runs teacher transcripts through the real gateway logic
(TitoGateway over an in-memory store, the teacher's completions replayed as if sampled), so
demos are token for token what the gateway records when a policy behaves like the teacher.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cells.trainer.toy_task.clients import LocalGateway
from cells.trainer.toy_task.gateway_link import ReplayEngine, load_renderer
from cells.trainer.toy_task.harness import run_episode
from cells.trainer.toy_task.task import (
    SUCCESS_REWARD,
    TOOLS,
    TOY_RENDERER,
    Episode,
    TaskSpec,
    make_episode,
)

UNKNOWN = "unknown"
"""What a lapsing teacher answers for a code it did not look up (not a code word)."""


@dataclass(frozen=True)
class Demonstrator:
    """The warm-up's teacher: the oracle, optionally with lapses that only the reward can
    correct. A lapse is a decision -- answer at once instead of calling the tool, or stop at
    a redirect instead of following it -- after which the teacher says the code is
    `unknown` (no code word, so the lapses add no noise to the copying the policy learns from
    the good episodes). The warmed-up policy inherits the lapse rate; RL sees its cost."""

    p_skip: float = 0.0
    """Answer at once, without any lookup."""
    p_give_up: float = 0.0
    """At each redirect, stop following that item."""

    def messages(self, episode: Episode, rng: random.Random | None = None) -> list[dict[str, Any]]:
        """The teacher's assistant turns: parallel lookups of every unresolved item, then
        the answer. Tool-call ids are placeholders (the gateway assigns the real ones)."""
        rng = rng or random.Random(0)
        if rng.random() < self.p_skip:
            return [{"role": "assistant", "content": answer_text([UNKNOWN] * len(episode.items))}]
        table = episode.table
        current = list(episode.items)
        codes: list[str | None] = [None] * len(current)
        turns: list[dict[str, Any]] = []
        while any(c is None for c in codes):
            calls = list(dict.fromkeys(cur for cur, c in zip(current, codes) if c is None))
            turns.append(assistant_call_message(calls))
            for k, cur in enumerate(current):
                if codes[k] is None:
                    e = table[cur]
                    if e.code is not None:
                        codes[k] = e.code
                    elif rng.random() < self.p_give_up:
                        codes[k] = UNKNOWN
                    else:
                        current[k] = e.redirect  # type: ignore[assignment]
        turns.append({"role": "assistant", "content": answer_text([c or "" for c in codes])})
        return turns


ORACLE = Demonstrator()


def oracle_messages(episode: Episode) -> list[dict[str, Any]]:
    """The ideal assistant turns (reward 1)."""
    return ORACLE.messages(episode)


def answer_text(codes: Sequence[str]) -> str:
    if len(codes) == 1:
        return f"code: {codes[0]}"
    return "codes: " + ", ".join(codes)


def assistant_call_message(items: Sequence[int]) -> dict[str, Any]:
    calls = [
        {
            "id": f"call_{j}",
            "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps({"item": i})},
        }
        for j, i in enumerate(items)
    ]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def completion_ids(renderer: Any, message: dict[str, Any], tools: list[dict] | None = TOOLS) -> list[int]:
    """The tokens a policy emits for `message`: the template's rendering of it as the last
    turn, after the generation prompt, through the turn-closing token."""
    base = [{"role": "user", "content": "x"}]
    r0 = renderer.render_ids(base, tools, add_generation_prompt=True)
    r1 = renderer.render_ids(base + [message], tools, add_generation_prompt=False)
    if r1[: len(r0)] != r0:
        raise ValueError("the assistant render does not extend the generation prompt")
    tail = r1[len(r0) :]
    stops = set(renderer.stop_token_ids)
    end = next(i for i, t in enumerate(tail) if t in stops)
    return tail[: end + 1]


def demo_transcripts(n: int, seed: int, *, spec: TaskSpec | None = None,
                     renderer: str = TOY_RENDERER,
                     teacher: Demonstrator = ORACLE) -> list[dict[str, Any]]:
    """`n` teacher episodes played through the gateway logic with the teacher's completions
    replayed as if sampled; each item is the recorded trajectory (`to_api` format, with its
    reward) plus the transcript under `messages`. Episodes and lapses are drawn from `seed`."""
    spec = spec or TaskSpec()
    rng = random.Random(seed)
    indices = rng.sample(range(1_000_000, 2_000_000), n)
    engine = ReplayEngine()
    out = []
    with LocalGateway(engine, renderer) as gw:
        for idx in indices:
            ep = make_episode(spec, idx)
            sid = f"demo-{seed}-{idx}"
            turns = teacher.messages(ep, rng)
            engine.script(sid, [completion_ids(gw.renderer, m) for m in turns])
            reward, stats = run_episode(gw, ep, session_id=sid, max_turns=len(turns))
            messages = stats["branches"][0]["messages"]
            played = [m for m in messages if m["role"] == "assistant"]
            if engine.pending(sid) or len(played) != len(turns) or (
                    teacher == ORACLE and reward != SUCCESS_REWARD):
                raise AssertionError(f"teacher episode {ep.episode_id} did not replay: {stats}")
            gw.finish(sid, reward, None)
            traj = gw.trajectory(sid)
            traj["messages"] = messages
            out.append(traj)
            del gw.backend.sessions[sid]
    return out


def demo_token_sequences(n: int, seed: int, *, spec: TaskSpec | None = None,
                         renderer: str = TOY_RENDERER, teacher: Demonstrator = ORACLE
                         ) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of `n` teacher demonstrations (the oracle by default), exactly
    as the gateway records them (mask 1 on the teacher's completions, 0 on prompts and tool
    output)."""
    out = []
    for t in demo_transcripts(n, seed, spec=spec, renderer=renderer, teacher=teacher):
        if len(t["segment_starts"]) != 1:
            raise AssertionError("a demo started a new segment")
        out.append((t["token_ids"], t["loss_mask"]))
    return out


def output_token_ids(spec: TaskSpec | None = None, renderer: str = TOY_RENDERER) -> list[int]:
    """Every token id a teacher completion can contain (lookups of every item, one and two at
    a time; answers with every code and `unknown`, one and two), plus the format's
    turn-closing ids."""
    spec = spec or TaskSpec()
    rend = load_renderer(renderer)
    items, codes = list(spec.items), list(spec.codes)
    messages = [assistant_call_message([i]) for i in items]
    messages += [assistant_call_message([a, b]) for a, b in zip(items, items[1:] + items[:1])]
    messages += [{"role": "assistant", "content": answer_text([c])} for c in codes]
    messages += [{"role": "assistant", "content": answer_text([a, b])}
                 for a, b in zip(codes, codes[1:] + codes[:1])]
    messages += [{"role": "assistant", "content": answer_text(u)}
                 for u in ([UNKNOWN], [UNKNOWN, UNKNOWN], [codes[0], UNKNOWN])]
    ids = set(rend.stop_token_ids)
    for m in messages:
        ids.update(completion_ids(rend, m))
    return sorted(ids)
