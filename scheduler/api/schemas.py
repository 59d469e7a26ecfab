"""Request bodies of the public API (pydantic: a malformed body is a 422, never a 500)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler.contract.exports import EXPORT_PATH_PATTERN, EXPORT_PATH_RULE
from scheduler.contract.sampling import SamplingParams, TokenId

MAX_PROMPT_TOKENS = 1 << 20


class _Body(BaseModel):
    # strict: JSON `true`/`"3"`/`3.0` are not the integer 3 (an int is still a valid float);
    # NaN/Infinity (Python's json reads them) are no number
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ApiError(BaseModel):
    """Every error answer: `detail` (a message; a list of pydantic errors when the request
    does not match its schema) and the machine-readable `reason` (absent on those)."""

    detail: str | list[dict[str, Any]]
    reason: str | None = None


_PHRASES = {400: "Bad query parameter", 401: "Missing or invalid bearer token",
            403: "The token's scope does not take this route", 404: "Unknown id", 409: "Conflict (illegal transition, stale "
            "generation/epoch/incarnation, reused Idempotency-Key)", 413: "Request body over the limit",
            422: "Malformed request",
            429: "No capacity, or the agent token's rate or concurrency limit (see Retry-After)"}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: the error statuses it can answer, each with ApiError."""
    return {code: {"model": ApiError, "description": _PHRASES[code]} for code in codes}


class FlipCreate(_Body):
    model_config = ConfigDict(**_Body.model_config,
                              json_schema_extra={"dependentRequired": {"expected_generation": ["cell"]}})

    cell: str | None = None
    """Cell to flip; null lets the planner pick `count` cells."""
    count: int | None = Field(default=None, ge=1, le=10_000)
    """How many cells to flip when `cell` is null (default 1)."""
    to: Literal["rollout", "training"]
    expected_generation: int | None = Field(default=None, ge=0)
    """Compare-and-set on the cell's generation (409 when stale); needs `cell`."""

    @model_validator(mode="after")
    def _one_target(self) -> FlipCreate:
        if self.cell is not None and self.count is not None:
            raise ValueError("give either cell or count, not both")
        if self.expected_generation is not None and self.cell is None:
            raise ValueError("expected_generation needs cell")
        return self


class VersionSource(_Body):
    """The trainer's version host: cells join its broadcast and fetch from it there."""

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(gt=0, lt=65536)
    namespace: str = Field(default="versions", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_./-]+$")


class VersionCreate(_Body):
    version: int = Field(ge=0, lt=1 << 31)
    """The trainer's version number: newer than every version the lineage holds, at most
    `versions.max_version_step` above the newest."""
    source: VersionSource | None = None
    """Where cells get the weights; without it the version is only recorded (cells that
    load it by other means report it)."""


class ExportCreate(_Body):
    path: str = Field(pattern=EXPORT_PATH_PATTERN, description=EXPORT_PATH_RULE)
    """Where the cell writes the directory, below its `cells.export_root`."""
    dtype: Literal["float32", "bfloat16"] = "float32"


class SessionFinish(_Body):
    reward: float
    group_id: str | None = Field(default=None, max_length=256)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be finite")
        return v


class CompletionCreate(_Body, SamplingParams):
    """The prompt and the sampling params (scheduler/contract/sampling.py), flat in one body."""

    model_config = ConfigDict(**_Body.model_config, frozen=True)

    prompt_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS)
    """Token ids of the prompt (with X-Session-Id: the whole context; the session's buffer
    must be a prefix of it, or a new segment starts). Empty: continue the session's buffer."""
    stream: bool = False
    model: str | None = None
    """Accepted for client compatibility; the fleet serves one model."""

    def params(self) -> SamplingParams:
        return SamplingParams.of(self)
