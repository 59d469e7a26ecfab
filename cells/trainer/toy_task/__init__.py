"""A toy agentic task small enough to learn on CPU: look up item codes with a tool, then answer.

- `task`: the episodes (a question and its own table), the `lookup` tool, and the reward
  of a transcript.
- `harness`: `run_episode` plays an episode through a chat callable, forking sub-agent
  branches after the first tool results.
- `clients`: the chat callables: `HttpChat` (the scheduler's gateway over HTTP) and
  `LocalGateway` (the real gateway logic in-process, over an in-memory store).
- `demonstrator`: the warm-up's teacher and its demonstrations, recorded through the
  gateway logic token for token as a policy's turns would be.
- `sampler`: `ToySampler`, rollouts from an in-process batch-invariant EmbeddedEngine with
  exact old log-probs; `heldout_eval`.
- `branches`: forked sessions grouped and turned into rollout trees.
- `gateway_link`: the one module that imports the scheduler's gateway.
- `cli`: `python -m cells.trainer.toy_task --url ...` plays episodes against an endpoint.

The chat format is `qwen3-nothink` (TOY_RENDERER): its full render of a conversation equals
the gateway's incremental buffer, which makes branch prefixes shareable.
"""

from cells.trainer.toy_task.branches import (
    BranchGroup,
    branch_groups,
    branch_session_id,
    rollout_tree,
)
from cells.trainer.toy_task.clients import (
    ChatError,
    HttpChat,
    LocalGateway,
)
from cells.trainer.toy_task.demonstrator import (
    ORACLE,
    UNKNOWN,
    Demonstrator,
    answer_text,
    assistant_call_message,
    completion_ids,
    demo_token_sequences,
    demo_transcripts,
    oracle_messages,
    output_token_ids,
)
from cells.trainer.toy_task.harness import (
    ChatFn,
    FinishFn,
    echo_message,
    run_episode,
    well_formed,
)
from cells.trainer.toy_task.sampler import (
    EngineDriver,
    ToySampler,
    heldout_eval,
)
from cells.trainer.toy_task.task import (
    CALL_WEIGHT,
    CODE_WEIGHT,
    CODE_WORDS,
    HELDOUT_START,
    LOOKUP_TOOL,
    SUCCESS_REWARD,
    TOOLS,
    TOY_RENDERER,
    Entry,
    Episode,
    Score,
    TaskSpec,
    answer_codes,
    draw_table,
    execute_tool,
    heldout_episodes,
    lookup,
    make_episode,
    make_episodes,
    parse_item,
    score_messages,
)

__all__ = [
    "BranchGroup",
    "CALL_WEIGHT",
    "CODE_WEIGHT",
    "CODE_WORDS",
    "ChatError",
    "ChatFn",
    "Demonstrator",
    "EngineDriver",
    "Entry",
    "Episode",
    "FinishFn",
    "HELDOUT_START",
    "HttpChat",
    "LOOKUP_TOOL",
    "LocalGateway",
    "ORACLE",
    "SUCCESS_REWARD",
    "Score",
    "TOOLS",
    "TOY_RENDERER",
    "TaskSpec",
    "ToySampler",
    "UNKNOWN",
    "answer_codes",
    "answer_text",
    "assistant_call_message",
    "branch_groups",
    "branch_session_id",
    "completion_ids",
    "demo_token_sequences",
    "demo_transcripts",
    "draw_table",
    "echo_message",
    "execute_tool",
    "heldout_episodes",
    "heldout_eval",
    "lookup",
    "make_episode",
    "make_episodes",
    "oracle_messages",
    "output_token_ids",
    "parse_item",
    "rollout_tree",
    "run_episode",
    "score_messages",
    "well_formed",
]
