"""What goes into an engine and comes out of it: token events and request snapshots for
hand-over; with the contract's `SamplingParams`, `TokenRecord` and `EngineError`
(scheduler/contract/), re-exported here. The engine interface itself is in base.py.

A snapshot crosses processes as JSON (`to_dict`/`from_dict`, validated), never pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.contract.errors import EngineError
from scheduler.contract.protocol_base import Message, ProtocolError
from scheduler.contract.records import TokenRecord
from scheduler.contract.sampling import SamplingParams

__all__ = ["EngineError", "FinishReason", "RequestSnapshot", "SamplingParams", "TokenEvent", "TokenRecord"]


FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class TokenEvent:
    """What `Engine.step()` reports: one new token of one request, and whether it finished."""

    request_id: str
    index: int
    """Position of the token among the request's generated tokens (0-based)."""
    record: TokenRecord
    finish_reason: FinishReason | None = None


@dataclass
class RequestSnapshot(Message):
    """JSON-able state of one request for hand-over (no KV; KV travels as tensors).

    `records` holds only the generated-token records from `records_from` on, so a
    stop-and-copy message does not grow with the context.
    """

    request_id: str
    prompt_len: int
    num_tokens: int
    """Prompt plus generated tokens so far."""
    num_computed: int
    """Tokens whose KV is in the cache (num_tokens - 1 while decoding: the last token is the
    next input)."""
    params: SamplingParams
    version: int
    model_signature: dict
    block_size: int
    records_from: int = 0
    records: list[TokenRecord] = field(default_factory=list)
    token_ids_from: int = 0
    token_ids: list[int] = field(default_factory=list)
    """Token ids from `token_ids_from` on (prompt and generated)."""
    kv_version: int | None = None
    """The weight version the KV was computed under, when it was one version throughout (None:
    several, or unknown): the destination reuses it as that version's only if it serves it."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestSnapshot:
        try:
            return super().from_dict(d)
        except ProtocolError as e:
            raise EngineError(f"malformed request snapshot: {e}") from None
