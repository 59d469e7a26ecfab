"""Live KV migration, cell side (Llumnix-style, pipelined, fenced).

One line: reserve → copy while decoding → stop, copy the tail → import, commit → resume → free.

The source hosts the pair group's rendezvous (its own store) and is rank 0. Transfers run on
a migration thread; every engine operation (export, pause, import, resume, free) runs on the
cell's loop thread through `on_engine`, so decoding of every other request — and of the
migrating one until the stop — goes on between rounds. The destination commits the new owner
at the scheduler (a compare-and-set) *before* it resumes; a source that hears nothing aborts
the migration at the scheduler first and resumes only if that abort won, so exactly one cell
ever continues the request. The scheduler's `cancel_migration` stops either side at its next
step (`cancel()`): the source resumes the request, the destination frees its reservation.

- sender.py: `MigrationSender`, the source side.
- receiver.py: `MigrationReceiver`, the destination side.
- common.py: outcomes, warm receive buffers, the wire header.
"""

from cells.migration.common import CHUNK_BYTES, Cancelled, Outcome, StagingBuffers, migration_event
from cells.migration.receiver import MigrationReceiver
from cells.migration.sender import MigrationSender

__all__ = ["CHUNK_BYTES", "Cancelled", "MigrationReceiver", "MigrationSender", "Outcome", "StagingBuffers",
           "migration_event"]
