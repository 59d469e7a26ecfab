"""The `scheduler.store:` section: the durable store's housekeeping, bounded retention of
trained trajectories (docs/EXPORT.md)."""

from __future__ import annotations

from pydantic import Field

from scheduler.contract.config.base import Strict
from scheduler.contract.trajexport import MESSAGES_BYTES


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
