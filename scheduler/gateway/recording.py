"""The gateway's recording hook: the OpenAI-format messages of the turn being served, as the
client sent them (fields it left out stay out), handed to the backend that creates the turn's
request, which records them beside it (scheduler/store/messages.py; docs/EXPORT.md
`messages`). A context variable, so the chat route's planning and rendering stay as they are."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from scheduler.gateway.tito.openai_schema import ChatCompletionRequest

SENT: ContextVar[list[dict[str, Any]] | None] = ContextVar("cellflip_sent_messages", default=None)
"""The messages of the chat turn this task serves (None outside the chat route)."""


def sending(req: ChatCompletionRequest) -> None:
    """The chat route serves `req` in this task (and the tasks it starts)."""
    SENT.set([m.model_dump(mode="json", exclude_unset=True) for m in req.messages])
