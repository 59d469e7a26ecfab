"""Per-request state of the SGLang adapter.

A request may span several SGLang submissions: a weight update restarts it under the new
version, and a request moved here by the scheduler arrives as one (re-prefill, or a load
from a shared KV store). Each submission's input is the request's tokens so far; its outputs
continue the request's token indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cells.engine.records import SamplingParams, TokenRecord


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_len: int
    params: SamplingParams
    token_ids: list[int]
    """Prompt plus delivered tokens (what the session store has)."""
    records: list[TokenRecord]
    """Records of delivered tokens."""
    max_tokens: int
    """Generated-token budget in total (across submissions and cells)."""
    sgl_rid: str = ""
    """SGLang's id of the current submission (`sglang_backend.submission_rid`)."""
    input_ids: list[int] = field(default_factory=list)
    """Input of the current SGLang submission."""
    seen_ids: list[int] = field(default_factory=list)
    """Output tokens of the current submission seen so far (delivered or pending)."""
    version: int = 0
    """Weight version of the current submission; tags every token it yields."""
    submitted: bool = False
    done: bool = False
    dropped: bool = False
    moved_by: str | None = None
    """`kv_store` until the first chunk of a request moved here through a shared store says
    whether the store served it (`cached_tokens`); then None."""

    @property
    def num_generated_seen(self) -> int:
        return len(self.input_ids) - self.prompt_len + len(self.seen_ids)

    def next_input(self) -> list[int]:
        """Input of the next submission: everything seen so far, delivered or not."""
        return self.input_ids + self.seen_ids if self.submitted else list(self.token_ids)
