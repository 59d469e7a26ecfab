"""The trajectory export's shared vocabulary: the row schema's version, the per-token
provenance codes, the page and write-back bounds (the store's retention settings are
`scheduler.contract.config.store`).
Read the same way by the scheduler (scheduler/store/exportread.py, scheduler/api/export.py)
and the exporter (cells/export/); the columns are written down in docs/EXPORT.md."""

from __future__ import annotations

import re

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
