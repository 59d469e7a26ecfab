"""Groups: the samples drawn for one prompt, taken whole.

Group-relative advantages (GRPO, RLOO) compare a sample with its siblings. Statistics over the
subset that finished first are biased: finishing time tracks length, and length tracks reward
(in the toy task, skipping the tool is short and scores 0), so a group split by finishing
order loses exactly the contrast it exists to show. The rules (docs/RL.md, "Advantages"):

    ready      all `group_size` members finished                    -> trained, whole
    deadline   not ready `deadline_s` after its first member came   -> dropped whole, counted
    stale      the scheduler dropped a member (staleness bound)     -> dropped whole, counted
    uniform    ready, every reward equal, `drop_uniform` is on      -> dropped whole, counted
    no_group   a trajectory without a group id (no baseline)        -> dropped, counted
    late       a member arriving after its group was settled        -> dropped with it, counted

A member is one rollout. A tree rollout's branches are sessions `sid`, `sid.b1`, ... with the
same group id (toy_task.run_episode); they are one member, complete once its trunk session
`sid` finished (the harness finishes the trunk after its branches).

`GroupGate.select` is a pure decision over the trajectories the caller holds, apart from the
gate's own bookkeeping (when each group was first seen, the drop counts); the caller removes
what was taken and what was dropped.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cells.rl.trees import member_id

DROP_REASONS = ("deadline", "stale", "uniform_reward", "no_group", "late", "untrusted")
"""Why trajectories are dropped (the `reason` label of `cellflip_groups_dropped_total`);
`late`: a trajectory whose group was already trained (counted as a trajectory, not a group);
`untrusted`: a member holds tokens a quarantined cell sampled."""

MAX_CLOSED = 100_000
"""Settled group ids remembered (to recognise stragglers)."""

def num_members(trajectories: Sequence[dict[str, Any]]) -> int:
    """Rollouts among `trajectories` (a tree's branch sessions count once)."""
    return len({(t.get("group_id"), member_id(t)) for t in trajectories})


def is_trunk(trajectory: dict[str, Any]) -> bool:
    """The member's own session (finished last, after its branches)."""
    return member_id(trajectory) == str(trajectory["id"])


@dataclass
class Selection:
    """What `select` decided: trajectories of ready groups (whole groups, oldest first), and
    the trajectories dropped and groups dropped, by reason."""

    ready: list[dict[str, Any]] = field(default_factory=list)
    dropped: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    groups_dropped: Counter[str] = field(default_factory=Counter)

    def dropped_trajectories(self) -> list[dict[str, Any]]:
        return [t for ts in self.dropped.values() for t in ts]


class GroupGate:
    """Hands out whole groups; drops (and counts) the ones that cannot be trained."""

    def __init__(self, group_size: int, *, deadline_s: float, drop_uniform: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a baseline needs siblings), got {group_size}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.group_size = group_size
        self.deadline_s = deadline_s
        self.drop_uniform = drop_uniform
        self.clock = clock
        self.first_seen: dict[str, float] = {}
        """group id → when its first member reached `select`."""
        self.groups_dropped: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        """Groups dropped since construction, by reason."""
        self.trajectories_dropped: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        """Their trajectories, by reason (stragglers of a dropped group included)."""
        self.closed: OrderedDict[str, str] = OrderedDict()
        """group id → 'taken' or its drop reason, for the last MAX_CLOSED groups: a member
        arriving after its group was settled is dropped with it, not started as a new group."""

    def select(self, pending: Sequence[dict[str, Any]], max_members: int) -> Selection:
        """Ready groups, whole, oldest first, until at least `max_members` rollouts are taken
        (a tree counts once; a group is never split, so the last one may go past it); every
        group that can no longer be trained is dropped and counted. Mutates only the gate's
        bookkeeping."""
        now = self.clock()
        out = Selection()
        groups: dict[str, list[dict[str, Any]]] = {}
        for t in pending:
            gid = t.get("group_id")
            if gid is None:
                self._drop(out, "no_group", [t])
                continue
            if gid in self.closed:  # a straggler of a settled group: never trained alone
                reason = self.closed[gid]
                reason = "late" if reason == "taken" else reason
                out.dropped.setdefault(reason, []).append(t)
                self.trajectories_dropped[reason] += 1
                continue
            groups.setdefault(gid, []).append(t)
            self.first_seen.setdefault(gid, now)
        ready: list[tuple[float, str]] = []
        for gid, members in groups.items():
            reason = self._verdict(members, now - self.first_seen[gid])
            if reason == "ready":
                ready.append((self.first_seen[gid], gid))
            elif reason is not None:
                self._drop(out, reason, members)
                self._close(gid, reason)
        for _, gid in sorted(ready):
            if num_members(out.ready) >= max_members:
                break
            out.ready += groups[gid]
            self._close(gid, "taken")
        return out

    def _close(self, gid: str, how: str) -> None:
        del self.first_seen[gid]
        self.closed[gid] = how
        while len(self.closed) > MAX_CLOSED:
            self.closed.popitem(last=False)

    def _verdict(self, members: list[dict[str, Any]], age_s: float) -> str | None:
        """'ready', a drop reason, or None (keep waiting)."""
        dropped = [t["dropped"] for t in members if t.get("dropped")]
        if dropped:
            return "untrusted" if "untrusted" in dropped else "stale"
        done = {member_id(t) for t in members if is_trunk(t)}
        if len(done) >= self.group_size:
            rewards = {float(t["reward"]) for t in members}
            return "uniform_reward" if self.drop_uniform and len(rewards) == 1 else "ready"
        return "deadline" if age_s > self.deadline_s else None

    def _drop(self, out: Selection, reason: str, members: list[dict[str, Any]]) -> None:
        out.dropped.setdefault(reason, []).extend(members)
        out.groups_dropped[reason] += 1
        self.groups_dropped[reason] += 1
        self.trajectories_dropped[reason] += len(members)

