"""OpenAI Chat Completions request/response models, plus the gateway's token fields.

Requests follow the OpenAI schema; fields the gateway does not use are accepted and ignored
(harness libraries send many), while fields it uses are validated strictly. Responses and
stream chunks carry the usual fields plus, on every choice:

- ``token_ids``: the completion's token ids exactly as sampled (in a chunk: the ids sampled
  since the previous chunk),
- ``token_logprobs``: the behaviour log-prob of each of those tokens,
- ``token_versions``: the weight version each token was sampled under,

and the top-level ``session_id`` / ``segment`` / ``turn`` of the rollout. Errors use the
OpenAI error object ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatMessage",
    "ErrorBody",
    "ErrorResponse",
    "FinishRequest",
    "FunctionCall",
    "Tool",
    "ToolCall",
    "ToolMessage",
    "error_body",
]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- request
class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class OtherPart(_Lenient):
    """A non-text content part (image, audio, file): parsed only to be refused clearly."""

    type: str


ContentPart = TextPart | OtherPart
Content = str | list[ContentPart]


class FunctionCall(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"
    """A JSON text as OpenAI sends it; an object is tolerated."""


class ToolCall(_Lenient):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Lenient):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Lenient):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Lenient):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    name: str | None = None


class ToolMessage(_Lenient):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(min_length=1, max_length=256)


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDef(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """``POST /v1/chat/completions`` body (OpenAI schema; unknown fields ignored)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    max_tokens: int | None = Field(default=None, gt=0)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class FinishRequest(_Lenient):
    """``POST /v1/sessions/{id}/finish`` body."""

    reward: float | None = None
    group_id: str | None = None


# ---------------------------------------------------------------------------- response
class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None
    refusal: None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"]
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int]
    token_logprobs: list[float]
    token_versions: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    session_id: str
    segment: int
    turn: int


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "tool_calls", "content_filter"] | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    token_versions: list[int] = Field(default_factory=list)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    session_id: str
    segment: int
    turn: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_type_for(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 401:
        return "authentication_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict:
    """An OpenAI-style error object as a plain dict."""
    return {
        "error": {"message": message, "type": error_type_for(status), "param": param, "code": code}
    }
