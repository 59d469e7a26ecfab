"""What goes into an engine and comes out of it: sampling params, token records and events,
request snapshots for hand-over, and `EngineError`. The engine interface itself is in
base.py.

Records here are plain dataclasses whose `to_dict`/`from_dict` are JSON-able: they cross
processes as JSON, never pickle.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from scheduler.contract.records import TokenRecord

__all__ = ["EngineError", "FinishReason", "RequestSnapshot", "SamplingParams", "TokenEvent", "TokenRecord"]


class EngineError(ValueError):
    """Bad input to an engine (invalid sampling params, unknown request, wrong model shape)."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling. Noise for token t is a pure function of (seed, request id, t)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise EngineError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise EngineError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise EngineError(f"seed must be an int >= 0, got {self.seed!r}")
        stops = tuple(self.stop_token_ids)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in stops):
            raise EngineError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        known = {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "seed"}
        unknown = set(d) - known
        if unknown:
            raise EngineError(f"unknown sampling params: {sorted(unknown)}")
        return cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


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
class RequestSnapshot:
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
    params: dict
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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestSnapshot:
        try:
            return cls(**d)
        except TypeError as e:
            raise EngineError(f"malformed request snapshot: {e}") from None
