"""Workloads of the cluster simulator: YAML files in configs/sim/ loaded into `Workload`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "sim"
BUILTIN = ("stationary", "drifting")
"""The committed workloads every run reports."""


class Workload(BaseModel):
    """One agentic RL workload: how long sessions hold a slot, what moving them costs, what
    a training step costs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Label printed in the output."""
    session_mean_hours: float = Field(gt=0)
    """Mean time a session occupies a rollout slot, at the start of the run."""
    session_mean_hours_end: float | None = Field(default=None, gt=0)
    """Mean slot time at the end of the run (linear in between); None = constant."""
    session_sigma: float = Field(default=0.4, ge=0)
    """Sigma of the log-normal slot time (0 = every session takes exactly the mean)."""
    session_tokens: int = Field(default=20_000, gt=0)
    """Context tokens a session holds when it finishes (grows linearly while it decodes)."""
    cell_capacity: int = Field(default=16, gt=0)
    """Sessions one rollout cell decodes at once."""
    kv_bytes_per_token: int = Field(default=96 * 1024, gt=0)
    """KV cache bytes per context token (Qwen3-30B-A3B in BF16: 96 KiB)."""
    intra_node_bytes_per_s: float = Field(default=450e9, gt=0)
    """Cell-to-cell KV bandwidth within a node (NVLink)."""
    inter_node_bytes_per_s: float = Field(default=50e9, gt=0)
    """Cell-to-cell KV bandwidth between nodes."""
    cells_per_node: int = Field(default=8, gt=0)
    """Cells sharing one node (and its fast link)."""
    prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    """Re-prefill rate of one cell."""
    batch_size: int = Field(default=1024, gt=0)
    """Finished sessions one training step consumes."""
    step_cell_hours: float = Field(default=32.0, gt=0)
    """Cell-hours of one training step, split evenly over the cells that run it."""
    max_cells_per_step: int = Field(default=128, gt=0)
    """A step gets no faster past this many cells."""
    broadcast_s: float = Field(default=20.0, ge=0)
    """Weight load of a cell entering rollout (a sync cycle's broadcast too)."""
    staleness_bound: int = Field(default=40, ge=0)
    """A session whose first token is more than this many versions old is dropped, not trained."""

    def mean_hours_at(self, t_s: np.ndarray | float, horizon_s: float) -> np.ndarray | float:
        """Mean slot time (hours) of a session that starts at `t_s`."""
        if self.session_mean_hours_end is None or horizon_s <= 0:
            return self.session_mean_hours + 0.0 * np.asarray(t_s)
        frac = np.clip(np.asarray(t_s, dtype=float) / horizon_s, 0.0, 1.0)
        return self.session_mean_hours + (self.session_mean_hours_end - self.session_mean_hours) * frac

    def draw_durations_s(self, rng: np.random.Generator, start_s: np.ndarray, horizon_s: float) -> np.ndarray:
        """Slot times (seconds) of sessions starting at `start_s`: log-normal with the mean at start."""
        mean_s = np.asarray(self.mean_hours_at(start_s, horizon_s), dtype=float) * 3600.0
        if self.session_sigma == 0.0:
            return mean_s.copy()
        mu = np.log(mean_s) - 0.5 * self.session_sigma**2
        return np.exp(mu + self.session_sigma * rng.standard_normal(mean_s.shape))

    def describe(self) -> str:
        mean = f"{self.session_mean_hours:g} h"
        if self.session_mean_hours_end is not None:
            mean = f"{self.session_mean_hours:g} h -> {self.session_mean_hours_end:g} h (linear)"
        p99 = math.exp(-0.5 * self.session_sigma**2 + 2.3263 * self.session_sigma)
        return (f"{self.name}: slot time log-normal mean {mean}, sigma {self.session_sigma:g} "
                f"(p99 {p99:.2f}x mean), {self.session_tokens} tokens/session, "
                f"{self.cell_capacity} sessions/cell, KV {self.kv_bytes_per_token} B/token, "
                f"links {self.intra_node_bytes_per_s / 1e9:g}/{self.inter_node_bytes_per_s / 1e9:g} GB/s "
                f"({self.cells_per_node} cells/node), re-prefill {self.prefill_tokens_per_s:g} tok/s, "
                f"step {self.batch_size} sessions = {self.step_cell_hours:g} cell-h "
                f"(<= {self.max_cells_per_step} cells), broadcast {self.broadcast_s:g} s, "
                f"staleness bound {self.staleness_bound} versions")


class WorkloadError(ValueError):
    """A workload file is missing or invalid; the message names the key."""


def load_workload(name_or_path: str) -> Workload:
    """A built-in name (configs/sim/NAME.yaml) or a path to a YAML file."""
    p = Path(name_or_path)
    if not p.suffix:
        p = CONFIG_DIR / f"{name_or_path}.yaml"
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise WorkloadError(f"cannot read workload {p}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise WorkloadError(f"invalid YAML in {p}: {e}") from None
    try:
        return Workload.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "<root>"
        raise WorkloadError(f"invalid workload {p}: {loc}: {first['msg']}") from None
