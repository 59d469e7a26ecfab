"""Launchers beyond one machine: cellflip on a Ray cluster (`cellflip up --ray`, docs/RAY.md)."""
