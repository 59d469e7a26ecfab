"""PNG plots of simulated runs: utilization by role and trained throughput over time."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .run import RunResult


def plot_workload(name: str, runs: list[RunResult], out_dir: Path, tokens_per_session: int) -> list[Path]:
    """One figure per workload: a utilization panel per policy, and throughput of all policies.
    Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(10, 2.4 * (len(runs) + 1)), sharex=True)
    for ax, r in zip(axes, runs):
        s = {k: np.asarray(v) for k, v in r.series.items()}
        n = r.cells
        ax.stackplot(s["t_h"], s["decoding"] / n, s["training_busy"] / n,
                     labels=["decoding", "training"], colors=["#4C72B0", "#DD8452"], alpha=0.85)
        ax.plot(s["t_h"], s["rollout_cells"] / n, color="k", lw=0.8, label="rollout cells")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("share of cells")
        ax.set_title(f"{name} / {r.policy}: utilization {r.utilization:.3f}", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
    ax = axes[-1]
    for r in runs:
        s = {k: np.asarray(v) for k, v in r.series.items()}
        t, done = s["t_h"], s["trained_sessions"]
        # trained tokens per hour over a trailing 2-hour window
        w = max(1, int(round(2.0 / max(t[1] - t[0], 1e-9)))) if t.size > 1 else 1
        rate = (done[w:] - done[:-w]) / (t[w:] - t[:-w]) * tokens_per_session if t.size > w else np.zeros(0)
        ax.plot(t[w:], rate / 1e6, label=r.policy, lw=1.2)
    ax.set_xlabel("hours")
    ax.set_ylabel("trained Mtok/h (2 h window)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / f"cluster_sim_{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
