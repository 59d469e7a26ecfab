"""Per-request state of the SGLang adapter, and its hand-over records.

A request may span several SGLang submissions: a weight update restarts it under the new
version, and a migration re-prefills it on another cell. Each submission's input is the
request's tokens so far; its outputs continue the request's token indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cells.engine.records import EngineError, RequestSnapshot, SamplingParams, TokenRecord


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


def snapshot_of(req: RequestState, *, version: int, model_signature: dict, block_size: int,
                records_from: int = 0) -> RequestSnapshot:
    """Hand-over record of `req`: delivered tokens only, no KV (`num_computed` = 0)."""
    return RequestSnapshot(
        request_id=req.request_id, prompt_len=req.prompt_len, num_tokens=len(req.token_ids),
        num_computed=0, params={**req.params.to_dict(), "max_tokens": req.max_tokens},
        version=version, model_signature=model_signature, block_size=block_size,
        records_from=records_from, records=[r.to_list() for r in req.records[records_from:]],
        token_ids_from=0, token_ids=list(req.token_ids))


def request_from_snapshot(snapshot: RequestSnapshot, token_ids: list[int] | None, model: str) -> RequestState:
    """A request to re-prefill here from `snapshot` (and the full token buffer when the
    snapshot carries only a tail). Raises EngineError if it cannot continue here."""
    rid = snapshot.request_id
    if snapshot.model_signature.get("model") != model:
        raise EngineError(f"request {rid} comes from model {snapshot.model_signature.get('model')!r}, "
                          f"this cell serves {model!r}")
    ids = list(snapshot.token_ids) if snapshot.token_ids_from == 0 else token_ids
    if ids is None or len(ids) != snapshot.num_tokens:
        raise EngineError(f"request {rid}: need all {snapshot.num_tokens} token ids to re-prefill")
    if not 0 < snapshot.prompt_len <= len(ids):
        raise EngineError(f"request {rid}: bad prompt_len {snapshot.prompt_len}")
    max_tokens = int(snapshot.params.get("max_tokens", 0))
    if len(ids) - snapshot.prompt_len >= max_tokens:
        raise EngineError(f"request {rid} has no tokens left to generate")
    params = SamplingParams.from_dict(dict(snapshot.params))
    return RequestState(rid, snapshot.prompt_len, params, list(ids), [], max_tokens)
