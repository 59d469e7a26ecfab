"""Prometheus metrics of the control plane, on their own CollectorRegistry (no globals).

Base units (seconds, bytes), `_total` counters, histograms for latencies. The fleet's
per-cell families (cells by state and role, in-flight, KV blocks, role-seconds, waiting) are
built at scrape time by the controller's tally (scheduler/control/tally.py, bound to `fleet`);
the other gauges mirroring the store are refreshed by the controller's passive sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SLOW = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

CELL_STATES = ("joining", "rollout", "draining", "training", "loading", "down")
GROUP_DROP_REASONS = ("deadline", "stale", "uniform_reward", "no_group", "late", "untrusted")
"""Why a trainer drops a group (cells/trainer/groups.py)."""


FLEET_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "cells": ("gauge", "Cells by state.", ("state",)),
    "cells_by_role": ("gauge", "Cells by role (draining counts as rollout, loading as training).", ("role",)),
    "cell_role_seconds": ("counter", "Seconds each cell spent in each state (utilization).", ("cell", "state")),
    "inflight_requests": ("gauge", "Requests running or migrating, per owner cell.", ("cell",)),
    "kv_blocks_used": ("gauge", "KV blocks in use, per cell (as reported).", ("cell",)),
    "waiting_requests": ("gauge", "Requests queued or suspended (waiting for a cell).", ()),
}
"""The fleet's families, built at scrape time (name without the prefix: type, help, labels)."""


def fleet_family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    """An empty family of `FLEET_FAMILIES` to add samples to."""
    kind, doc, labels = FLEET_FAMILIES[name]
    make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
    return make("cellflip_" + name, doc, labels=list(labels))


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "cellflip_"
        self.fleet: Callable[[], Iterable[Metric]] | None = None
        """The fleet's families at scrape time (a controller binds its tally here)."""
        r.register(_Fleet(self))
        self.migrations = Counter(p + "migrations", "Migrations by outcome and path.", ["outcome", "path"], registry=r)
        self.migration_downtime = Histogram(p + "migration_downtime_seconds", "Client-visible gap of a migration, minus the median inter-token gap.", buckets=_LATENCY, registry=r)
        self.migration_bytes = Counter(p + "migration_bytes", "KV bytes moved by migrations.", registry=r)
        self.flips = Counter(p + "flips", "Finished flips by outcome.", ["outcome"], registry=r)
        self.flip_duration = Histogram(p + "flip_duration_seconds", "Flip duration from request to done/failed.", buckets=_SLOW, registry=r)
        self.broadcast = Histogram(p + "weight_broadcast_seconds", "Weight broadcast time per receiving cell.", buckets=_SLOW, registry=r)
        self.versions_live = Gauge(p + "versions_live", "Weight versions not yet retired.", registry=r)
        self.logprob_backlog = Gauge(p + "logprob_backlog_tokens", "Sampled tokens without an old log-prob, per version.", ["version"], registry=r)
        self.logprob_scored = Counter(p + "logprob_scored_tokens", "Sampled tokens given an exact old log-prob by the log-prob service.", registry=r)
        self.logprob_missing = Counter(p + "logprob_missing_tokens", "Sampled tokens whose exact old log-prob became impossible (provenance missing).", registry=r)
        self.logprob_final_pass = Histogram(p + "logprob_final_pass_seconds", "From a cell switching off a version to dropping it (its final scoring pass).", buckets=_SLOW, registry=r)
        self.tokens_generated = Counter(p + "tokens_generated", "Sampled tokens committed to the session store.", registry=r)
        self.ingest_commits = Counter(p + "ingest_commits", "Transactions committing syncs' token batches.", registry=r)
        self.ingest_syncs = Counter(p + "ingest_syncs", "Syncs those transactions committed (group commit).", registry=r)
        self.admission_rejected = Counter(p + "admission_rejected", "Completions refused with 429 (no rollout capacity).", registry=r)
        self.drift = Counter(p + "retokenization_drift", "Recorded tokens that differ from sampled ones (must stay 0).", registry=r)
        self.history_rewrites = Counter(p + "history_rewrites", "Harness edits of earlier turns (each starts a new segment).", registry=r)
        self.starts = Counter(p + "request_starts", "Requests started on a cell, by what the start carried (delta: a sticky turn's new tokens after the held prefix; full: the whole context).", ["kind"], registry=r)
        self.prefix_missing = Counter(p + "prefix_missing", "Sticky turns whose cell lacked the prefix its delta start named (the whole context was sent instead).", registry=r)
        self.requests_stalled = Counter(p + "requests_stalled", "Running requests taken back from an owner that reported them but committed no token for stall_timeout_s.", ["cell"], registry=r)
        self.probes = Counter(p + "probes", "Registration probes by outcome (verified: agreed with the version's reference; refused: disagreed).", ["outcome"], registry=r)
        self.quarantined = Counter(p + "cells_quarantined", "Cells quarantined for what they reported (invalid tokens, contradicted log-probs, a disagreeing probe).", registry=r)
        self.tokens_resampled = Counter(p + "tokens_resampled", "Tokens a quarantined cell sampled (and those after them) that no client was shown: taken back and sampled again by a trusted cell.", registry=r)
        self.sessions_tainted = Counter(p + "sessions_tainted", "Sessions holding tokens a quarantined cell sampled: never trained on.", registry=r)
        self.training_update_kl = Gauge(p + "training_update_kl", "KL(pi_prox || pi_new) of the last RL update (nats per token, the trust-region guard's estimate).", registry=r)
        self.training_grad_norm = Gauge(p + "training_grad_norm", "Gradient norm of the last RL update's last optimizer step (before clipping).", registry=r)
        self.training_clip_fraction = Gauge(p + "training_clip_fraction", "Fraction of kept tokens whose PPO ratio was clipped in the last RL update.", registry=r)
        self.training_entropy = Gauge(p + "training_entropy", "The policy's mean entropy at the sampled tokens at the last RL update's start (nats).", registry=r)
        self.training_updates = Counter(p + "training_updates", "RL updates by outcome (kept: published as a version; rejected: past max_update_kl, nothing published).", ["outcome"], registry=r)
        self.trained_tokens = Counter(p + "trained_tokens", "Trained tokens by versions behind the update's start (the staleness histogram; 64 collects 64 and more).", ["versions_behind"], registry=r)
        self.requests_failed = Counter(p + "requests_failed", "Requests ended with an error reason (stuck after repeated re-placement, their session changed under them, or their sampler quarantined).", registry=r)
        self.tokens_rejected = Counter(p + "tokens_rejected", "Token batches refused at sync, by reason.", ["reason"], registry=r)
        self.fenced = Counter(p + "cells_fenced", "Cell incarnations fenced (lease lost or replaced).", ["reason"], registry=r)
        self.groups_dropped = Counter(p + "groups_dropped", "Groups the trainer dropped whole, never trained, by reason (as it reports them).", ["reason"], registry=r)
        self.group_trajectories_dropped = Counter(p + "group_trajectories_dropped", "Trajectories of the groups the trainer dropped, by reason.", ["reason"], registry=r)
        self.stale_trajectories = Counter(p + "stale_trajectories", "Trajectories handed out past the staleness bound, by the policy applied (correct: trained with correction weights; drop: handed out as dropped).", ["policy"], registry=r)
        self.admission_stale = Counter(p + "admission_staleness_paused", "New sessions refused with 429 because the staleness bound held admission.", registry=r)
        self.staleness_max = Gauge(p + "trajectory_staleness_max", "Largest staleness (versions) of a trajectory handed out so far.", registry=r)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "How late the scheduler's event loop ran a 100 ms beat: the longest any handler held it in that beat (every request, sync and stream waits behind it).", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.gc_full = Histogram(p + "gc_full_seconds", "The scheduler's scheduled full garbage collections (scheduler/contract/gcpolicy.py): the event loop is held this long.", buckets=_LATENCY, registry=r)
        self.training_step = Histogram(p + "training_step_seconds", "Duration of a training step (RL update on the training cells), as the trainer reports it.", buckets=_SLOW, registry=r)
        self.training_cells = Gauge(p + "training_step_cells", "Training cells the last reported training step ran on (its data-parallel group).", registry=r)
        self._job_metrics(p, r)
        for outcome in ("committed", "aborted"):
            for path in ("kv", "kv_store", "reprefill"):
                self.migrations.labels(outcome, path)
        for outcome in ("done", "failed", "rolled_back"):
            self.flips.labels(outcome)
        for reason in GROUP_DROP_REASONS:
            self.groups_dropped.labels(reason)
            self.group_trajectories_dropped.labels(reason)
        for policy in ("correct", "drop"):
            self.stale_trajectories.labels(policy)

    def _job_metrics(self, p: str, r: CollectorRegistry) -> None:
        """The RL jobs' families (docs/JOBS.md), labelled by job."""
        self.job_cells = Gauge(p + "job_cells", "Live cells each RL job holds.", ["job"], registry=r)
        self.job_target_cells = Gauge(p + "job_target_cells", "Cells the planner's division of the fleet gives each RL job.", ["job"], registry=r)
        self.job_open_sessions = Gauge(p + "job_open_sessions", "Open sessions of each RL job.", ["job"], registry=r)
        self.job_moves = Counter(p + "job_moves", "Cells moved between RL jobs (drained, reassigned, loaded), by source and destination job.", ["from_job", "to_job"], registry=r)
        self.job_sessions_refused = Counter(p + "job_sessions_refused", "New sessions a job refused (draining, past max_sessions, another job's token), by job and reason.", ["job", "reason"], registry=r)

    def observe_update(self, u: dict) -> None:
        """One RL update's figures, as the trainer reported them."""
        self.training_update_kl.set(u["update_kl"])
        self.training_grad_norm.set(u["grad_norm"])
        self.training_clip_fraction.set(u["clip_frac"])
        self.training_entropy.set(u["entropy"])
        self.training_updates.labels("rejected" if u.get("rejected") else "kept").inc()
        for k, n in enumerate(u.get("staleness") or ()):
            if n:
                self.trained_tokens.labels(str(min(k, 64))).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Fleet:
    """The collector of `Metrics.fleet` (nothing before a controller binds one)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        if self.metrics.fleet is None:  # declared, with no samples yet
            return [fleet_family(name) for name in FLEET_FAMILIES]
        return self.metrics.fleet()
