"""The toy task: episodes, the `lookup` tool, and the reward of a transcript.

The user asks for the code of one item (or of two: the policy should make two parallel tool
calls in one assistant turn). The `lookup` tool reads the episode's table (drawn from the task
seed and the episode index, so codes cannot be memorised); an entry either holds a code or
redirects to another item ("see item M"), so some episodes need chained lookups and episode
lengths are long-tailed. The final assistant message must state the code(s). The reward
(`score_messages`) is computed from the transcript alone:

    solved (the answer's code words == the expected codes, in order)   R = 1
    otherwise   R = 0.5 · call_credit + 0.3 · code_credit                 (≤ 0.8)
    call_credit = |needed ∩ looked up| / |needed ∪ looked up|   (Jaccard: spurious calls cost)
    code_credit = fraction of asked items whose code is right at its place in the answer

`needed` is every item on the redirect chains of the asked items; `looked up` the items of
well-formed `lookup` calls (an integer `item`). So format and correct tool use earn partial
credit, and only a correct final answer earns 1.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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


# -- the task ----------------------------------------------------------------------------------
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

    @classmethod
    def variant(cls, seed: int, task: dict | None = None) -> TaskSpec:
        """The task `trainer.task` names (its fields but the seed; lists taken as tuples)."""
        return cls(seed=seed, **{k: tuple(v) if isinstance(v, list) else v for k, v in (task or {}).items()})


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


# -- the tool ----------------------------------------------------------------------------------
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


# -- reward ------------------------------------------------------------------------------------
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
