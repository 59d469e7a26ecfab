"""Sampling parameters, defined once: what `POST /v1/generate` and the chat gateway take, what
a request records and a `start` command carries, and what an engine samples with. Their keys
are written here alone (tests/test_shape.py); everything else reads the fields by name or
iterates `SamplingParams.model_fields`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from scheduler.contract.errors import EngineError

TokenId = Annotated[int, Strict(), Field(ge=0, lt=1 << 31)]
MAX_STOP_TOKENS = 1024


class _Built(type(BaseModel)):  # type: ignore[misc]
    """Building the model by calling it (in a cell, a test) raises `EngineError`; validating
    a message or a body (which does not call it) raises pydantic's error as usual."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as e:
            raise EngineError(f"invalid sampling params: {describe(e)}") from None


class SamplingParams(BaseModel, metaclass=_Built):
    """Per-request sampling. Noise for token t is a pure function of (seed, request id, t).
    Built directly, a value out of range is an `EngineError`; decoded from a message or a
    body, a pydantic validation error (a 422 at the routes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: Annotated[float, Strict()] = Field(default=1.0, ge=0, le=100)
    top_p: Annotated[float, Strict()] = Field(default=1.0, gt=0, le=1)
    top_k: Annotated[int, Strict()] = Field(default=0, ge=0)
    """0: off."""
    max_tokens: Annotated[int, Strict()] = Field(default=64, ge=1, le=1 << 20)
    """Counts every generated token of the request, those sampled before a move included."""
    stop_token_ids: tuple[TokenId, ...] = Field(default=(), max_length=MAX_STOP_TOKENS)
    seed: Annotated[int, Strict()] = Field(default=0, ge=0, lt=1 << 63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, source: Any) -> SamplingParams:
        """The sampling fields of an object that has them all (a request body that extends this
        model), taken as they are: it was validated by the same rules."""
        return cls.model_construct(**{k: getattr(source, k) for k in cls.model_fields})


def describe(e: ValidationError) -> str:
    """A validation error in one line: each offending field and what is wrong with it."""
    return "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'value'}: {err['msg']}"
                     for err in e.errors(include_url=False))
