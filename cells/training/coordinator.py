"""The trainer side of a training step: the coordinator assigns, the training cells compute.

One step, one line: plan (advantages, minibatches, token shares) → assign each training cell
→ acks (who is alive, which state each holds) → rendezvous `all` → send the host state to
the cells whose state is stale → wait for the result → receive the new state from rank 1,
check every rank's checksum → install it in the host copy → commit (version v, checksum).

The host copy (the coordinator's `Learner`) stays authoritative: it changes only when a
whole update came back and every rank reported the same parameters. Any failure (a cell
dead or stalled mid-step, a timeout, a checksum mismatch) aborts the attempt -- the cells
drop what they computed -- and the step is redone from the unchanged host copy with the
cells that still answer, counted in `attempts` and logged. With no cell left, the step runs
here (`coordinator_fallback`), so training never stops for want of cells.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cells.rl.plan import plan_update
from cells.training import protocol as P
from cells.training.wire import (
    pack,
    packed_checksum,
    params_view,
    recv_state,
    send_state,
    unpack,
    weights_checksum,
    with_reference,
)
from cells.transport.p2p import TransferError, discard, join_group
from cells.transport.store import StoreAddress, connect, get_json, set_json, wait_any, wait_keys
from scheduler.contract.failpoints import failpoint

log = logging.getLogger("cellflip.training")


class StepFailed(RuntimeError):
    def __init__(self, reason: str, lost: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.lost = list(lost)


class TrainingCoordinator:
    """Drives the training cells' steps for the host learner. `address`: the rendezvous
    store the cells know (the version host's)."""

    def __init__(self, learner: Any, address: StoreAddress, *, timeout_s: float = 30.0,
                 ack_timeout_s: float = 10.0, step_timeout_s: float = 600.0, max_attempts: int = 3,
                 emit: Callable[[dict], None] | None = None) -> None:
        self.learner, self.address = learner, address
        self.timeout_s, self.ack_timeout_s = timeout_s, ack_timeout_s
        self.step_timeout_s, self.max_attempts = step_timeout_s, max_attempts
        self.emit = emit or (lambda rec: log.info("%s", rec))
        self.store = connect(address, timeout_s=timeout_s)
        self.run = uuid.uuid4().hex[:8]
        """This coordinator's incarnation: a restarted one never matches a cell's old state."""
        self.num_steps = 0
        set_json(self.store, P.SKELETON_KEY, P.skeleton(learner))  # training cells pre-build from it
        self._packed: dict[str, Any] | None = None
        """The host state packed for joiners, under the tag it was packed at."""
        self._packer: threading.Thread | None = None
        self._spare: tuple | None = None
        """Buffers a step's result is received into: the previous result's, once the pack
        ahead no longer holds them (never the current one's: a failed attempt needs it), or
        ones the pack ahead allocated and touched when those are too small (the first steps)."""

    @property
    def tag(self) -> str:
        """Names the host state: the incarnation and its optimizer step."""
        return f"{self.run}:{self.learner.step}:{self.learner.version}"

    def update(self, trajectories: Sequence[dict], cells: Sequence[str], *,
               next_version: Callable[[], int], shares: Sequence[float] | None = None,
               cursor: int | None = None, staleness_bound: int | None = None) -> dict[str, Any]:
        """One RL update on `cells` (redone without the cells that fail); the host learner
        then holds it as version `next_version()`. Returns the update's metrics."""
        self.num_steps += 1
        try:
            return self._update(trajectories, list(cells), next_version, shares, cursor, staleness_bound)
        finally:
            for c in cells:  # a cell restarting later must not take this step up again
                self.store.delete_key(P.assign_key(c))

    def _update(self, trajectories: Sequence[dict], cells: list[str], next_version: Callable[[], int],
                shares: Sequence[float] | None, cursor: int | None, staleness_bound: int | None) -> dict[str, Any]:
        lost, attempts = [], 0
        while cells and attempts < self.max_attempts:
            attempts += 1
            try:
                out = self._attempt(trajectories, cells, attempts, next_version, shares, staleness_bound)
            except StepFailed as e:
                lost += e.lost
                self.emit({"event": "train_attempt_failed", "step": self.num_steps, "attempt": attempts,
                           "cells": cells, "reason": str(e)[:300], "lost": e.lost})
                cells = [c for c in cells if c not in e.lost]
                shares = None
                continue
            out.update({"attempts": float(attempts), "cells_lost": float(len(lost)), "coordinator_fallback": 0.0})
            if cursor is not None:
                self.learner.cursor = cursor
            return out
        self.emit({"event": "coordinator_fallback", "step": self.num_steps, "lost": lost})
        self._wait_packer()  # the packer reads the host state: it finishes before that changes
        metrics = self.learner.rl_step(trajectories, cursor=cursor, staleness_bound=staleness_bound)
        if not metrics.get("update_rejected"):
            self.learner.version = next_version()
        metrics.update({"attempts": float(attempts), "cells_lost": float(len(lost)),
                        "coordinator_fallback": 1.0, "train_cells": 0.0})
        return metrics

    def _attempt(self, trajectories: Sequence[dict], cells: list[str], attempt: int,
                 next_version: Callable[[], int], shares: Sequence[float] | None,
                 staleness_bound: int | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        plan = plan_update(trajectories, self.learner.objective, self.learner.minibatches,
                           list(shares) if shares else [1.0] * len(cells), version=self.learner.version,
                           staleness_bound=staleness_bound)
        prefix = P.attempt_prefix(self.num_steps, attempt, self.run)
        self._cells = cells
        t_assign = time.perf_counter()
        self._assign(prefix, cells, plan, attempt)
        acks = self._acks(prefix, cells)
        group = None
        try:
            group = self._join(prefix, len(cells))
            stale = [r for r, a in acks.items() if a.get("tag") != self.tag]
            sent = self._send_state(prefix, group, stale)
            self._check_joined(prefix, stale, sent)
            # what the step waited for its joiners: from the assignment (a cell still preparing
            # its learner acks late) until each confirmed the whole state
            join_s = time.perf_counter() - t_assign if stale else 0.0
            t_join = time.perf_counter()
            result, flat, idx = self._result(prefix, cells, group)
            t_result = time.perf_counter()
            self._check_ranks(prefix, cells, result["checksum"])
            out = self._commit(prefix, result, flat, idx, next_version, plan, len(cells), len(stale),
                               join_s, time.perf_counter() - t0)
            log.info("step %d attempt %d on %d cells: plan %.2fs, acks and groups %.2fs, compute and result "
                     "%.2fs (update %.2fs on rank 1), checks and commit %.2fs", self.num_steps, attempt, len(cells),
                     t_assign - t0, t_join - t_assign, t_result - t_join, result["metrics"]["step_s"],
                     time.perf_counter() - t_result)
        except (TransferError, StepFailed, RuntimeError) as e:
            set_json(self.store, f"{prefix}/abort", {"reason": str(e)[:300]})
            if group is not None:
                discard(group, [], broken=True)
                group = None  # the raised frame would keep it: the reaper drops the last one
            raise e if isinstance(e, StepFailed) else StepFailed(str(e), self._failed(prefix, cells)) from e
        discard(group, [], broken=False)
        return out

    def _assign(self, prefix: str, cells: list[str], plan, attempt: int) -> None:
        spec = {"cells": cells, "tag": self.tag, "hyper": P.hyper(self.learner), "timeout_s": self.timeout_s,
                "connect_timeout_s": self.ack_timeout_s + self.timeout_s,
                "commit_timeout_s": self.step_timeout_s}
        set_json(self.store, f"{prefix}/spec", spec)
        for r, share in enumerate(plan.shares, start=1):
            set_json(self.store, f"{prefix}/share/{r}", share.to_json())
        for c in cells:
            set_json(self.store, P.assign_key(c), {"run": self.run, "step": self.num_steps, "attempt": attempt})

    def _acks(self, prefix: str, cells: list[str]) -> dict[int, dict]:
        keys = [f"{prefix}/ack/{r}" for r in range(1, len(cells) + 1)]
        present = set(wait_keys(self.store, keys, self.ack_timeout_s))
        lost = [c for c, k in zip(cells, keys) if k not in present]
        if lost:
            set_json(self.store, f"{prefix}/abort", {"reason": "no ack"})
            raise StepFailed(f"no ack from {lost} within {self.ack_timeout_s}s", lost)
        acks = {r: get_json(self.store, k) for r, k in enumerate(keys, start=1)}
        refused = {cells[r - 1]: a["refused"] for r, a in acks.items() if a.get("refused")}
        if refused:  # a cell whose configuration refuses the step: the next attempt goes without it
            set_json(self.store, f"{prefix}/abort", {"reason": "refused"})
            raise StepFailed(f"refused by {refused}", list(refused))
        return acks

    def _join(self, prefix: str, n: int):
        return join_group(self.store, f"{prefix}/all/", 0, n + 1, timeout_s=self.timeout_s,
                          connect_timeout_s=self.ack_timeout_s + self.timeout_s, device=torch.device("cpu"))

    def _send_state(self, prefix: str, group, ranks: list[int]) -> int | None:
        """The host state to the joining ranks, one after another (each is a full copy);
        returns the checksum of what was sent."""
        if not ranks:
            return None
        t0 = time.perf_counter()
        packed = self._packed_state()
        set_json(self.store, f"{prefix}/state", packed["meta"])
        t1 = time.perf_counter()
        for r in ranks:
            send_state(group, r, packed["values"], packed["rows"], self.timeout_s)
        log.info("state to ranks %s: pack %.2fs (%s), send %.2fs", ranks, t1 - t0, packed["how"],
                 time.perf_counter() - t1)
        return packed["checksum"]

    def _packed_state(self) -> dict[str, Any]:
        """The host state as a joiner receives it: packed ahead at the last commit (from the
        result the cells returned, plus the reference), or now when that is not the current
        state (the first join, after a fallback step)."""
        self._wait_packer()
        p = self._packed
        if p is None or p["tag"] != self.tag or p["meta"]["lr"] != self.learner.lr:
            meta, flat, idx = pack(self.learner)
            p = self._packed = {"tag": self.tag, "meta": meta, "values": [flat], "rows": [idx],
                                "checksum": packed_checksum(meta, flat, idx), "how": "now"}
        return p

    def _wait_packer(self) -> None:
        if self._packer is not None:
            self._packer.join()
            self._packer = None

    def _pack_ahead(self, meta: dict[str, Any], flat, idx) -> None:
        """After a commit, off the next join's path: the result just installed is the host
        state without its reference (bitwise what `pack` gives), so a joiner's state is that
        plus the reference's rows, packed and checksummed in the background. Nothing else
        changes the host learner between commits (the fallback and the next commit wait)."""
        tag = self.tag

        def work() -> None:
            # at the lowest priority: the version just committed is broadcast from this
            # process now, and the cells decode; this only has to be ready by the next join
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                full, values, rows = with_reference(self.learner, meta, flat, idx)
                self._packed = {"tag": tag, "meta": full, "values": values, "rows": rows,
                                "checksum": packed_checksum(full, values, rows), "how": "ahead"}
                if short:  # the next result must not land in memory first touched on the step's path
                    self._spare = (torch.zeros(int(flat.numel() * 1.1)),
                                   torch.zeros(int(idx.numel() * 1.1) + 1024, dtype=torch.long))
            except Exception:  # the next join packs it then (`_packed_state`)
                log.exception("packing the state ahead failed")

        old, self._packed = self._packed, None
        if old is not None and old["values"][0].data_ptr() != flat.data_ptr():
            self._spare = (old["values"][0], old["rows"][0])
        spare = self._spare  # too small for a result like this one (the first ones): a warm one, ahead
        short = spare is None or spare[0].numel() < flat.numel() or spare[1].numel() < idx.numel()
        # not a daemon: torch code still running while the interpreter exits aborts the process
        self._packer = threading.Thread(target=work, name="pack-ahead", daemon=False)
        self._packer.start()

    def _check_joined(self, prefix: str, ranks: list[int], mine: int | None) -> None:
        """Each joining rank rebuilt the state from exactly what was sent (its checksum)."""
        if not ranks:
            return
        keys = [f"{prefix}/joined/{r}" for r in ranks]
        # rebuilding the state is CPU work on the joiner, not one transfer op: a longer bound
        if len(wait_keys(self.store, keys, self.ack_timeout_s + self.timeout_s)) < len(keys):
            raise StepFailed("a joining rank did not confirm the state", self._failed(prefix, self._cells))
        bad = [r for r, k in zip(ranks, keys) if int(get_json(self.store, k)["state_checksum"]) != mine]
        if bad:
            raise StepFailed(f"ranks {bad} rebuilt another state")

    def _result(self, prefix: str, cells: list[str], group) -> tuple[dict, Any, Any]:
        keys = [f"{prefix}/result"] + [f"{prefix}/failed/{r}" for r in range(1, len(cells) + 1)]
        got = wait_any(self.store, keys, self.step_timeout_s)
        if got != f"{prefix}/result":
            raise StepFailed(f"step failed on the cells ({got or 'timed out'})", self._failed(prefix, cells))
        result = get_json(self.store, got)
        flat, idx = recv_state(group, 1, result["state"], self.timeout_s, tag=P.RESULT_TAG, into=self._spare)
        return result, flat, idx

    def _check_ranks(self, prefix: str, cells: list[str], checksum: int) -> None:
        """Every rank ended with the parameters rank 1 sent (none holds another update)."""
        keys = [f"{prefix}/done/{r}" for r in range(1, len(cells) + 1)]
        present = wait_keys(self.store, keys, self.timeout_s)
        if len(present) < len(keys):
            raise StepFailed("not every rank finished the update", self._failed(prefix, cells))
        bad = [c for c, k in zip(cells, keys) if int(get_json(self.store, k)["checksum"]) != checksum]
        if bad:
            raise StepFailed(f"ranks {bad} ended with other parameters", bad)

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

    def _commit(self, prefix: str, result: dict, flat, idx, next_version: Callable[[], int], plan,
                n: int, joined: int, join_s: float, wall_s: float) -> dict[str, Any]:
        crc = weights_checksum(params_view(result["state"], flat))
        if crc != int(result["checksum"]):  # checked before the host copy changes
            raise StepFailed("the returned state does not match its checksum")
        failpoint("training.before_commit")  # the coordinator dying with the cells' update in hand
        self._wait_packer()  # a packer still reading the host state finishes first
        unpack(self.learner, result["state"], flat, idx, held="warm")  # into the host tensors, in place
        if not result["metrics"].get("update_rejected"):  # a rejected update keeps the version it started at
            self.learner.version = next_version()
        set_json(self.store, f"{prefix}/commit", {"tag": self.tag, "version": self.learner.version,
                                                  "checksum": crc})
        self._pack_ahead({**result["state"], "version": self.learner.version}, flat, idx)
        metrics = dict(result["metrics"])
        metrics.update(plan.metrics())
        metrics.update({"version": float(self.learner.version), "train_cells": float(n),
                        "join_cells": float(joined), "join_s": join_s, "train_wall_s": wall_s,
                        "checksum": float(crc)})
        return metrics
