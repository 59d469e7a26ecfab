"""The join barrier of a version's update group: nobody forms the group until every member is there.

One line: each member (its engine paused) writes `joined` → the sender, once every member
has joined or its bounded wait ends, writes the verdict `go` or `abort` → members wait
(bounded) for it → on `go` everyone forms the group and the buckets follow; on `abort`, or
no verdict in time, members leave with their weights untouched.

Why: NCCL sets a communicator up inside its first collective, with no timeout the caller
controls (SGLang's update group waits for its 30-minute default), and gloo's rendezvous
blocks SGLang's `init_weights_update_group` the same way. One member that never comes
would stall the sender and every other member's engine thread; with the barrier it costs
one bounded wait. A member that fails after `go` has (or may have) entered a collective
whose state nobody can vouch for, so its engine is restarted (control.py).

Keys live in the group's own rendezvous store (the TCPStore the sender hosts at
`master_address:master_port`), beside SGLang's, JSON values only:
  cellflip-barrier/{group_name}/joined/{rank_offset}   member: {}
  cellflip-barrier/{group_name}/verdict                sender: {"go": bool, "reason": str}
"""

from __future__ import annotations

from datetime import timedelta

import torch

from cells.engine.records import EngineError
from cells.engine.sglang.weights import UpdateGroup
from cells.transport.store import get_json, set_json, wait_json, wait_keys

VERDICT_SLACK_S = 5.0
"""A member waits this much longer than the sender's own wait: it started waiting later
(after the plan reached it), so the sender's verdict, go or abort, is due before that."""


class BarrierAborted(EngineError):
    """The update was called off before any collective: the member's weights are untouched."""


def joined_key(group_name: str, rank_offset: int) -> str:
    return f"cellflip-barrier/{group_name}/joined/{rank_offset}"


def verdict_key(group_name: str) -> str:
    return f"cellflip-barrier/{group_name}/verdict"


def member_join(group: UpdateGroup) -> None:
    """Member side: say this member joined, then wait for the sender's verdict. Returns on
    `go`; raises `BarrierAborted` on `abort`, on no verdict within `group.barrier_s` (plus
    slack), or when the sender's store cannot be reached. Nothing is formed either way."""
    assert group.barrier_s is not None, "the sender holds no barrier for this group"
    wait_s = group.barrier_s + VERDICT_SLACK_S
    try:
        store = torch.distributed.TCPStore(group.master_address, group.master_port, is_master=False,
                                           wait_for_workers=False, timeout=timedelta(seconds=wait_s))
        set_json(store, joined_key(group.group_name, group.rank_offset), {})
        verdict = wait_json(store, verdict_key(group.group_name), wait_s)
    except (RuntimeError, OSError) as e:  # torch's DistError is a RuntimeError
        raise BarrierAborted(f"update group {group.group_name}: the sender's store is unreachable ({e})") from e
    if verdict is None:
        raise BarrierAborted(f"update group {group.group_name}: no verdict from the sender within {wait_s:.1f}s")
    if not isinstance(verdict, dict) or verdict.get("go") is not True:
        reason = verdict.get("reason") if isinstance(verdict, dict) else verdict
        raise BarrierAborted(f"update group {group.group_name}: the sender called it off ({reason})")


def sender_verdict(store, group_name: str, rank_offsets: dict[str, int], wait_s: float) -> list[str]:
    """Sender side: wait at most `wait_s` for every member's `joined`, then write `go` (all
    there) or `abort`. Returns the members that did not join ([] after `go`)."""
    keys = {c: joined_key(group_name, off) for c, off in rank_offsets.items()}
    present = set(wait_keys(store, list(keys.values()), wait_s))
    missing = [c for c, k in keys.items() if k not in present]
    verdict = {"go": not missing, "reason": f"{missing} did not join within {wait_s:.1f}s" if missing else ""}
    set_json(store, verdict_key(group_name), verdict)
    return missing


def read_verdict(store, group_name: str) -> dict | None:
    """The verdict written for `group_name`, or None (for tests and post-mortems)."""
    key = verdict_key(group_name)
    return get_json(store, key) if store.check([key]) else None
