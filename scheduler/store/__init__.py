"""The durable store (SQLite): `Store` and its table groups, the only place with SQL.

- `db`: the connection, transactions, the schema and its upgrades;
- `fleet`: cells, flips, weight versions, idempotency keys;
- `owners`: requests with their owner and epoch, migrations;
- `sessions`: token buffers, trajectories, the gateway's per-session state;
- `jobs`: the RL jobs, what belongs to each (cells, sessions, versions, tokens), moves between them;
- `tokenbuf`, `tokenpack`: the token buffers column-packed (one row per run of tokens);
- `exportread`: the export's side-effect-free read of finished trajectories;
- `retention`: what training did with each trajectory, exporters' acks, bounded retention;
- `codec`: the JSON text of structured columns (a leaf).
"""

from scheduler.store.db import ADDED_COLUMNS, SCHEMA, Store

__all__ = ["ADDED_COLUMNS", "SCHEMA", "Store"]
