"""The live terminal view of `cellflip up`: cells by role, RL steps and reward, flips,
migrations, versions, the log-prob backlog and the drift counter; a summary table at the end.

Reads only public surfaces: the REST API, `/metrics`, and the trainer's status lines
(`runs/trainer.jsonl`), so what it shows is what an operator or a trainer can see.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from cells.client import all_cells

SPARK = "▁▂▃▄▅▆▇█"


def _metric(text: str, name: str) -> float:
    """Sum of every sample of `name` in a Prometheus exposition."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of `name` by its labels."""
    out = {}
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.eE+-]+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")))
        out[labels] = float(m.group(2))
    return out


def moves_line(migrations: dict[tuple[tuple[str, str], ...], float]) -> str:
    """Committed moves by path, aborted ones apart: the same words in the live view and the
    summary (cellflip_migrations_total)."""
    by = {(dict(k).get("outcome"), dict(k).get("path")): v for k, v in migrations.items()}
    done = " · ".join(f"{path} {by.get(('committed', path), 0):.0f}" for path in ("kv", "kv_store", "reprefill"))
    aborted = sum(v for (outcome, _), v in by.items() if outcome == "aborted")
    return f"{done} (aborted {aborted:.0f})"


PHASES = {
    "warmup_start": "warm-up: supervised steps on the teacher's demonstrations",
    "warmup_progress": "warm-up: supervised steps on the teacher's demonstrations",
    "warmup_done": "warm-up done; publishing the warmed-up weights",
    "resumed": "resumed from the checkpoint",
    "published": "version published; agents roll out",
    "flip_refused": "a flip to training was refused; training without it",
    "step": "RL step done; agents roll out the next batch",
}
"""Human names of the trainer's status events, shown as the live view's phase."""


def spark(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in values[-40:])


class Snapshot:
    """One poll of everything shown."""

    def __init__(self, url: str, status_path: Path, http: httpx.Client) -> None:
        self.cells = all_cells(http, url)
        vers = http.get(f"{url}/v1/versions").json()
        self.versions = vers["versions"]
        metrics = http.get(f"{url}/metrics").text
        self.drift = _metric(metrics, "cellflip_retokenization_drift_total")
        self.migrations = _samples(metrics, "cellflip_migrations_total")
        self.flips = _metric(metrics, "cellflip_flips_total")
        self.missing = _metric(metrics, "cellflip_logprob_missing_tokens_total")
        self.events = read_status(status_path)

    @property
    def steps(self) -> list[dict]:
        return [e for e in self.events if e.get("event") == "step"]


def read_status(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def node_of(cell: dict) -> str:
    """Where a cell runs: the node its launcher reported (Ray), else the host of its address."""
    node = (cell.get("capabilities") or {}).get("node")
    return str(node) if node else str(cell.get("address", "")).rpartition(":")[0] or "-"


def render(s: Snapshot, url: str, total_steps: int) -> Group:
    cells = Table(title="cells", expand=True)
    for col in ("cell", "node", "state", "version", "in flight", "KV blocks"):
        cells.add_column(col)
    for c in s.cells:
        style = {"rollout": "green", "training": "magenta", "draining": "yellow", "loading": "cyan",
                 "down": "red"}.get(c["state"], "")
        cells.add_row(c["id"], node_of(c), f"[{style}]{c['state']}[/]", str(c.get("version")),
                      str(c.get("inflight", 0)), f"{c.get('kv_blocks_used', 0)}/{c.get('kv_blocks_total', 0)}")
    steps = s.steps
    rewards = [e["reward"] for e in steps]
    last = steps[-1] if steps else {}
    phase = _phase(s.events)
    live = [v for v in s.versions if v["state"] != "retired"]
    backlog = sum(v.get("tokens_unscored", 0) for v in s.versions)
    rl = Table.grid(padding=(0, 2))
    rl.add_row("step", f"{len(steps)}/{total_steps}", "phase", phase)
    rl.add_row("reward (batch mean)", f"{rewards[-1]:.3f}" if rewards else "-", "trend", spark(rewards))
    rl.add_row("flips", f"{s.flips:.0f}", "moves committed", moves_line(s.migrations))
    rl.add_row("training cells (last step)", f"{last.get('train_cells', 0):.0f}" if last else "-",
               "training step s", f"{last['train_s']:.1f}" if "train_s" in last else "-")
    rl.add_row("versions live", ", ".join(f"v{v['version']}:{v['state']}" for v in live) or "-",
               "log-prob backlog", f"{backlog} tokens ({s.missing:.0f} missing)")
    rl.add_row("retokenization drift", f"{s.drift:.0f}", "episodes lost",
               str(last.get("agents", {}).get("lost", 0)))
    rl.add_row("API", url, "metrics", f"{url}/metrics")
    return Group(Panel(rl, title="cellflip up: agentic RL on CPU cells"), cells)


def _phase(events: list[dict]) -> str:
    if not events:
        return "starting the trainer"
    e = events[-1]
    name = PHASES.get(e.get("event", ""), e.get("event", ""))
    if e.get("event") == "warmup_progress" and e.get("steps"):
        done, total = e["step"], e["steps"]
        bar = "█" * int(20 * done / total) + "░" * (20 - int(20 * done / total))
        eta = f", about {e['eta_s']:.0f} s left" if e.get("eta_s") is not None else ""
        return f"{name} {bar} {done}/{total}{eta}"
    return name


def summary_table(s: Snapshot) -> Table:
    t = Table(title="cellflip up: summary", caption=f"moves committed: {moves_line(s.migrations)}")
    for col in ("step", "version", "reward", "episodes", "tokens", "exact", "flips", "kv moves", "step s"):
        t.add_column(col, justify="right")
    for e in s.steps:
        t.add_row(str(e["step"]), str(e["version"]), f"{e['reward']:.3f}", str(e["episodes"]), str(e["tokens"]),
                  str(e["exact"]), str(e["flips"]), str(e["migrated"]), f"{e['step_s']:.1f}")
    return t


def watch(url: str, status_path: Path, total_steps: int, done, every_s: float = 1.0,
          headers: dict[str, str] | None = None) -> Snapshot | None:
    """Refresh the view until `done()`; returns the last snapshot."""
    last = None
    with httpx.Client(timeout=10.0, headers=headers or {}) as http, Live(refresh_per_second=2, transient=False) as live:
        while True:
            try:
                last = Snapshot(url, status_path, http)
                live.update(render(last, url, total_steps))
            except httpx.HTTPError:
                pass  # the scheduler is restarting or busy: keep the last view
            if done():
                return last
            time.sleep(every_s)
