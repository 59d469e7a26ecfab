"""The harness: plays an episode through a chat callable, executing the tool calls.

`run_episode` talks OpenAI chat completions through a `chat` callable (the scheduler's gateway
over HTTP: `HttpChat`; in-process: `LocalGateway`), executes the tool calls, and never
tokenizes: the gateway records the tokens. Sub-agent branches: with `branches=k` the episode
forks after the first tool results into k sessions (`sid`, `sid.b1`, ... `sid.b{k-1}`) that
share those messages, each finishing with its own reward and the same `group_id`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from cells.rl.objectives.tree import MAX_BRANCHES
from cells.trainer.toy_task.branches import branch_session_id
from cells.trainer.toy_task.task import TOOLS, Episode, execute_tool, score_messages


class ChatFn(Protocol):
    """`chat(messages, tools, session_id, **sampling) -> assistant message` (OpenAI form)."""

    def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, session_id: str,
        **sampling: Any,
    ) -> dict[str, Any]: ...


FinishFn = Callable[[str, float, "str | None"], Any]
"""`finish(session_id, reward, group_id)`: close a session into a trajectory."""


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
