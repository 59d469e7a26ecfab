"""The trajectory export's shared vocabulary: the row schema's version, the per-token
provenance codes, and the store's retention settings (`scheduler.store.retain_trajectories`).
Read the same way by the scheduler (scheduler/store/exportread.py, scheduler/api/export.py)
and the exporter (cells/export/); the columns are written down in docs/EXPORT.md."""

from __future__ import annotations

import re

from pydantic import Field

from scheduler.contract.config.base import Strict

SCHEMA_VERSION = 1
"""Bumped whenever a column changes meaning or type (the manifest records it)."""

PROVENANCE_CODES = {None: 0, "exact": 1, "missing": 2}
"""Per-token `old_provenance`: 0 = none (a prompt token, or a sampled one not yet scored), 1 =
exact (the old log-prob is the training-numerics forward at the token's own behaviour
version), 2 = missing (exact scoring became impossible)."""

BRANCH_RE = re.compile(r"^(?P<parent>.+)\.b(?P<branch>[0-9]+)$")
"""A branch session's id: `{trunk}.b{k}` (cells/trainer/toy_task/branches.py)."""

MAX_PAGE_SESSIONS = 256
"""Most sessions one export page carries."""
MAX_PAGE_TOKENS = 1 << 15
"""Most tokens one export page carries (at least one session, whatever its length): the bound
on the store work one page costs the scheduler's event loop."""


def job_of(session_id: str) -> str:
    """A session's job: its id up to the first `-` (the trainer's run tag, `cellflip trainer
    --tag`), the whole id when it has none."""
    return session_id.split("-", 1)[0]


def branch_of(session_id: str) -> tuple[str | None, int]:
    """(parent session id, branch index) of a session: (None, 0) for a trunk."""
    m = BRANCH_RE.match(session_id)
    return (m["parent"], int(m["branch"])) if m else (None, 0)


class RetainConfig(Strict):
    """Which trajectories the store keeps (`scheduler.store.retain_trajectories`). Only a
    trajectory the trainer has written back an outcome for (trained, or dropped by it) is ever
    deleted, and with `require_exported` only one an exporter has acknowledged too. Past any of
    the limits below the oldest such trajectories go first; each deletion is counted
    (`cellflip_trajectories_deleted_total{reason}` and `GET /v1/export/status`)."""

    count: int | None = Field(default=100_000, ge=0)
    """Most finished trajectories kept (the default: 100,000; None: no count limit)."""
    age_s: float | None = Field(default=None, gt=0)
    """Delete eligible trajectories finished longer ago than this (None: no age limit)."""
    bytes: int | None = Field(default=None, ge=0)
    """Most bytes of token rows kept, estimated at `TOKEN_ROW_BYTES` per token (None: no limit)."""
    require_exported: bool = False
    """Delete only trajectories an exporter acknowledged (PUT /v1/export/ack)."""
    interval_s: float = Field(default=10.0, gt=0)
    """How often the scheduler looks for trajectories to delete."""
    max_per_pass: int = Field(default=500, gt=0)
    """Most trajectories one pass deletes (the bound on one pass's cost to the event loop)."""


MAX_WEIGHT_TOKENS = 1 << 18
"""Most per-token correction weights one session's outcome carries (`weights`: little-endian
float32 of its loss-mask tokens, base64; 1 MiB raw). A session with more sampled tokens is
written back without them (`weights_omitted`: its count), never cut short."""
OUTCOME_POST_BYTES = 4 << 20
"""Most JSON bytes the trainer puts in one outcome write-back (half the default body limit)."""

MESSAGES_BYTES = 64 << 10
"""The default cap on recorded message bytes per session (`scheduler.store.messages_bytes`)."""

TOKEN_ROW_BYTES = 48
"""Estimated bytes one token row takes in the store (row, key and index entries)."""


class StoreConfig(Strict):
    """The durable store's housekeeping."""

    retain_trajectories: RetainConfig = RetainConfig()
    """Bounded retention of trained trajectories (the default keeps the newest 100,000)."""
    replay_request_ids: bool = False
    """Let `POST /v1/generate` name its request id (`X-Request-Id`), for `cellflip replay --serve`'s
    own throwaway scheduler: a request's sampling noise is a function of (seed, request id, t), so
    a recorded turn samples again only under its own id. Off (the default): the header is
    refused (422); on, an id already in the store is a 409."""
    messages_bytes: int = Field(default=MESSAGES_BYTES, ge=0)
    """Most bytes of OpenAI-format messages the gateway records per session (JSON of each turn's
    new messages; the default 64 KiB; 0 records none). Turns past it are kept as marked
    markers, never silently dropped (docs/EXPORT.md `messages`)."""
