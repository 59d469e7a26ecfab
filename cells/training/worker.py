"""The training rank on a cell: while the cell is in the training role, take the coordinator's
step assignments and compute them with the other training cells.

One attempt, one line: read spec and share → ack with the held state's tag → join `all` and
`dp` → receive the state if the tag is stale → `run_update` over `dp` → rank 1 sends the new
state back → wait for commit (keep it, as version v with its checksum) or abort (drop it).

A cell never keeps a half-applied update: the state is updated in place only inside the
attempt, and any failure (a peer died, a stall past the op timeout, an abort, the
coordinator gone) drops the whole state; the next attempt sends it afresh from the
coordinator's host copy, into the learner the rank prepared while it waited in the training
role (`prepare`). After a commit the cell holds the published version's weights, so
its `loading` back to rollout installs them locally (`weights_for`), fetching nothing. Where
the engine does not take the memory back (host memory) the state stays allocated through the
rollout stint (`keep_memory`): the next join writes into warm tensors, or sends nothing when
no step ran meanwhile.
A bare rank without an engine (tests, benches): `python -m cells.training.bare`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

from cells.rl import guard
from cells.rl.plan import Share
from cells.rl.reduce import GroupReducer, LocalReducer
from cells.rl.update import run_update
from cells.training import protocol as P
from cells.training.wire import (
    pack,
    packed_checksum,
    recv_state,
    send_state,
    unpack,
    weights_checksum,
)
from cells.transport.p2p import TransferError, discard, join_group
from cells.transport.store import StoreAddress, connect, get_json, set_json, wait_any, wait_json

log = logging.getLogger("cellflip.training")

POLL_S = 0.05


def _import_learner() -> None:
    import cells.rl.learner  # noqa: F401


class TrainingWorker:
    """Owned by the cell agent (or run bare). `active` gates taking assignments (the cell's
    role is training); `source` is the coordinator's store address."""

    def __init__(self, cell_id: str, *, device: str = "cpu", keep_memory: bool = True,
                 local_loss: str | None = None) -> None:
        self.cell_id, self.device = cell_id, torch.device(device)
        self.local_loss = local_loss
        """The custom loss of this cell's own configuration (`trainer.objective.loss`): the only
        one it imports; a step whose coordinator names another fails with the reason."""
        self.keep_memory = keep_memory
        """Whether the training state stays allocated while the cell serves rollouts: yes where
        the engine does not take the memory back (host memory, the embedded engine), so the
        next stint joins into warm tensors (or, if no step ran meanwhile, needs nothing); no
        where it does (SGLang's GPU memory, `role_handover`)."""
        self.source: StoreAddress | None = None
        self.active = threading.Event()
        self.learner: Any = None
        self.tag: str | None = None
        """Which coordinator state the learner holds (None: nothing trusted)."""
        self.committed: dict[str, Any] | None = None
        """{"version", "checksum"} of the last committed update this cell computed."""
        self.hyper: dict[str, Any] | None = None
        """The hyper-parameters the learner was built with."""
        self._rx: tuple[torch.Tensor, torch.Tensor] | None = None
        """Warm receive buffers for a joining state (values, rows); a prepared learner's
        parameters live at the front of the values buffer."""
        self._zeroed = False
        """The learner's moments are all zero (prepared, never written since)."""
        self._tx: torch.Tensor | None = None
        """Warm buffer rank 1 packs each step's result into."""
        self._weights: dict[str, torch.Tensor] | None = None
        """The committed parameters, kept when the cell left training (the rest went)."""
        self._lock = threading.Lock()
        """Guards `leave` against a learner `prepare` installs at the same time."""
        self.num_attempts = self.num_failed = 0
        self._last: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="training", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def enter(self) -> None:
        """The cell is in the training role: take assignments from the next step boundary.
        The learner's modules load now, off the first join's critical path."""
        self.active.set()
        threading.Thread(target=_import_learner, name="training-imports", daemon=True).start()

    def leave(self) -> None:
        """Back to rollout: no more assignments. With `keep_memory` the whole state stays, under
        its tag (nothing changes it out of the role); otherwise it goes, all of it (moments,
        copies, buffers) but the committed parameters, which stay reachable through
        `weights_for` until the version is installed."""
        with self._lock:
            self.active.clear()
            if self.keep_memory:
                return
            learner, committed = self.learner, self.committed
            self.drop()
            if learner is not None and committed is not None:
                self.committed = committed
                self._weights = {k: p.detach() for k, p in learner.params.items()}

    def weights_for(self, version: int) -> dict[str, torch.Tensor] | None:
        """The committed weights of `version` if this cell computed them, verified against the
        checksum the coordinator committed; None otherwise (fetch it). Called from a loader
        thread, after the cell left training (its own parameters, handed over once) or while
        its learner holds them (a copy: it trains on, or keeps its memory)."""
        with self._lock:  # a join overwriting the learner waits for the copy (`_receive_state`)
            c, left, learner = self.committed, self._weights, self.learner
            if c is None or c["version"] != version or (left is None and learner is None):
                return None
            self._weights = None
            weights = left if left is not None else {k: p.detach().clone() for k, p in learner.params.items()}
        if weights_checksum(weights) != c["checksum"]:
            log.warning("version %d: local weights fail the committed checksum; fetching", version)
            return None
        return weights

    def drop(self) -> None:
        """Forget everything (after the weights were installed, or on a failure)."""
        self.learner, self.tag, self.committed, self.hyper, self._rx, self._tx = None, None, None, None, None, None
        self._zeroed, self._weights = False, None

    def prepare(self, store) -> bool:
        """In the training role and holding nothing: build the learner the next join fills
        (every tensor of the state allocated and touched) and warm receive buffers, so the
        join writes into memory that exists instead of materialising five model copies on
        the step's critical path. True when it built one."""
        if self.learner is not None or not store.check([P.SKELETON_KEY]):
            return False
        sk = get_json(store, P.SKELETON_KEY)
        t0 = time.perf_counter()
        n = sum(math.prod(s) for _, s in sk["params"])
        rows = sum(s[0] for _, s in sk["params"] if len(s) == 2)
        # the parameters live at the front of the receive buffer: a joining state's arrive in place
        rx = (torch.zeros(2 * n, dtype=torch.float32), torch.zeros(2 * rows, dtype=torch.long))
        try:
            learner = P.build_skeleton(sk, param_storage=rx[0], local_loss=self.local_loss)
        except ValueError as e:  # the step itself fails with the reason (`_receive_state`)
            log.warning("cell %s: no skeleton prepared: %s", self.cell_id, e)
            return False
        if learner.objective.max_update_kl is not None:
            guard.take(learner)  # the update's snapshot will copy into these (warm) tensors
        with self._lock:
            if not self.active.is_set() or self.learner is not None:
                return False  # left meanwhile, or something arrived
            self.learner, self.hyper, self._rx, self.tag, self._zeroed = learner, sk["hyper"], rx, None, True
        set_json(store, P.prepared_key(self.cell_id), {"t": time.time(), "s": time.perf_counter() - t0})
        log.info("cell %s: learner prepared in %.2fs", self.cell_id, time.perf_counter() - t0)
        return True

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        store = None
        while not self._stop.is_set():
            if not self.active.is_set() or self.source is None:
                store = None
                time.sleep(POLL_S)
                continue
            try:
                if store is None:
                    store = connect(self.source, timeout_s=10.0)
                    set_json(store, P.alive_key(self.cell_id), {"t": time.time()})
                a = wait_json(store, P.assign_key(self.cell_id), POLL_S)
            except Exception as e:  # coordinator restarting: try again shortly
                log.debug("training store unreachable: %s", e)
                store = None
                time.sleep(0.5)
                continue
            key = None if a is None else (a["run"], a["step"], a["attempt"])
            if a is None or key == self._last or not self.active.is_set():
                try:
                    if not self.prepare(store):
                        time.sleep(POLL_S)
                except Exception:
                    log.exception("cell %s: preparing a learner failed", self.cell_id)
                    time.sleep(POLL_S)
                continue
            self._last = key
            try:
                self.run_attempt(store, a)
            except Exception:  # never let the rank die: the next assignment must find it
                log.exception("cell %s: training attempt crashed", self.cell_id)
                self.drop()

    def run_attempt(self, store, a: dict[str, Any]) -> bool:
        """One attempt of one step; True when it was committed."""
        self.num_attempts += 1
        prefix = P.attempt_prefix(a["step"], a["attempt"], a["run"])
        groups: list = []
        try:
            ok = self._attempt(store, prefix, groups)
        except (TransferError, RuntimeError, OSError, ValueError, KeyError) as e:
            log.warning("cell %s: training step %s attempt %s failed: %s", self.cell_id, a["step"], a["attempt"], e)
            ok = False
        for g in groups:
            discard(g, [], broken=not ok)
        groups.clear()  # the reaper drops the last reference (its destructor blocks)
        if not ok:
            self.num_failed += 1
            self.drop()
        return ok

    def _attempt(self, store, prefix: str, groups: list) -> bool:
        spec = wait_json(store, f"{prefix}/spec", 10.0)
        if spec is None or self.cell_id not in spec["cells"]:
            return False
        if store.check([f"{prefix}/commit"]) or store.check([f"{prefix}/abort"]):
            return False  # an attempt that ended before this rank (re)started
        rank, n = spec["cells"].index(self.cell_id) + 1, len(spec["cells"])
        try:  # a loss this cell's configuration does not name is refused before anything joins
            P.local_objective(spec["hyper"], self.local_loss)
        except ValueError as e:
            log.warning("cell %s: refusing training step: %s", self.cell_id, e)
            set_json(store, f"{prefix}/ack/{rank}", {"tag": self.tag, "refused": str(e)[:300]})
            return False
        share = Share.from_json(wait_json(store, f"{prefix}/share/{rank}", 10.0))
        timeout, connect_s = float(spec["timeout_s"]), float(spec["connect_timeout_s"])
        set_json(store, f"{prefix}/ack/{rank}", {"tag": self.tag})
        try:
            # all ranks join `all` before `dp`: the coordinator waits in `all` for everyone
            groups.append(join_group(store, f"{prefix}/all/", rank, n + 1, timeout_s=timeout,
                                     connect_timeout_s=connect_s, device=torch.device("cpu"),
                                     abort_key=f"{prefix}/abort"))
            if n > 1:
                groups.append(join_group(store, f"{prefix}/dp/", rank - 1, n, timeout_s=timeout,
                                         connect_timeout_s=connect_s, device=self.device,
                                         abort_key=f"{prefix}/abort"))
            if self.tag != spec["tag"] or self.learner is None:
                crc = self._receive_state(store, prefix, spec, groups[0], timeout)
                set_json(store, f"{prefix}/joined/{rank}", {"state_checksum": crc})
            reducer = GroupReducer(groups[1], n, timeout) if n > 1 else LocalReducer()
            t0 = time.perf_counter()
            metrics = run_update(self.learner, share, reducer)
            t1 = time.perf_counter()
            crc = weights_checksum({k: p.detach() for k, p in self.learner.params.items()})
            t2 = t3 = time.perf_counter()
            if rank == 1:
                meta, flat, idx = pack(self.learner, reference=False, out=self._tx)
                self._tx = flat if self._tx is None or flat.numel() > self._tx.numel() else self._tx
                t3 = time.perf_counter()
                set_json(store, f"{prefix}/result", {"metrics": metrics, "state": meta, "checksum": crc})
                send_state(groups[0], 0, flat, idx, timeout, tag=P.RESULT_TAG)
            set_json(store, f"{prefix}/done/{rank}", {"checksum": crc})
            log.info("cell %s rank %d: update %.2fs, checksum %.2fs, pack %.2fs, send %.2fs", self.cell_id, rank,
                     t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        except Exception as e:
            set_json(store, f"{prefix}/failed/{rank}", {"reason": str(e)[:300]})
            raise
        return self._settle(store, prefix, float(spec["commit_timeout_s"]))

    def _receive_state(self, store, prefix: str, spec: dict, group, timeout: float) -> int:
        """The coordinator's state, rebuilt here (in place into a learner of the same
        hyper-parameters when one is held: prepared, or a stale state); returns the checksum
        of what arrived."""
        t0 = time.perf_counter()
        meta = wait_json(store, f"{prefix}/state", timeout)
        if meta is None:
            raise TransferError("no state manifest from the coordinator")
        t1 = time.perf_counter()
        with self._lock:
            self.committed = None  # whatever this learner held is overwritten now (after any copy)
        flat, idx = recv_state(group, 0, meta, timeout, into=self._rx)
        t2 = time.perf_counter()
        warm = self.learner is not None and self.hyper is not None and P.same_learner(self.hyper, spec["hyper"])
        if not warm:
            self.learner = P.build_learner(spec["hyper"], meta, flat, param_storage=flat,
                                           local_loss=self.local_loss)
            self.hyper = spec["hyper"]
        t3 = time.perf_counter()
        unpack(self.learner, meta, flat, idx, held="warm" if warm else "fresh", zero_moments=warm and self._zeroed)
        self._zeroed = False
        t4 = time.perf_counter()
        crc = packed_checksum(meta, flat, idx)
        if not warm:  # the learner's parameters live at the front of `flat`: the next join's buffers
            self._rx = (flat, idx)
        log.info("cell %s: state of %.0f MB (%s): manifest after %.2fs, bytes %.2fs, build %.2fs, unpack %.2fs, "
                 "checksum %.2fs", self.cell_id, (flat.numel() * 4 + idx.numel() * 8) / 1e6,
                 "in place" if warm else "built", t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4)
        return crc

    def _settle(self, store, prefix: str, timeout: float) -> bool:
        """Keep the update only once the coordinator committed it. A newer assignment (the
        coordinator restarted, or moved on) or its silence past `timeout` drops it."""
        mine = self._last
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            end = wait_any(store, [f"{prefix}/commit", f"{prefix}/abort"], 0.5)
            if end == f"{prefix}/abort":
                return False
            if end is not None:
                break
            a = wait_json(store, P.assign_key(self.cell_id), 0.0)
            if a is not None and (a["run"], a["step"], a["attempt"]) != mine:
                log.warning("cell %s: a newer assignment before this step's commit: dropping it", self.cell_id)
                return False
        else:
            return False
        c = get_json(store, end)
        self.tag = c["tag"]
        self.learner.version = int(c["version"])
        self.committed = {"version": int(c["version"]), "checksum": int(c["checksum"])}
        return True
