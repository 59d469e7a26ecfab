"""Workloads of the cluster simulator: YAML files in configs/sim/ loaded into `Workload`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "sim"
BUILTIN = ("stationary", "drifting", "minutes", "training_heavy", "heavy_tail", "long_context",
           "step_change", "sinusoidal", "light_tail")
"""The committed workloads every run reports (configs/sim/NAME.yaml)."""


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
    step_change_factor: float = Field(default=1.0, gt=0)
    """Slot time multiplied by this for `step_change_hours` every `step_change_every_hours`."""
    step_change_hours: float = Field(default=1.0, gt=0)
    step_change_every_hours: float = Field(default=12.0, gt=0)
    sine_amplitude: float = Field(default=0.0, ge=0, lt=1)
    """Slot time multiplied by 1 + amplitude * sin(2 pi t / period)."""
    sine_period_hours: float = Field(default=2.0, gt=0)
    session_sigma: float = Field(default=0.4, ge=0)
    """Sigma of the log-normal slot time (0 = every session takes exactly the mean)."""
    session_cap_hours: float | None = Field(default=None, gt=0)
    """Longest slot time (a harness timeout); None = no cap."""
    session_tokens: int = Field(default=20_000, gt=0)
    """Mean context tokens a session holds when it finishes. A session's tokens scale with its
    own slot time over the mean slot time at its start (long sessions hold more tokens)."""
    cell_capacity: int = Field(default=16, gt=0)
    """Sessions one rollout cell decodes at once."""
    kv_bytes_per_token: int = Field(default=96 * 1024, gt=0)
    """KV cache bytes per context token."""
    intra_node_bytes_per_s: float = Field(default=450e9, gt=0)
    """Cell-to-cell KV bandwidth within a node."""
    inter_node_bytes_per_s: float = Field(default=50e9, gt=0)
    """Cell-to-cell KV bandwidth between nodes."""
    cells_per_node: int = Field(default=8, gt=0)
    """Cells sharing one node (and its fast link)."""
    prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    """Linear re-prefill rate of one cell (the 2 x parameters FLOPs per token)."""
    prefill_quadratic_s: float = Field(default=0.0, ge=0)
    """Attention share of a prefill: seconds per context token squared."""
    prompt_tokens: int = Field(default=2000, ge=0)
    """A session's prompt: what an aborted session prefills again when it restarts."""
    batch_size: int = Field(default=1024, gt=0)
    """Finished sessions one training step (one RL update, one version) consumes, at
    `batch_ref_cells` cells."""
    batch_ref_cells: int | None = Field(default=1000, gt=0)
    """The batch and the step width grow with the fleet in proportion to this many cells (a
    real job's batch grows with its fleet); None = fixed."""
    step_cell_hours: float = Field(default=32.0, gt=0)
    """Cell-hours of one step of `batch_size` mean-length sessions at perfect scaling;
    training cost is per token."""
    max_cells_per_step: int = Field(default=512, gt=0)
    """A step gets no faster past this many cells (at `batch_ref_cells`)."""
    scaling_efficiency: float = Field(default=0.9, gt=0, le=1)
    """Strong-scaling efficiency of a step on `max_cells_per_step` cells (eff(c) =
    scaling_efficiency ** (log2 c / log2 width))."""
    sync_timeout_mean_x: float = Field(default=4.0, gt=0)
    """A sync round is cut this many mean slot times after it starts (its users' timeout)."""
    broadcast_s: float = Field(default=20.0, ge=0)
    """Weight load of a cell entering rollout (a sync round's broadcast too); also how long
    a new version takes to reach the rollout cells while they decode."""
    broadcast_decode_ratio: float = Field(default=0.78, gt=0, le=1)
    """Decode speed of a rollout cell while a new version streams in (bench/broadcast.py
    measures 0.78-0.79x): a version streams in over `broadcast_s` (a newer one takes over the
    stream), each decoding session falling (1 - ratio) of that time behind."""
    train_join_s: float = Field(default=2.0, ge=0)
    """Seconds a cell joining a running training step takes before it trains (bench/train.py
    measures 0.3-4 s)."""
    staleness_bound: int = Field(default=40, ge=0)
    """A session whose first token is more than this many versions old is dropped, not trained."""
    tick_s: float = Field(default=60.0, gt=0)
    """Controller tick (simulated seconds), the same for every policy."""
    hours: float | None = Field(default=None, gt=0)
    """Run length; None = the bench's default."""
    underfilled: str | None = None
    """Why the workload cannot keep the fleet busy, if it cannot (reported in the bench)."""
    source: str | None = None
    """Where the model and link figures come from."""

    def batch_for(self, cells: int) -> tuple[int, int]:
        """(batch size, step width) for a fleet of `cells`."""
        if self.batch_ref_cells is None:
            return self.batch_size, self.max_cells_per_step
        f = cells / self.batch_ref_cells
        return max(1, round(self.batch_size * f)), max(1, round(self.max_cells_per_step * f))

    def train_cell_s_per_token(self) -> float:
        return self.step_cell_hours * 3600.0 / (self.batch_size * self.session_tokens)

    def prefill_s(self, tokens: np.ndarray | float) -> np.ndarray | float:
        """Seconds one cell takes to prefill `tokens` of context."""
        x = np.asarray(tokens, dtype=float)
        return x / self.prefill_tokens_per_s + self.prefill_quadratic_s * x * x

    def mean_hours_at(self, t_s: np.ndarray | float, horizon_s: float) -> np.ndarray | float:
        """Mean slot time (hours) of a session that starts at `t_s`."""
        t = np.asarray(t_s, dtype=float)
        m = self.session_mean_hours + 0.0 * t
        if self.session_mean_hours_end is not None and horizon_s > 0:
            frac = np.clip(t / horizon_s, 0.0, 1.0)
            m = m + (self.session_mean_hours_end - self.session_mean_hours) * frac
        if self.step_change_factor != 1.0:
            phase = np.mod(t / 3600.0, self.step_change_every_hours)
            m = m * np.where(phase >= self.step_change_every_hours - self.step_change_hours,
                             self.step_change_factor, 1.0)
        if self.sine_amplitude:
            m = m * (1.0 + self.sine_amplitude * np.sin(2 * np.pi * t / (3600.0 * self.sine_period_hours)))
        return m

    def draw_durations_s(self, rng: np.random.Generator, start_s: np.ndarray, horizon_s: float) -> np.ndarray:
        """Slot times (seconds) of sessions starting at `start_s`: log-normal with the mean at
        start (capped at `session_cap_hours`)."""
        mean_s = np.asarray(self.mean_hours_at(start_s, horizon_s), dtype=float) * 3600.0
        if self.session_sigma == 0.0:
            d = mean_s.copy()
        else:
            mu = np.log(mean_s) - 0.5 * self.session_sigma**2
            d = np.exp(mu + self.session_sigma * rng.standard_normal(mean_s.shape))
        if self.session_cap_hours is not None:
            d = np.minimum(d, self.session_cap_hours * 3600.0)
        return d

    def tokens_of(self, dur_s: np.ndarray, start_s: np.ndarray, horizon_s: float) -> np.ndarray:
        """Tokens of sessions with slot times `dur_s` that started at `start_s`."""
        mean_s = np.asarray(self.mean_hours_at(start_s, horizon_s), dtype=float) * 3600.0
        return np.maximum(1.0, self.session_tokens * dur_s / mean_s)

    def quantile_s(self, q: float, t_s: float, horizon_s: float) -> float:
        """The q-quantile of the slot time of a session starting at `t_s`."""
        from statistics import NormalDist

        mean_s = float(self.mean_hours_at(t_s, horizon_s)) * 3600.0
        z = NormalDist().inv_cdf(q)
        d = mean_s * math.exp(-0.5 * self.session_sigma**2 + z * self.session_sigma)
        return min(d, self.session_cap_hours * 3600.0) if self.session_cap_hours else d

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
                f"(<= {self.max_cells_per_step} cells, efficiency {self.scaling_efficiency:g} there), broadcast {self.broadcast_s:g} s, "
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
