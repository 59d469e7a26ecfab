"""What replay reads beside the rows: the export's weight versions, and which turns a forward
at one version cannot rebuild (`apart`). Shared by re-scoring (replay.py) and re-sampling
(serve.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Versions:
    """The export's weight versions, loaded on first use from `DIR/weights/v<N>`."""

    def __init__(self, root: Path, tile: int | None) -> None:
        self.root, self.tile = root, tile
        self._prep: dict[int, Any] = {}
        self.spec = None

    def available(self) -> list[int]:
        d = self.root / "weights"
        return sorted(int(p.name[1:]) for p in d.glob("v*") if p.name[1:].isdigit()) if d.is_dir() else []

    def tensors(self, v: int) -> dict[str, torch.Tensor]:
        from cells.engine.embedded.checkpoint import load_checkpoint
        from cells.engine.embedded.model_spec import spec_from_hf_config

        path = self.root / "weights" / f"v{v}"
        if not path.is_dir():
            raise FileNotFoundError(f"no weights for version {v} at {path} (cellflip export --weights)")
        self.spec = spec_from_hf_config(path)
        return load_checkpoint(path, self.spec)

    def prepared(self, v: int, nudge: bool = False):
        from cells.engine.embedded.model import prepare

        key = -v - 1 if nudge else v
        if key not in self._prep:
            w = {k: t.to(torch.float32).contiguous() for k, t in self.tensors(v).items()}
            if nudge:  # the one-version control: the same weights, one entry of one tensor moved
                name = sorted(w)[0]
                w[name] = w[name].clone()
                w[name].view(-1)[0] += 1e-2
            self._prep[key] = prepare(self.spec, w)
        return self._prep[key]


def moved_by_reprefill(row: dict[str, Any]) -> bool:
    return any(m["path"] == "reprefill" and m["state"] == "committed" for m in row.get("migrations") or [])


def apart(row: dict[str, Any], lo: int, base: int, versions: set) -> bool:
    """A turn whose behaviour log-probs a forward at one version cannot rebuild: its session was
    moved by re-prefill, its tokens span versions, or its context holds tokens sampled under an
    older version (an update in flight keeps the KV: `versions.inflight_policy: keep_kv`)."""
    sampled = {v for v in versions if v is not None}
    if moved_by_reprefill(row) or len(sampled) > 1:
        return True
    older = [v for v in row["version"][lo:base] if v is not None]
    return bool(sampled and older and min(older) < min(sampled))
