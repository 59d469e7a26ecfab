"""The trajectory export: `cellflip export` (finished trajectories with their provenance, as
parquet or jsonl parts and a manifest), `cellflip export --weights` and `cellflip replay`
(docs/EXPORT.md)."""
