"""The trainer side of a training step: the coordinator plans and commits, the cells hold and
compute. It holds no model state: a commit is metadata plus per-tensor checksums.

One step, one line: plan (advantages, minibatches, token shares) → assign each training cell
→ acks (who is alive, which committed state each holds) → name the state's source → the
cells join it (from a rank of the step, a peer cell outside it, a checkpoint, or built from
the start weights) and report its checksum → compute → every rank reports the same
parameters → commit (version v, the parameters' checksums, the data cursor and the trainer's
counters) → the ranks keep it under the new tag.

Where the committed state lives: on the ranks that computed it, through their rollout stints
(parked in host memory, cells/training/worker.py), each announcing what it holds
(`protocol.holds_key`); a checkpoint written by one of them (`checkpoint`) is the fallback.
Nothing of it passes through this process: a joining rank receives it from a peer.

Any failure (a cell dead or stalled mid-step, a timeout, a checksum mismatch) aborts the
attempt: every surviving rank restores the start-of-update state it holds, and the step is
redone with the cells that still answer, counted in `attempts`. With no cell left the step
fails (`StepFailed`): the trainer retries it with the cells it gets next.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from cells.rl.objectives import ObjectiveConfig
from cells.rl.plan import plan_update
from cells.training import jobs
from cells.training import protocol as P
from cells.transport.store import StoreAddress, connect, get_json, set_json, wait_any, wait_keys
from scheduler.contract.failpoints import failpoint

log = logging.getLogger("cellflip.training")


class StepFailed(RuntimeError):
    def __init__(self, reason: str, lost: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.lost = list(lost)


class StateLost(RuntimeError):
    """No cell and no checkpoint holds the committed state any more."""


class Heartbeats:
    """Which of `cells` stopped beating (`protocol.beat_key`) for `timeout_s`."""

    def __init__(self, store, cells: list[str], timeout_s: float) -> None:
        self.store, self.cells, self.timeout_s = store, cells, timeout_s
        now = time.monotonic()
        self.last = {c: (self._read(c), now) for c in cells}

    def _read(self, cell: str) -> int:
        return int(self.store.add(P.beat_key(cell), 0))

    def silent(self) -> list[str]:
        now, out = time.monotonic(), []
        for c in self.cells:
            n = self._read(c)
            if n != self.last[c][0]:
                self.last[c] = (n, now)
            elif now - self.last[c][1] > self.timeout_s:
                out.append(c)
        return out


class TrainingCoordinator:
    """Drives the training cells' steps. `hyper` (`protocol.hyper_of`) and `params` (name,
    shape) describe the learner every rank builds; `start`: where the first state comes from
    when nothing holds one (`{"kind": "init", "seed", "std"}` or `{"kind": "path", "path"}`,
    built by each rank itself); `address`: the rendezvous store the cells know."""

    def __init__(self, hyper: dict[str, Any], params: list, address: StoreAddress, *, start: dict[str, Any],
                 timeout_s: float = 30.0, ack_timeout_s: float = 10.0, step_timeout_s: float = 600.0,
                 max_attempts: int = 3, emit: Callable[[dict], None] | None = None) -> None:
        self.hyper, self.params, self.address, self.start = dict(hyper), params, address, dict(start)
        self.objective = ObjectiveConfig.model_validate_json(hyper["objective"])
        self.minibatches = int(hyper["minibatches"])
        self.lr = float(hyper["lr"])
        self.timeout_s, self.ack_timeout_s = timeout_s, ack_timeout_s
        self.step_timeout_s, self.max_attempts = step_timeout_s, max_attempts
        self.emit = emit or (lambda rec: log.info("%s", rec))
        self.store = connect(address, timeout_s=timeout_s)
        self.run = uuid.uuid4().hex[:8]
        self.num_steps = 0
        self.commit: dict[str, Any] | None = None
        """The newest committed state: tag, version, step, checksum, tensors, cursor, extra."""
        self.checkpoint_path: str | None = None
        self._writing: tuple[str, str, str | None] | None = None
        """The newest checkpoint a cell wrote (the state's fallback home)."""
        self.holders: list[str] = []
        """Cells that hold the committed state (those that computed it, newest first)."""
        self._progress: Callable[[dict], None] | None = None
        self.used_weights: dict[str, str] = {}
        """The last update's per-token weights per session (the trainer writes them back)."""
        set_json(self.store, P.SKELETON_KEY, {"hyper": self.hyper, "params": params})

    @property
    def tag(self) -> str | None:
        return None if self.commit is None else self.commit["tag"]

    @property
    def version(self) -> int:
        return 0 if self.commit is None else int(self.commit["version"])

    def adopt(self, commit: dict[str, Any], holders: Sequence[str] = (), checkpoint: str | None = None) -> None:
        """Take over a committed state found on the cells or in a checkpoint (a restart)."""
        self.commit, self.holders, self.checkpoint_path = dict(commit), list(holders), checkpoint

    # -- steps ---------------------------------------------------------------------------
    def update(self, trajectories: Sequence[dict], cells: Sequence[str], *, next_version: Callable[[], int],
               shares: Sequence[float] | None = None, cursor: int | None = None,
               staleness_bound: int | None = None, extra: dict | None = None,
               peers: Sequence[str] = ()) -> dict[str, Any]:
        """One RL update on `cells` (redone without the cells that fail); committed as version
        `next_version()` unless the trust-region guard rejected it. `peers`: other cells that
        may hold the state (a joiner's source when no rank of the step does)."""
        def plan(n: int, sh: Sequence[float] | None) -> dict[str, Any]:
            p = plan_update(trajectories, self.objective, self.minibatches, list(sh) if sh else [1.0] * n,
                            version=self.version, staleness_bound=staleness_bound)
            return {"kind": "rl", "shares": [s.to_json() for s in p.shares], "plan": p}

        return self._run(plan, list(cells), next_version, shares, cursor, extra, peers)

    def warmup(self, cell: str, demos: list, *, steps: int, batch_size: int, lr: float,
               extra: dict | None = None, on_progress: Callable[[dict], None] | None = None,
               peers: Sequence[str] = (), version: int = 1) -> dict[str, Any]:
        """The supervised warm-up (`steps` SFT steps on `demos`, then RL begins: reference,
        moments dropped, `version`) on one cell, committed like an update."""
        def plan(n: int, sh: Sequence[float] | None) -> dict[str, Any]:
            return {"kind": "warmup", "demos": demos, "steps": steps, "batch_size": batch_size, "lr": lr}

        self._progress = on_progress
        try:
            return self._run(plan, [cell], lambda: version, None, None, extra, peers)
        finally:
            self._progress = None

    def _run(self, plan, cells: list[str], next_version, shares, cursor, extra, peers) -> dict[str, Any]:
        self.num_steps += 1
        lost, attempts = [], 0
        try:
            while cells and attempts < self.max_attempts:
                attempts += 1
                try:
                    out = self._attempt(plan(len(cells), shares), cells, attempts, next_version, cursor,
                                        extra, [p for p in peers if p not in cells])
                except StepFailed as e:
                    lost += e.lost
                    self.emit({"event": "train_attempt_failed", "step": self.num_steps, "attempt": attempts,
                               "cells": cells, "reason": str(e)[:300], "lost": e.lost})
                    cells, shares = [c for c in cells if c not in e.lost], None
                    continue
                out.update({"attempts": float(attempts), "cells_lost": float(len(lost))})
                return out
        finally:
            for c in cells + lost:  # a cell restarting later must not take this step up again
                self.store.delete_key(P.assign_key(c))
        raise StepFailed(f"step {self.num_steps}: no cell left after {attempts} attempts (lost {lost})", lost)

    def _attempt(self, work: dict, cells: list[str], attempt: int, next_version, cursor, extra,
                 peers: list[str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        prefix = P.attempt_prefix(self.num_steps, attempt, self.run)
        plan = work.pop("plan", None)
        try:
            self._assign(prefix, cells, attempt, work)
            acks = self._acks(prefix, cells)
            source = self._source(prefix, acks, peers)
            joined = self._check_joined(prefix, cells, source)
            join_s = time.perf_counter() - t0 if source["to"] else 0.0
            result = self._result(prefix, cells)
            self._check_ranks(prefix, cells, result["checksum"])
        except (StepFailed, RuntimeError) as e:
            set_json(self.store, f"{prefix}/abort", {"reason": str(e)[:300]})
            raise e if isinstance(e, StepFailed) else StepFailed(str(e), self._failed(prefix, cells)) from e
        out = self._commit(prefix, result, next_version, cells, cursor, extra)
        self.used_weights = self._used_weights(prefix, cells)
        if plan is not None:
            out.update(plan.metrics())
        out.update({"train_cells": float(len(cells)), "join_cells": float(len(source["to"])),
                    "join_s": join_s, "join_source": source["kind"], "joined_checksum": float(joined),
                    "train_wall_s": time.perf_counter() - t0})
        return out

    def _assign(self, prefix: str, cells: list[str], attempt: int, work: dict) -> None:
        shares = work.pop("shares", None)
        spec = {"cells": cells, "tag": self.tag, "hyper": self.hyper, "lr": self.lr, "timeout_s": self.timeout_s,
                "connect_timeout_s": self.ack_timeout_s + self.timeout_s, "commit_timeout_s": self.step_timeout_s,
                "start": self.start, **work}
        set_json(self.store, f"{prefix}/spec", spec)
        for r, share in enumerate(shares or [], start=1):
            set_json(self.store, f"{prefix}/share/{r}", share)
        for c in cells:
            set_json(self.store, P.assign_key(c), {"run": self.run, "step": self.num_steps, "attempt": attempt})

    def _acks(self, prefix: str, cells: list[str]) -> dict[int, dict]:
        keys = [f"{prefix}/ack/{r}" for r in range(1, len(cells) + 1)]
        present = set(wait_keys(self.store, keys, self.ack_timeout_s))
        lost = [c for c, k in zip(cells, keys) if k not in present]
        if lost:
            raise StepFailed(f"no ack from {lost} within {self.ack_timeout_s}s", lost)
        acks = {r: get_json(self.store, k) for r, k in enumerate(keys, start=1)}
        refused = {cells[r - 1]: a["refused"] for r, a in acks.items() if a.get("refused")}
        if refused:  # a cell whose configuration refuses the step: the next attempt goes without it
            raise StepFailed(f"refused by {refused}", list(refused))
        return acks

    def _source(self, prefix: str, acks: dict[int, dict], peers: list[str]) -> dict[str, Any]:
        """Where the ranks whose state is stale get the committed one: a rank of the step that
        holds it, else a peer cell that holds it (fetched by the first stale rank, which then
        serves the others), else the newest checkpoint; with nothing committed yet, each
        builds the start state."""
        stale = [r for r, a in acks.items() if self.tag is None or a.get("tag") != self.tag]
        holders = [r for r in acks if r not in stale]
        if not stale:
            src: dict[str, Any] = {"kind": "none"}
        elif self.tag is None:
            src = {"kind": "build"}
        elif holders:
            src = {"kind": "rank", "rank": holders[0]}
        else:
            src = self._outside_source(peers, stale[0])
        src["to"] = stale
        set_json(self.store, f"{prefix}/source", src)
        return src

    def _outside_source(self, peers: list[str], first: int) -> dict[str, Any]:
        for c in dict.fromkeys(self.holders + list(peers)):
            if P.holds(self.store, c, self.tag) and self._answers(c):
                return {"kind": "peer", "cell": c, "rank": first}
        self._await_writing()
        if self.checkpoint_path is not None:
            return {"kind": "checkpoint", "path": self.checkpoint_path}
        raise StateLost(f"no cell holds the committed state {self.tag} (version {self.version}) and no "
                        "checkpoint was written: restart from a checkpoint directory")

    def _answers(self, cell: str) -> bool:
        """Whether `cell` is alive and still holds the committed state (its announcement may
        outlive it). Given as long as a rank's ack: a live holder on a loaded host answers
        late, and taking its silence for death would fail the step (no other source)."""
        r = jobs.wait(self.store, jobs.post(self.store, cell, {"op": "ping"}), self.ack_timeout_s)
        return bool(r.get("ok")) and r.get("tag") == self.tag

    def _check_joined(self, prefix: str, cells: list[str], source: dict) -> int:
        """Every rank holds the same parameters, the committed ones (their checksum), before
        it computes: a joiner rebuilt exactly what its source holds."""
        keys = [f"{prefix}/joined/{r}" for r in range(1, len(cells) + 1)]
        # a join is CPU work on the joiner besides its transfers: a longer bound
        bound = self.ack_timeout_s + self.timeout_s * (2 if source["to"] else 1)
        if not self._wait_all(keys, self._abort_keys(prefix, cells), bound):
            raise StepFailed("a rank did not confirm the state", self._failed(prefix, cells))
        sums = {r: int(get_json(self.store, k)["checksum"]) for r, k in enumerate(keys, start=1)}
        want = int(self.commit["checksum"]) if self.commit is not None else sums[1]
        bad = [cells[r - 1] for r, s in sums.items() if s != want]
        if bad:
            raise StepFailed(f"{bad} joined with parameters other than the committed ones", bad)
        return want

    def _abort_keys(self, prefix: str, cells: list[str]) -> list[str]:
        return [f"{prefix}/failed/{r}" for r in range(1, len(cells) + 1)]

    def _wait_all(self, keys: list[str], abort: list[str], timeout_s: float) -> bool:
        """Whether every key of `keys` appeared before any of `abort` did, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.store.check(keys):
                return True
            if any(self.store.check([k]) for k in abort):
                return False
            time.sleep(0.02)
        return self.store.check(keys)

    def _result(self, prefix: str, cells: list[str]) -> dict:
        keys = [f"{prefix}/result"] + self._abort_keys(prefix, cells)
        deadline, got, seen = time.monotonic() + self.step_timeout_s, None, None
        beats = Heartbeats(self.store, cells, self.timeout_s)
        while got is None and time.monotonic() < deadline:
            got = wait_any(self.store, keys, 1.0)
            if got is None and (silent := beats.silent()):
                raise StepFailed(f"{silent} stopped beating for {self.timeout_s}s mid-step", silent)
            progress = self._progress and self.store.check([f"{prefix}/progress"])
            if progress and (p := get_json(self.store, f"{prefix}/progress")) != seen:
                seen = p
                self._progress(p)
        if got != f"{prefix}/result":
            raise StepFailed(f"step failed on the cells ({got or 'timed out'})", self._failed(prefix, cells))
        return get_json(self.store, got)

    def _check_ranks(self, prefix: str, cells: list[str], checksum: int) -> None:
        """Every rank ended with the parameters rank 1 reported (none holds another update)."""
        keys = [f"{prefix}/done/{r}" for r in range(1, len(cells) + 1)]
        present = wait_keys(self.store, keys, self.timeout_s)
        if len(present) < len(keys):
            raise StepFailed("not every rank finished the update", self._failed(prefix, cells))
        bad = [c for c, k in zip(cells, keys) if int(get_json(self.store, k)["checksum"]) != checksum]
        if bad:
            raise StepFailed(f"ranks {bad} ended with other parameters", bad)

    def _used_weights(self, prefix: str, cells: list[str]) -> dict[str, str]:
        """Session id → the per-token weights the update used (each rank's share, written
        before its `done`: cells/rl/used_weights.py); a rank that wrote none adds nothing."""
        out: dict[str, str] = {}
        for r in range(1, len(cells) + 1):
            if self.store.check([f"{prefix}/weights/{r}"]):
                out.update(get_json(self.store, f"{prefix}/weights/{r}"))
        return out

    def _failed(self, prefix: str, cells: list[str]) -> list[str]:
        """Cells that report neither success nor failure within an op timeout: dead or
        stalled. The others failed because of them (a collective with a dead peer fails
        everywhere, one op timeout later at most) and may take part in the next attempt."""
        keys = {c: (f"{prefix}/done/{r}", f"{prefix}/failed/{r}") for r, c in enumerate(cells, start=1)}
        deadline = time.monotonic() + self.timeout_s + 2.0
        while True:
            silent = [c for c, ks in keys.items() if not any(self.store.check([k]) for k in ks)]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.05)

    def _commit(self, prefix: str, result: dict, next_version, cells: list[str], cursor, extra) -> dict[str, Any]:
        failpoint("training.before_commit")  # the coordinator dying with the cells' update in hand
        m = result["metrics"]
        version = self.version if m.get("update_rejected") else next_version()  # rejected: no new version
        commit = {"tag": f"{self.run}:{self.num_steps}:{version}", "version": version,
                  "step": int(m.get("optimizer_step", 0)), "checksum": int(result["checksum"]),
                  "tensors": result["tensors"], "cursor": cursor if cursor is not None else
                  (self.commit or {}).get("cursor", 0),
                  "extra": dict((extra(not m.get("update_rejected")) if callable(extra) else extra) or {})}
        set_json(self.store, f"{prefix}/commit", commit)
        self.commit, self.holders = commit, list(cells)
        out = dict(m)
        out.update({"version": float(version), "checksum": float(commit["checksum"])})
        return out

    # -- the committed state's other uses ---------------------------------------------------
    def checkpoint(self, path: str) -> str:
        """Ask a cell holding the committed state to write it to `path` (safetensors plus a JSON
        manifest, off its step); returns the job id `checkpoint_done` waits for."""
        if self.commit is None or not self.holders:
            raise StateLost("nothing committed to checkpoint")
        jid = jobs.post(self.store, self.holders[0], {"op": "checkpoint", "path": path, "commit": self.commit})
        self._writing = (jid, path, self.tag)
        return jid

    def _await_writing(self) -> None:
        """No cell answers for the committed state (its holders left: a cell moved to another RL
        job follows that job's store): the checkpoint of it posted after its commit, which the
        trainer registers only at its next checkpoint, is its home once written."""
        if self._writing is not None and self._writing[2] == self.tag:
            jid, path, _ = self._writing
            self.checkpoint_done(jid, path, self.ack_timeout_s + self.timeout_s)

    def checkpoint_done(self, job: str, path: str, timeout_s: float = 600.0) -> dict:
        """Wait for a checkpoint job; on success it becomes the state's fallback home."""
        r = jobs.wait(self.store, job, timeout_s)
        if r.get("ok"):
            self.checkpoint_path = path
        return r

    def publisher(self) -> str:
        """The cell that publishes the committed version (one that computed it)."""
        if not self.holders:
            raise StateLost("no cell holds the committed version")
        return self.holders[0]

