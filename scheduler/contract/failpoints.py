"""Named failpoints at the protocol steps that matter; inert unless enabled.

Enable with the environment variable `CELLFLIP_FAILPOINTS="name=action[;name=action...]"` or
`enable(name, action)` in-process. Actions:
  raise        raise FailpointError at that point
  kill         SIGKILL this process (a crash with no clean-up)
  stop         SIGSTOP this process (a stall: its lease expires while it is frozen)
  sleep:S      sleep S seconds
  block        hold the calling thread until the process dies (no bytes flow: the peers'
               real timeout paths must fire)
An action may be prefixed with `N*` to fire only on the N-th hit (e.g. `2*kill`).
Every hit of an enabled failpoint is counted in `hits` so a campaign knows it fired.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

CANARY_NO_FENCING = os.environ.get("CELLFLIP_CANARY_NO_FENCING") == "1"
"""TEST ONLY, inert unless set; never set it outside the fault campaign's canary run
(faultkit, bench/faults.py), which proves its checkers can fail. When set (read once, at
import) the scheduler's epoch fence is off: a commit or abort from a fenced incarnation is not
refused, a source's abort after the destination's commit won is answered as if the abort had
won, so the source resumes beside the new owner (split ownership), and token batches from a
cell that is not the owner, at a stale epoch, or for a request that no cell runs at the moment
(its owner was fenced and it waits to be placed again) are accepted and stored
(scheduler/control/ingest.py), even from a fenced incarnation before it is told
(scheduler/control/cellsync.py): the store's own token history must show the split."""

FAILPOINTS: dict[str, str] = {
    "migrate.after_copy_round": "source, after each copy round while decoding",
    "migrate.before_stop_copy": "source, after pausing the request, before sending the tail",
    "migrate.after_stop_copy": "source, after the tail was sent, before the outcome arrives",
    "migrate.before_commit": "destination, after import, before the owner record",
    "migrate.after_commit": "destination, after the owner record, before resuming",
    "migrate.before_source_free": "source, after the commit, before freeing its blocks",
    "migrate.transfer": "either side, inside a KV transfer (use `block` for a partition)",
    "flip.after_record": "scheduler, between recording a flip and acting on it",
    "broadcast.mid_bucket": "a broadcast receiver or sender, between buckets",
    "training.after_minibatch": "a training rank, after each minibatch's optimizer step (mid-update)",
    "training.before_commit": "the training coordinator, with the cells' update received, before committing it",
    "training.after_commit": "the trainer, after a commit, before its checkpoint is written",
    "logprob.final_pass": "a cell, before each scoring task (the final pass before dropping a version is made of them)",
}


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is `raise`."""


log = logging.getLogger("cellflip.failpoints")
_lock = threading.Lock()
_enabled: dict[str, str] = {}
hits: dict[str, int] = {}


def _parse(spec: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, action = part.partition("=")
        if name not in FAILPOINTS:
            raise ValueError(f"unknown failpoint {name!r} (known: {sorted(FAILPOINTS)})")
        out[name] = action or "raise"
    return out


def enable(name: str, action: str = "raise") -> None:
    _parse(f"{name}={action}")
    with _lock:
        _enabled[name] = action


def load_env() -> None:
    spec = os.environ.get("CELLFLIP_FAILPOINTS", "")
    if spec:
        with _lock:
            _enabled.update(_parse(spec))


def failpoint(name: str) -> None:
    """Fire `name` if enabled. A no-op dictionary lookup otherwise."""
    action = _enabled.get(name)
    if action is None:
        return
    with _lock:
        hits[name] = n = hits.get(name, 0) + 1
    if "*" in action:
        nth, _, action = action.partition("*")
        if n != int(nth):
            return
    if action != "raise":  # the fault's injection time, in the process's log (raise says it itself)
        log.warning("failpoint %s: %s", name, action)
    if action == "raise":
        raise FailpointError(f"failpoint {name}")
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "block":
        threading.Event().wait()
    else:
        raise ValueError(f"failpoint {name}: unknown action {action!r}")


load_env()
