"""The campaign's cluster: its configuration, timeouts and the migration failpoints it arms."""

from __future__ import annotations

from pathlib import Path

from cells.localcluster import SMALL_MODEL

LEASE_S = 2.0
TRANSFER_TIMEOUT_S = 3.0
SAMPLE_S = 0.1
REQUEST_DEADLINE_S = 90.0
"""Every request of a run must end within this after its fault (else: a hang, and lost)."""
HEALTHY_DEADLINE_S = 60.0
STALL_TIMEOUT_S = 15.0
"""The scheduler's stall watchdog here: well inside the 60 s a run waits for tokens."""
STALL_LOG_LINE = "has not advanced for"
"""What the scheduler logs when its watchdog takes requests back (scheduler/control/ownership.py)."""
BUCKET_BYTES = 256 << 10
CELLS = 3

SRC_FPS = ["migrate.after_copy_round", "migrate.before_stop_copy", "migrate.after_stop_copy",
           "migrate.before_source_free"]
DST_FPS = ["migrate.transfer", "migrate.before_commit", "migrate.after_commit"]
ALL_FPS = ["migrate.after_copy_round", "migrate.before_commit", "migrate.after_stop_copy", "migrate.transfer",
           "migrate.before_stop_copy", "migrate.after_commit", "migrate.before_source_free"]
"""Every migration failpoint, source and destination sides interleaved."""


def campaign_config(tmp: Path) -> dict:
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": LEASE_S, "heartbeat_s": 0.2,
                      "min_rollout_cells": 1, "drain_deadline_s": 10.0, "stall_timeout_s": STALL_TIMEOUT_S},
        "cells": {"count": CELLS, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 512,
                                             "block_size": 8, "batch_invariant": True}},
        "migration": {"transfer_timeout_s": TRANSFER_TIMEOUT_S},
        # load_timeout_s: a restarted cell boots on version 0 and the scheduler re-sends
        # `load_version` to a cell id only this long after the last one (even to a previous
        # incarnation): short, so that restarted cells catch up within a run.
        "versions": {"task_timeout_s": 4.0, "load_timeout_s": 2.0},
    }


class Hang(Exception):
    """A bounded wait of a run ran out: the system did not recover in time."""
