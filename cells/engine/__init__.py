"""Inference engines behind one boundary.

- base.py: `Engine` (what every engine does), one `Protocol` per optional ability, and the
  `Capabilities` each engine reports; callers branch on those, never on attributes.
- records.py: what goes in and out (sampling params, token records and events, snapshots).
- embedded/: the embedded torch engine (CPU default; paged KV, KV hand-over, scoring).
- sglang/: the SGLang adapter for GPU cells.
"""
