"""Fault campaigns in the Jepsen style: record a history of every operation while a nemesis
injects faults into a real local cluster, then check invariants I1–I5 over the history.

- `history`: the operation log (invoke / ok / fail / info records, monotonic times, JSON lines).
- `checker`: pure functions from histories and store snapshots to violations.
- `nemesis`: the fault actions (failpoints per process, signals, restarts, the trainer).
- `campaign`: the scenarios and the seeded runner (`bench/faults.py`, `tests/faults`).
"""
