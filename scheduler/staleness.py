"""The staleness bound (AReaL's bound on off-policyness), in versions = published RL updates.

Two rules share `scheduler.staleness_bound` (the planner reads the same field):

    admission   a NEW session gets 429 (reason `staleness_bound`) while the sessions in flight
                plus the finished ones the trainer has not fetched reach (bound + 1) × the
                trainer's batch size: work admitted now would otherwise be trained more than
                `bound` updates after it started. Later turns of admitted sessions always pass.
                Until the trainer has declared its batch size (POST /v1/trainer/report) the
                rule has no unit and admits.
    hand-out    at GET /v1/trajectories, a trajectory's staleness is the number of published
                versions newer than its oldest sampled token's version. Past the bound it
                follows `staleness_policy`: `correct` hands it out (the decoupled objective's
                staleness weight min(r_stale, C_s) corrects it), `drop` hands out only a record
                saying so (`dropped: "stale"`, no tokens; the trainer drops its whole group).

Counted either way, never silent: `cellflip_stale_trajectories_total{policy}`,
`cellflip_admission_staleness_paused_total`, `cellflip_trajectory_staleness_max`, and the
`staleness` block of GET /v1/versions.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.errors import NoCapacity

if TYPE_CHECKING:
    from scheduler.controller import Controller

IN_FLIGHT_STATES = ("queued", "running", "migrating", "suspended", "parked")
"""Request states of a session still being rolled out."""


@dataclass
class StalenessState:
    """Counters of the two rules since this scheduler started (reported by GET /v1/versions)."""

    handed_out: int = 0
    """Trajectories handed out (all)."""
    stale_corrected: int = 0
    """Past the bound, handed out to be trained with correction weights."""
    stale_dropped: int = 0
    """Past the bound, handed out as dropped."""
    max_seen: int = 0
    """Largest staleness of a trajectory handed out."""
    admission_paused: int = 0
    """New sessions refused by the admission rule."""


def versions_behind(published: list[int], version: int) -> int:
    """Published versions newer than `version` (`published` sorted ascending)."""
    return len(published) - bisect.bisect_right(published, version)


def trajectory_staleness(published: list[int], traj: dict[str, Any]) -> int:
    """Versions between a trajectory's oldest sampled token and the newest published version
    (0 without sampled tokens)."""
    sampled = [v for m, v in zip(traj["loss_mask"], traj["versions"], strict=True) if m and v is not None]
    return versions_behind(published, min(sampled)) if sampled else 0


def admission_limit(ctl: Controller) -> int | None:
    """(bound + 1) × the trainer's batch size, or None before the trainer declared one."""
    demand = ctl.rates.demand
    return None if demand is None else (ctl.cfg.staleness_bound + 1) * demand.batch_size


def untrained_work(ctl: Controller) -> int:
    """Sessions in flight plus finished sessions the trainer has not fetched."""
    counts = ctl.store.owners.count_requests()
    return sum(counts.get(s, 0) for s in IN_FLIGHT_STATES) + ctl.store.sessions.finished_after(ctl.trajectory_cursor)


def check_admission(ctl: Controller, session_id: str | None) -> None:
    """Raise NoCapacity (429, reason `staleness_bound`) for a new session the bound holds back."""
    if session_id is not None and ctl.store.owners.has_requests(session_id):
        return  # a later turn of an admitted session (the gateway creates the session first)
    limit = admission_limit(ctl)
    if limit is None:
        return
    work = untrained_work(ctl)
    if work < limit:
        return
    ctl.staleness.admission_paused += 1
    ctl.metrics.admission_stale.inc()
    raise NoCapacity(f"staleness bound: {work} sessions in flight or finished and not yet trained, "
                     f"limit (staleness_bound + 1) x batch = {limit}", code="staleness_bound",
                     retry_after_s=max(1.0, ctl.cfg.heartbeat_s * 2))


def apply_to_trajectories(ctl: Controller, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Annotate each trajectory with its `staleness` (versions) and apply the policy to those
    past the bound; returns the list to hand out (same order, same length)."""
    published = sorted(r.v for r in ctl.store.fleet.list_versions())
    bound, policy, st = ctl.cfg.staleness_bound, ctl.cfg.staleness_policy, ctl.staleness
    out = []
    for t in items:
        k = trajectory_staleness(published, t)
        st.handed_out += 1
        if k > st.max_seen:
            st.max_seen = k
            ctl.metrics.staleness_max.set(k)
        t = {**t, "staleness": k}
        if k > bound:
            ctl.metrics.stale_trajectories.labels(policy).inc()
            if policy == "drop":
                st.stale_dropped += 1
                t = {"id": t["id"], "state": t["state"], "reward": t["reward"], "group_id": t["group_id"],
                     "staleness": k, "dropped": "stale"}
            else:
                st.stale_corrected += 1
        out.append(t)
    return out


def to_api(ctl: Controller) -> dict[str, Any]:
    """The `staleness` block of GET /v1/versions."""
    st = ctl.staleness
    return {"bound": ctl.cfg.staleness_bound, "policy": ctl.cfg.staleness_policy,
            "trajectories_handed_out": st.handed_out, "stale_corrected": st.stale_corrected,
            "stale_dropped": st.stale_dropped, "max_seen": st.max_seen,
            "admission_limit": admission_limit(ctl), "admission_paused": st.admission_paused}
