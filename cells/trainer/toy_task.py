"""A toy agentic task small enough to learn on CPU: look up item codes with a tool, then answer.

The user asks for the code of one item (or of two: the policy should make two parallel tool
calls in one assistant turn). The `lookup` tool reads the episode's table (drawn from the task
seed and the episode index, so codes cannot be memorised); an entry either holds a code or
redirects to another item ("see item M"), so some episodes need chained lookups and episode
lengths are long-tailed. The final assistant message must state the code(s). The reward (`score_messages`) is computed from the transcript alone:

    solved (the answer's code words == the expected codes, in order)   R = 1
    otherwise   R = 0.5 · call_credit + 0.3 · code_credit                 (≤ 0.8)
    call_credit = |needed ∩ looked up| / |needed ∪ looked up|   (Jaccard: spurious calls cost)
    code_credit = fraction of asked items whose code is right at its place in the answer

`needed` is every item on the redirect chains of the asked items; `looked up` the items of
well-formed `lookup` calls (an integer `item`). So format and correct tool use earn partial
credit, and only a correct final answer earns 1.

The harness (`run_episode`) talks OpenAI chat completions through a `chat` callable (the
scheduler's gateway over HTTP: `HttpChat`; in-process: `LocalGateway`), executes the tool
calls, and never tokenizes: the gateway records the tokens. Sub-agent branches: with
`branches=k` the episode forks after the first tool results into k sessions (`sid`,
`sid.b1`, ... `sid.b{k-1}`) that share those messages, each finishing with its own reward and
the same `group_id`. A trainer recognises a tree as the sessions of one group whose ids share
the stem before `.b`, and whose token ids share a prefix (branch 0 sampled it; the others got
the same tokens from the gateway's full render of the shared messages): `rollout_tree` builds
the `RolloutTree` of objectives/tree.py from them. Treated as separate sequences, the branches
give the same loss as the tree except that the shared sampled tokens count once (in branch 0)
instead of once per branch.

Warm-up data (`demo_token_sequences`) runs teacher transcripts through the real gateway logic
(TitoGateway over an in-memory store, the teacher's completions replayed as if sampled), so
demos are token for token what the gateway records when a policy behaves like the teacher.
The teacher (`Demonstrator`) is the oracle, optionally with lapses (answering `unknown`
without using the tool): the warm-up learns the skills from the good episodes and inherits
the lapse rate, which leaves room that only the reward teaches.

The chat format is `qwen3-nothink` (TOY_RENDERER): its full render of a conversation equals
the gateway's incremental buffer, which makes branch prefixes shareable. In-process, `ToySampler`
serves an EmbeddedEngine (batch-invariant) through `LocalGateway`, with exact old log-probs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cells.trainer.objectives.tree import MAX_BRANCHES, RolloutTree

TOY_RENDERER = "qwen3-nothink"
"""Chat format of the toy task (configure the gateway with `renderer: qwen3-nothink`)."""

CODE_WORDS: tuple[str, ...] = (
    "red", "blue", "green", "gold", "silver", "black", "white", "pink",
    "gray", "brown", "amber", "ruby", "lime", "rose", "sand", "snow",
)
"""Codes: each is one Qwen3 token after a space, so copying a code is copying one token."""

LOOKUP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up an item's code.",
        "parameters": {
            "type": "object",
            "properties": {"item": {"type": "integer"}},
            "required": ["item"],
        },
    },
}
TOOLS: list[dict[str, Any]] = [LOOKUP_TOOL]

SUCCESS_REWARD = 1.0
CALL_WEIGHT = 0.5
CODE_WEIGHT = 0.3


# ----------------------------------------------------------------------------- the task
@dataclass(frozen=True)
class Entry:
    """One table row: a code, or a redirect to another item."""

    code: str | None
    redirect: int | None
    depth: int
    """Redirects to follow before a code (0 for a code)."""


@dataclass(frozen=True)
class TaskSpec:
    """Everything that fixes the episode distribution (tables, questions)."""

    seed: int = 0
    first_item: int = 1
    num_items: int = 9
    """Items are first_item .. first_item + num_items − 1 (one digit, one token, by default)."""
    codes: tuple[str, ...] = CODE_WORDS
    p_pair: float = 0.3
    """Probability that a question asks for two items (two parallel calls)."""
    p_redirect: float = 0.35
    """Probability that an entry redirects to another item."""
    max_depth: int = 2
    """Longest redirect chain."""

    def __post_init__(self) -> None:
        if self.num_items < 2 or self.first_item < 0:
            raise ValueError("need num_items >= 2 and first_item >= 0")
        if not self.codes or len(set(self.codes)) != len(self.codes):
            raise ValueError("codes must be distinct and non-empty")
        if not all(re.fullmatch(r"[a-z]+", c) for c in self.codes):
            raise ValueError("codes must be lowercase words")
        for name in ("p_pair", "p_redirect"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1]")

    @property
    def items(self) -> range:
        return range(self.first_item, self.first_item + self.num_items)


def draw_table(spec: TaskSpec, rng: random.Random) -> dict[int, Entry]:
    """A table: items placed in a random order, each redirecting (with p_redirect) to an
    already placed item of depth < max_depth, so chains are acyclic and end at a code."""
    order = list(spec.items)
    rng.shuffle(order)
    table: dict[int, Entry] = {}
    for item in order:
        targets = [i for i, e in table.items() if e.depth < spec.max_depth]
        if targets and rng.random() < spec.p_redirect:
            target = rng.choice(targets)
            table[item] = Entry(None, target, table[target].depth + 1)
        else:
            table[item] = Entry(rng.choice(spec.codes), None, 0)
    return dict(sorted(table.items()))


@dataclass(frozen=True)
class Episode:
    """One question and its own table; deterministic from (spec, index). The table is drawn
    per episode so that the codes cannot be memorised: the policy has to use the tool."""

    spec: TaskSpec
    index: int
    items: tuple[int, ...]
    entries: tuple[tuple[int, Entry], ...]

    @property
    def table(self) -> dict[int, Entry]:
        return dict(self.entries)

    @property
    def episode_id(self) -> str:
        return f"toy{self.spec.seed}-{self.index}"

    @property
    def question(self) -> str:
        if len(self.items) == 1:
            return f"What is the code of item {self.items[0]}?"
        return f"What are the codes of items {self.items[0]} and {self.items[1]}?"

    def chain(self, item: int) -> list[int]:
        """The items visited from `item` to its code."""
        table, out = self.table, [item]
        while table[out[-1]].redirect is not None:
            out.append(table[out[-1]].redirect)  # type: ignore[arg-type]
        return out

    @property
    def expected(self) -> tuple[str, ...]:
        table = self.table
        return tuple(table[self.chain(i)[-1]].code or "" for i in self.items)

    @property
    def needed(self) -> frozenset[int]:
        return frozenset(i for item in self.items for i in self.chain(item))

    @property
    def depth(self) -> int:
        """Tool turns the oracle needs (1 + the longest redirect chain)."""
        return max(len(self.chain(i)) for i in self.items)

    def messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.question}]


def make_episode(spec: TaskSpec, index: int) -> Episode:
    rng = random.Random(spec.seed * 1_000_003 + index + 1)
    table = draw_table(spec, rng)
    k = 2 if rng.random() < spec.p_pair else 1
    return Episode(spec, index, tuple(rng.sample(list(spec.items), k)), tuple(table.items()))


def make_episodes(spec: TaskSpec, n: int, start: int = 0) -> list[Episode]:
    return [make_episode(spec, i) for i in range(start, start + n)]


HELDOUT_START = 10_000_000
"""First episode index of the held-out set. The agents play indices from 0 up and the warm-up's
demonstrations are drawn from [1_000_000, 2_000_000): no trained or demonstrated episode
reaches it (each index draws its own table, so its codes were never seen either)."""


def heldout_episodes(spec: TaskSpec, n: int) -> list[Episode]:
    """The fixed held-out episodes: never trained on, never demonstrated."""
    return make_episodes(spec, n, start=HELDOUT_START)


# ----------------------------------------------------------------------------- the tool
def parse_item(arguments: Any) -> int | None:
    """The `item` argument of a lookup call as an int; None when malformed."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    item = arguments.get("item")
    if isinstance(item, bool) or not isinstance(item, int):
        return None
    return item


def lookup(episode: Episode, arguments: Any) -> str:
    """The tool: `item N: code C`, `item N: see item M`, or an error line."""
    item = parse_item(arguments)
    if item is None:
        return "error: lookup needs an integer item"
    entry = episode.table.get(item)
    if entry is None:
        return f"item {item}: no such item"
    if entry.code is not None:
        return f"item {item}: code {entry.code}"
    return f"item {item}: see item {entry.redirect}"


def execute_tool(episode: Episode, name: str, arguments: Any) -> str:
    if name != "lookup":
        return f"error: unknown tool {name}"
    return lookup(episode, arguments)


# ----------------------------------------------------------------------------- reward
@dataclass(frozen=True)
class Score:
    """The reward and what it is made of."""

    reward: float
    solved: bool
    call_credit: float
    code_credit: float
    answered: bool
    looked_up: tuple[int, ...]
    answer_codes: tuple[str, ...]
    num_calls: int


def answer_codes(spec: TaskSpec, content: str | None) -> tuple[str, ...]:
    """Code words in an answer, in order."""
    codes = set(spec.codes)
    return tuple(w for w in re.findall(r"[a-z]+", (content or "").lower()) if w in codes)


def score_messages(episode: Episode, messages: Sequence[dict[str, Any]]) -> Score:
    """Reward of a transcript (OpenAI messages); see the module docstring for the formula.

    The answer is the last message when it is an assistant message without tool calls."""
    looked: list[int] = []
    num_calls = 0
    for m in messages:
        if m.get("role") != "assistant":
            continue
        for tc in m.get("tool_calls") or ():
            num_calls += 1
            fn = tc.get("function") or {}
            item = parse_item(fn.get("arguments")) if fn.get("name") == "lookup" else None
            if item is not None:
                looked.append(item)
    last = messages[-1] if messages else {}
    answered = last.get("role") == "assistant" and not last.get("tool_calls")
    codes = answer_codes(episode.spec, last.get("content")) if answered else ()
    needed = episode.needed
    seen = set(looked)
    call_credit = len(needed & seen) / len(needed | seen)
    expected = episode.expected
    code_credit = sum(a == e for a, e in zip(codes, expected)) / len(expected)
    solved = codes == expected
    reward = SUCCESS_REWARD if solved else CALL_WEIGHT * call_credit + CODE_WEIGHT * code_credit
    return Score(reward, solved, call_credit, code_credit, answered, tuple(looked), codes, num_calls)


# ----------------------------------------------------------------------------- the oracle
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


# ----------------------------------------------------------------------------- the harness
class ChatFn(Protocol):
    """`chat(messages, tools, session_id, **sampling) -> assistant message` (OpenAI form)."""

    def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, session_id: str,
        **sampling: Any,
    ) -> dict[str, Any]: ...


FinishFn = Callable[[str, float, "str | None"], Any]
"""`finish(session_id, reward, group_id)`: close a session into a trajectory."""


class ChatError(RuntimeError):
    """The chat endpoint refused a request."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"chat endpoint answered {status}: {body}")
        self.status = status
        self.body = body


def echo_message(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as a harness appends it to its history (OpenAI fields only)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": tc["id"], "type": "function",
             "function": {"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}}
            for tc in message["tool_calls"]
        ]
    return out


def well_formed(message: dict[str, Any]) -> bool:
    """Whether every tool call of an assistant message can be sent back in OpenAI form (the
    gateway may pass on a parsed call whose name is not a string)."""
    for tc in message.get("tool_calls") or ():
        fn = tc.get("function") or {}
        if not isinstance(tc.get("id"), str) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments"), str):
            return False
    return True


def _turn(chat: ChatFn, episode: Episode, messages: list[dict[str, Any]], session_id: str,
          sampling: dict[str, Any]) -> tuple[bool, int]:
    """One assistant turn plus its tool results, appended to `messages`.

    Returns (whether the episode is over, number of tool calls). It is over when the model
    answered without tool calls, or made a call that cannot be sent back (the transcript
    then ends with that call, unanswered)."""
    msg = chat(messages, TOOLS, session_id, **sampling)
    calls = msg.get("tool_calls") or []
    if not well_formed(msg):
        messages.append({"role": "assistant", "content": msg.get("content"),
                         "tool_calls": [{"id": "malformed", "type": "function",
                                         "function": {"name": "", "arguments": ""}}]})
        return True, len(calls)
    messages.append(echo_message(msg))
    for tc in calls:
        fn = tc["function"]
        content = execute_tool(episode, fn["name"], fn["arguments"])
        messages.append({"role": "tool", "tool_call_id": tc["id"], "content": content})
    return not calls, len(calls)


def _finish_branch(episode: Episode, messages: list[dict[str, Any]], session_id: str,
                   turns: int, max_parallel: int, finish: FinishFn | None,
                   group_id: str | None) -> dict[str, Any]:
    s = score_messages(episode, messages)
    if finish is not None:
        finish(session_id, s.reward, group_id)
    return {
        "session_id": session_id, "reward": s.reward, "solved": s.solved, "answered": s.answered,
        "call_credit": s.call_credit, "code_credit": s.code_credit, "turns": turns,
        "tool_calls": s.num_calls, "max_parallel": max_parallel, "messages": messages,
    }


def branch_session_id(session_id: str, branch: int) -> str:
    """Branch 0 continues in the trunk's session; branch b > 0 is `{session_id}.b{b}`."""
    return session_id if branch == 0 else f"{session_id}.b{branch}"


def run_episode(
    chat: ChatFn,
    episode: Episode,
    *,
    session_id: str,
    max_turns: int = 6,
    sampling: dict[str, Any] | None = None,
    branches: int = 1,
    group_id: str | None = None,
    finish: FinishFn | None = None,
) -> tuple[float, dict[str, Any]]:
    """Play one episode; returns (reward, stats). With `branches` = k > 1 the episode forks
    after the first turn's tool results into k sessions; the reward is then their mean and
    `stats["branches"]` holds each one. `finish`, when given, closes every session with its
    own reward and `group_id`, once every branch ended: the branches first, the trunk session
    last (cells/trainer/groups.py counts a tree as one member, complete with its trunk)."""
    if not 1 <= branches <= MAX_BRANCHES:
        raise ValueError(f"branches must lie in [1, {MAX_BRANCHES}]")
    if max_turns < 1:
        raise ValueError("max_turns must be >= 1")
    sampling = dict(sampling or {})
    messages = episode.messages()
    over, n = _turn(chat, episode, messages, session_id, sampling)
    starts = [(branch_session_id(session_id, b), list(messages), n) for b in range(branches)]
    if over:
        starts = starts[:1]  # nothing to fork from: the model answered at once
    results = []
    for sid, msgs, first_calls in starts:
        turns, max_par, done = 1, first_calls, over
        while not done and turns < max_turns:
            done, n = _turn(chat, episode, msgs, sid, sampling)
            turns += 1
            max_par = max(max_par, n)
        results.append(_finish_branch(episode, msgs, sid, turns, max_par, None, group_id))
    if finish is not None:  # the branches first, the trunk last: a trainer takes a tree's
        for r in results[1:] + results[:1]:  # member as complete once its trunk finished
            finish(r["session_id"], r["reward"], group_id)
    reward = sum(r["reward"] for r in results) / len(results)
    stats = {
        "episode_id": episode.episode_id,
        "reward": reward,
        "solved": sum(r["solved"] for r in results) / len(results),
        "turns": max(r["turns"] for r in results),
        "tool_calls": sum(r["tool_calls"] for r in results),
        "max_parallel": max(r["max_parallel"] for r in results),
        "branches": results,
    }
    return reward, stats


class HttpChat:
    """`ChatFn` over the scheduler's OpenAI-compatible gateway (`/v1/chat/completions`, the
    session in `X-Session-Id`), plus `finish` (`/v1/sessions/{id}/finish`)."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 120.0,
                 client: Any = None) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = client if client is not None else httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout)
        self.headers = headers

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 session_id: str, **sampling: Any) -> dict[str, Any]:
        body = {"messages": messages, **({"tools": tools} if tools else {}), **sampling}
        r = self.client.post("/v1/chat/completions", json=body,
                             headers={**self.headers, "X-Session-Id": session_id})
        if r.status_code != 200:
            raise ChatError(r.status_code, r.text)
        return r.json()["choices"][0]["message"]

    def finish(self, session_id: str, reward: float, group_id: str | None = None) -> dict[str, Any]:
        r = self.client.post(f"/v1/sessions/{session_id}/finish",
                             json={"reward": reward, "group_id": group_id}, headers=self.headers)
        if r.status_code != 200:
            raise ChatError(r.status_code, r.text)
        return r.json()

    def close(self) -> None:
        self.client.close()


# ----------------------------------------------------------------------------- in-process gateway
class LocalGateway:
    """The real TitoGateway over an in-memory session store, on a private event-loop thread.

    A `ChatFn` usable from any number of threads (the turns of concurrent episodes then meet
    in the same engine steps). `engine` is anything with the ReplayEngine's async `generate`
    (a ReplayEngine for scripted demos, an `EngineDriver` around an EmbeddedEngine to sample).
    """

    def __init__(self, engine: Any, renderer: str = TOY_RENDERER) -> None:
        from scheduler.gateway.memory import InMemoryBackend
        from scheduler.gateway.render import load_renderer
        from scheduler.gateway.tito import TitoGateway

        self.backend = InMemoryBackend(engine, cells=("cell-0",))
        self.renderer = load_renderer(renderer)
        self.gateway = TitoGateway(self.backend, self.renderer)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="toy-gateway")
        self._thread.start()

    def __enter__(self) -> LocalGateway:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the gateway's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __call__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 session_id: str, **sampling: Any) -> dict[str, Any]:
        from scheduler.gateway.openai_schema import ChatCompletionRequest
        from scheduler.gateway.tito import GatewayError

        req = ChatCompletionRequest.model_validate(
            {"messages": messages, **({"tools": tools} if tools else {}), **sampling})

        async def turn() -> dict[str, Any]:
            async with self.gateway.session_lock(session_id):
                plan = await self.gateway.plan(session_id, req)
                res = await self.gateway.start(plan).run()
            return res.message

        try:
            return self.run(turn())
        except GatewayError as e:
            raise ChatError(e.status, e.message) from None

    def finish(self, session_id: str, reward: float, group_id: str | None = None) -> dict[str, Any]:
        return self.run(self.backend.finish_session(session_id, reward, group_id))

    def trajectory(self, session_id: str) -> dict[str, Any]:
        """The session in the store's `to_api` format (old log-probs not yet scored)."""
        sess = self.backend.sessions[session_id]
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float | None] = []
        versions: list[int | None] = []
        starts: list[int] = []
        for seg in sess.segments:
            starts.append(len(ids))
            ids += seg.token_ids
            mask += seg.loss_mask
            lps += seg.logprobs
            versions += seg.versions
        n = len(ids)
        return {
            "id": session_id, "state": "finished" if sess.finished else "open",
            "reward": sess.reward, "group_id": sess.group_id, "segment_starts": starts,
            "token_ids": ids, "loss_mask": mask, "logprobs": lps, "versions": versions,
            "old_logprobs": [None] * n, "provenance": [None] * n,
        }

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


class EngineDriver:
    """Async `generate` (the ReplayEngine interface) over an EmbeddedEngine, stepped on the
    gateway's loop: every request in flight shares each engine step (continuous batching).

    Call the engine's own methods (`load_weights`, `score`) only while no request is in flight.
    """

    def __init__(self, engine: Any, *, max_tokens: int = 64) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        """Cap on a completion's length (the request's own limit applies when smaller)."""
        self._queues: dict[str, asyncio.Queue] = {}
        self._pump: asyncio.Task | None = None
        self._turns: dict[str, int] = {}
        self.sampled_tokens = 0

    def sampling_params(self, params: dict[str, Any]) -> Any:
        from cells.engine.records import SamplingParams

        limit = params.get("max_tokens")
        return SamplingParams(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=max(0, int(params.get("top_k") or 0)),
            max_tokens=min(self.max_tokens, limit) if limit else self.max_tokens,
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            seed=int(params.get("seed") or 0),
        )

    async def generate(self, session_id: str, prompt_ids: list[int], params: dict[str, Any],
                       request_id: str):
        from scheduler.gateway.backend import TokenOut

        # The engine's request id (and so the sampling noise) is the session's n-th turn,
        # not the backend's global counter, which depends on how sessions interleave.
        turn = self._turns.get(session_id, 0)
        self._turns[session_id] = turn + 1
        request_id = f"{session_id}#{turn}"
        self.engine.add_request(request_id, list(prompt_ids), self.sampling_params(params),
                                cache_key=session_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, BaseException):
                    raise RuntimeError("the engine step failed") from ev
                self.sampled_tokens += 1
                rec = ev.record
                yield TokenOut(rec.token_id, rec.logprob, rec.version, ev.finish_reason)
                if ev.finish_reason is not None:
                    return
        finally:
            self._queues.pop(request_id, None)
            if request_id in self.engine.requests:
                self.engine.abort(request_id)

    async def _run(self) -> None:
        try:
            while self.engine.has_work():
                for ev in self.engine.step():
                    q = self._queues.get(ev.request_id)
                    if q is not None:
                        q.put_nowait(ev)
                await asyncio.sleep(0)  # let finished turns and new requests in
        except Exception as e:  # fail the waiting turns rather than leave them hanging
            for q in self._queues.values():
                q.put_nowait(e)

    def forget(self, session_id: str) -> None:
        """Drop the turn counter of a finished session."""
        self._turns.pop(session_id, None)


class ToySampler:
    """Toy-task rollouts from a batch-invariant EmbeddedEngine through the in-process gateway,
    with exact old log-probs scored by the engine (the log-prob service's job in the fleet).

    Sampling noise depends on (seed, session id, turn, token index) only, and the engine is
    batch-invariant, so the same weights, session ids and seed give the same rollouts however
    the concurrent episodes interleave.
    """

    def __init__(self, model_spec: Any, weights: dict[str, Any], *, version: int = 0,
                 row_tile: int = 4, renderer: str = TOY_RENDERER, max_tokens: int = 64,
                 threads: int = 32, max_running: int = 64) -> None:
        from cells.engine.embedded import EmbeddedEngine
        from scheduler.config import EmbeddedEngineConfig

        cfg = EmbeddedEngineConfig(batch_invariant=True, row_tile=row_tile, num_blocks=8192,
                                   max_running=max_running, prefill_chunk=8192)
        self.engine = EmbeddedEngine(cfg, spec=model_spec, weights=weights, version=version)
        self.driver = EngineDriver(self.engine, max_tokens=max_tokens)
        self.gateway = LocalGateway(self.driver, renderer)
        self.threads = threads

    def close(self) -> None:
        self.gateway.close()

    def load(self, version: int, weights: dict[str, Any]) -> None:
        """Serve `version` (between rollout batches)."""
        self.engine.load_weights(version, weights)  # cached prefixes of old versions are
        # never reused (the engine checks the version) and are evicted when blocks run short

    def rollouts(self, episodes: Sequence[Episode], *, samples: int = 1, tag: str = "",
                 seed: int = 0, temperature: float = 1.0, max_turns: int = 6,
                 branches: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Play `samples` sessions per episode (group = the episode), concurrently; returns
        (finished trajectories with old log-probs, per-session episode stats)."""
        from concurrent.futures import ThreadPoolExecutor

        gw = self.gateway
        sampling = {"temperature": temperature, "seed": seed}
        jobs = [(ep, f"{tag}{ep.episode_id}-s{j}", f"{tag}{ep.episode_id}")
                for ep in episodes for j in range(samples)]

        def play(job: tuple[Episode, str, str]) -> dict[str, Any]:
            ep, sid, gid = job
            _, stats = run_episode(gw, ep, session_id=sid, max_turns=max_turns,
                                   sampling=sampling, branches=branches, group_id=gid,
                                   finish=gw.finish)
            return stats

        with ThreadPoolExecutor(self.threads) as pool:
            stats = list(pool.map(play, jobs))
        trajs = []
        for st in stats:
            for b in st["branches"]:
                t = gw.trajectory(b["session_id"])
                self.score_old_logprobs(t, temperature)
                trajs.append(t)
                del gw.backend.sessions[b["session_id"]]
                self.driver.forget(b["session_id"])
        gw.backend.turn_log.clear()
        return trajs, stats

    def score_old_logprobs(self, traj: dict[str, Any], temperature: float = 1.0) -> None:
        """Fill `old_logprobs` / `provenance` of the sampled tokens (exact where the engine
        holds their version, else missing)."""
        n = len(traj["token_ids"])
        starts = list(traj["segment_starts"]) + [n]
        held = set(self.engine.versions_held)
        for a, b in zip(starts, starts[1:]):
            sampled = [i for i in range(a, b) if traj["loss_mask"][i]]
            for v in sorted({traj["versions"][i] for i in sampled}):
                idx = [i for i in sampled if traj["versions"][i] == v]
                if v not in held:
                    for i in idx:
                        traj["provenance"][i] = "missing"
                    continue
                lp = self.engine.score(traj["token_ids"][a:b], temperature=temperature,
                                       version=v).tolist()
                for i in idx:
                    traj["old_logprobs"][i] = lp[i - a - 1]
                    traj["provenance"][i] = "exact"


def heldout_eval(model_spec: Any, weights: dict[str, Any], spec: TaskSpec, n: int, *,
                 row_tile: int = 4, max_turns: int = 6) -> dict[str, float]:
    """Greedy (temperature 0) score of `weights` on the first `n` held-out episodes, one
    session each, in-process: mean reward and solved rate. Deterministic for given weights."""
    sampler = ToySampler(model_spec, weights, row_tile=row_tile)
    try:
        _, stats = sampler.rollouts(heldout_episodes(spec, n), samples=1, tag="heldout-",
                                    temperature=0.0, max_turns=max_turns)
    finally:
        sampler.close()
    return {"reward": sum(s["reward"] for s in stats) / len(stats),
            "solved": sum(s["solved"] for s in stats) / len(stats)}


# ----------------------------------------------------------------------------- demos
def demo_transcripts(n: int, seed: int, *, spec: TaskSpec | None = None,
                     renderer: str = TOY_RENDERER,
                     teacher: Demonstrator = ORACLE) -> list[dict[str, Any]]:
    """`n` teacher episodes played through the gateway logic with the teacher's completions
    replayed as if sampled; each item is the recorded trajectory (`to_api` format, with its
    reward) plus the transcript under `messages`. Episodes and lapses are drawn from `seed`."""
    from scheduler.gateway.memory import ReplayEngine

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
    from scheduler.gateway.render import load_renderer

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


# ----------------------------------------------------------------------------- trees
@dataclass
class BranchGroup:
    """Sessions of one forked episode: the stem id and the branch trajectories by index."""

    stem: str
    branches: dict[int, dict[str, Any]] = field(default_factory=dict)


def branch_groups(trajectories: Iterable[dict[str, Any]]) -> list[BranchGroup]:
    """Group trajectories by (group_id, stem): `sid` is branch 0, `sid.b{k}` branch k."""
    groups: dict[tuple[Any, str], BranchGroup] = {}
    for t in trajectories:
        m = re.fullmatch(r"(.*)\.b([1-9][0-9]*)", t["id"])
        stem, b = (m.group(1), int(m.group(2))) if m else (t["id"], 0)
        g = groups.setdefault((t.get("group_id"), stem), BranchGroup(stem))
        g.branches[b] = t
    return list(groups.values())


def rollout_tree(branches: Sequence[dict[str, Any]]) -> tuple[RolloutTree, list[int]]:
    """The rollout tree of forked sessions (single-segment trajectories): the longest common
    prefix of their token ids is the root (loss mask: 1 where any branch sampled the token),
    each branch's remainder a leaf. Returns (tree, leaf of each branch in input order)."""
    if not branches:
        raise ValueError("no branches")
    seqs = [b["token_ids"] for b in branches]
    for b in branches:
        if len(b.get("segment_starts", [0])) != 1:
            raise ValueError(f"trajectory {b.get('id')} has several segments")
    n = min(len(s) for s in seqs)
    common = 0
    while common < n and all(s[common] == seqs[0][common] for s in seqs):
        common += 1
    if len(branches) > 1:
        common = min(common, n - 1)  # every branch keeps at least one token of its own
    tree = RolloutTree()
    root_mask = [any(b["loss_mask"][i] for b in branches) for i in range(common)]
    root = tree.add_node(seqs[0][:common], None, root_mask) if common else None
    leaves = [tree.add_node(b["token_ids"][common:], root, [bool(x) for x in b["loss_mask"][common:]])
              for b in branches]
    return tree, leaves


# ----------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Play toy-task episodes against a chat endpoint.")
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--token", default=None)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--branches", type=int, default=1)
    args = p.parse_args(argv)
    spec = TaskSpec(seed=args.seed)
    chat = HttpChat(args.url, args.token)
    rewards = []
    for ep in make_episodes(spec, args.episodes):
        r, stats = run_episode(chat, ep, session_id=ep.episode_id, branches=args.branches,
                               group_id=ep.episode_id, finish=chat.finish)
        rewards.append(r)
        print(json.dumps({k: v for k, v in stats.items() if k != "branches"}))
    print(json.dumps({"mean_reward": sum(rewards) / len(rewards)}))


if __name__ == "__main__":
    main()
