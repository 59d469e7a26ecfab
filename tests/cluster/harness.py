"""Test-side names for the local cluster (cells/localcluster.py)."""

from cells.localcluster import Cluster, Streamer, reference_tokens  # noqa: F401
