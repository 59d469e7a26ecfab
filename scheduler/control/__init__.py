"""The control plane: the controller composes one object per concern (ownership, migrations,
flips, versions, scoring, staleness, membership, ingest, completions, reconciliation) over a
shared context (store, registry, clock, configs, metrics, the open transaction)."""
