"""Response bodies of the chat route: the completion, its log-probs, and error objects."""

from __future__ import annotations

from typing import Any

from scheduler.api.jsontext import SafeJSONResponse
from scheduler.gateway.tito.backend import BackendError
from scheduler.gateway.tito.openai_schema import ChatCompletionRequest, error_body
from scheduler.gateway.tito.turn import TurnResult

__all__ = [
    "backend_error_response",
    "completion_body",
    "error_response",
    "token_logprob_entries",
    "usage",
]


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> SafeJSONResponse:
    """An OpenAI error object with its status."""
    return SafeJSONResponse(
        error_body(status, message, param=param, code=code), status_code=status, headers=headers
    )


def backend_error_response(e: BackendError, hdrs: dict[str, str]) -> SafeJSONResponse:
    """A backend failure's status, with ``Retry-After`` (whole seconds, >= 1) when it has one."""
    h = dict(hdrs)
    ra = e.retry_after_s
    if ra is not None:
        h["Retry-After"] = str(max(1, int(round(ra))))
    return error_response(e.status, str(e) or e.code, code=e.code, headers=h)


def token_logprob_entries(tok: Any, ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries of sampled tokens (no alternatives)."""
    out = []
    for t, lp in zip(ids, lps, strict=False):
        b = tok.token_bytes(t)
        out.append(
            {
                "token": b.decode("utf-8", errors="replace"),
                "logprob": lp,
                "bytes": list(b),
                "top_logprobs": [],
            }
        )
    return out


def usage(r: TurnResult) -> dict[str, int]:
    return {
        "prompt_tokens": r.prompt_len,
        "completion_tokens": len(r.completion_ids),
        "total_tokens": r.prompt_len + len(r.completion_ids),
    }


def completion_body(
    tok: Any, r: TurnResult, req: ChatCompletionRequest, cid: str, created: int, model: str
) -> dict[str, Any]:
    """A ``chat.completion`` with the turn's token ids, log-probs and versions."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": r.message,
        "finish_reason": r.finish_reason,
        "logprobs": {
            "content": token_logprob_entries(tok, r.completion_ids, r.logprobs),
            "refusal": None,
        }
        if req.logprobs
        else None,
        "token_ids": r.completion_ids,
        "token_logprobs": r.logprobs,
        "token_versions": r.versions,
    }
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [choice],
        "usage": usage(r),
        "session_id": r.session_id,
        "segment": r.segment,
        "turn": r.turn,
    }
