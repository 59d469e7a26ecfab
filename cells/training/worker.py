"""The training rank on a cell: while the cell is in the training role, take the coordinator's
step assignments and compute them with the other training cells; in either role, hold the
committed training state and serve it (cells/training/holder.py).

One attempt, one line: read spec and share → ack with the held state's tag → the source →
join `dp` → take the state if the tag is stale (cells/training/join.py) → report its checksum
→ snapshot → `run_update` over `dp` → report the checksums → commit (keep it under the new
tag) or abort (restore the snapshot: the state it started from, still committed).

The committed state lives here, not in the trainer: after a commit every rank of the step
holds it; when the cell flips back to rollout the state stays parked in host memory — the
learner itself where its memory is host memory (`keep_memory`), else packed into host buffers
(`park`) while the engine takes the accelerator back. A rank whose update failed part way
restores the start-of-update snapshot, so a retry with the members left needs no transfer;
only a state received part way is dropped.
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
from cells.training.holder import Holder
from cells.training.join import set_extras, take_state
from cells.training.wire import pack, params_view, tensor_checksums, unpack, weights_checksum
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
                 local_loss: str | None = None, cell_rank: int = 0, cell_size: int = 1) -> None:
        self.cell_id, self.device = cell_id, torch.device(device)
        self.cell_rank, self.cell_size = cell_rank, cell_size
        """This rank's index in its cell and the cell's ranks (`cells.train_ranks`): with more
        than one the state is sharded (cells/training/sharded.py); rank 0 is the cell's voice
        and starts the others (cells/training/cell_ranks.py)."""
        self.followers = None
        self.local_loss = local_loss
        """The custom loss of this cell's own configuration (`trainer.objective.loss`): the only
        one it imports; a step whose coordinator names another fails with the reason."""
        self.keep_memory = keep_memory
        """Whether the learner stays allocated while the cell serves rollouts: yes where its
        memory is host memory (the embedded engine); no where the engine takes it back
        (SGLang's GPU memory, `role_handover`): the state is then parked packed in host memory."""
        self.source: StoreAddress | None = None
        self.active = threading.Event()
        self.learner: Any = None
        self.tag: str | None = None
        """Which committed state the learner (or the parked copy) holds (None: nothing trusted)."""
        self.committed: dict[str, Any] | None = None
        """The commit record of that state (version, checksums, cursor, the trainer's counters)."""
        self.hyper: dict[str, Any] | None = None
        self.parked: tuple[dict, torch.Tensor, torch.Tensor] | None = None
        """The state packed in host memory while the learner is gone (`park`)."""
        self._rx: tuple[torch.Tensor, torch.Tensor] | None = None
        """Warm receive buffers for a joining state (values, rows); a prepared learner's
        parameters live at the front of the values buffer."""
        self._zeroed = False
        """The learner's moments are all zero (prepared, never written since)."""
        self._lock = threading.RLock()
        """Guards the state against the holder's jobs and `leave` running beside the loop."""
        self.holder = Holder(self)
        self.num_attempts = self.num_failed = 0
        self._last: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="training", daemon=True)
        self._thread.start()
        threading.Thread(target=self._beat, name="training-beat", daemon=True).start()

    def _beat(self) -> None:
        """The heartbeat the coordinator watches while this rank computes (its own connection:
        the loop's is busy)."""
        store, source = None, None
        while not self._stop.wait(P.BEAT_S):
            if self.source is None:
                continue
            try:
                if store is None or source != self.source:
                    store, source = connect(self.source, timeout_s=10.0), self.source
                store.add(P.beat_key(self.cell_id), 1)
            except Exception:  # the store restarting: the next beat reconnects
                store = None

    def close(self) -> None:
        self._stop.set()
        self.holder.close()
        if self.followers is not None:
            self.followers.stop()

    def enter(self) -> None:
        """The cell is in the training role: take assignments from the next step boundary.
        The learner's modules load now, off the first join's critical path."""
        self.active.set()
        threading.Thread(target=_import_learner, name="training-imports", daemon=True).start()

    def leave(self) -> None:
        """Back to rollout: no more assignments; the committed state stays, parked."""
        with self._lock:
            self.active.clear()
            if not self.keep_memory:
                self.park()

    def park(self) -> None:
        """The state into host memory, the learner dropped (its accelerator memory goes back
        to the engine); the next attempt unpacks it (`unparked`)."""
        with self._lock:
            if self.learner is None or self.tag is None or self.cell_size > 1:  # a slice stays in its learner
                return
            meta, flat, idx = pack(self.learner)
            self.parked = ({**meta, **_extras(self.learner)}, flat, idx)
            self.learner, self._rx, self._zeroed = None, None, False

    def unparked(self) -> None:
        """A parked state back into a learner (before an attempt uses it)."""
        with self._lock:
            if self.parked is None or self.learner is not None:
                return
            meta, flat, idx = self.parked
            self.learner = P.build_learner(self.hyper, meta, local_loss=self.local_loss)
            unpack(self.learner, meta, flat, idx)
            set_extras(self.learner, meta)
            self.parked = None

    def packed(self) -> tuple[dict, torch.Tensor, torch.Tensor]:
        """The held state packed (what a peer or a checkpoint receives), with its extras."""
        with self._lock:
            if self.parked is not None:
                return self.parked
            meta, flat, idx = pack(self.learner)
            return {**meta, **_extras(self.learner)}, flat, idx

    def weights_for(self, version: int) -> dict[str, torch.Tensor] | None:
        """The committed weights of `version` if this cell holds them, verified against the
        commit's checksum; None otherwise (fetch it). A copy: the state stays held."""
        with self._lock:
            c = self.committed
            if c is None or c["version"] != version or (self.learner is None and self.parked is None):
                return None
            if self.parked is not None:
                weights = {k: v.clone() for k, v in params_view(self.parked[0], self.parked[1]).items()}
            else:
                held = getattr(self.learner, "published", False)  # the gathered layout's (cells/training/sharded.py)
                weights = {k: p.detach().clone() for k, p in (self.learner.params if held is False else held or {}).items()}
        if weights_checksum(weights) != c["checksum"]:
            log.warning("version %d: local weights fail the committed checksum; fetching", version)
            return None
        return weights

    def drop(self) -> None:
        """Forget everything (a state received part way, or a fence)."""
        with self._lock:
            self.learner, self.tag, self.committed, self.hyper, self._rx = None, None, None, None, None
            self._zeroed, self.parked = False, None
        self.holder.announce()

    def prepare(self, store) -> bool:
        """In the training role and holding nothing: build the learner the next join fills
        (every tensor of the state allocated and touched) and warm receive buffers, so the
        join writes into memory that exists instead of materialising five model copies on
        the step's critical path. True when it built one."""
        if self.learner is not None or self.parked is not None or self.cell_size > 1 \
                or not store.check([P.SKELETON_KEY]):
            return False
        sk = get_json(store, P.SKELETON_KEY)
        t0 = time.perf_counter()
        n = sum(math.prod(s) for _, s in sk["params"])
        rows = sum(s[0] for _, s in sk["params"] if len(s) == 2)
        # the parameters live at the front of the receive buffer: a joining state's arrive in place
        rx = (torch.zeros(2 * n, dtype=torch.float32), torch.zeros(2 * rows, dtype=torch.long))
        try:
            learner = P.build_skeleton(sk, param_storage=rx[0], local_loss=self.local_loss)
        except ValueError as e:  # the step itself fails with the reason (`join.take_state`)
            log.warning("cell %s: no skeleton prepared: %s", self.cell_id, e)
            return False
        guard.take(learner)  # each update's snapshot copies into these (warm) tensors
        with self._lock:
            if not self.active.is_set() or self.learner is not None or self.parked is not None:
                return False  # left meanwhile, or something arrived
            self.learner, self.hyper, self._rx, self.tag, self._zeroed = learner, sk["hyper"], rx, None, True
        set_json(store, P.prepared_key(self.cell_id), {"t": time.time(), "s": time.perf_counter() - t0})
        log.info("cell %s: learner prepared in %.2fs", self.cell_id, time.perf_counter() - t0)
        return True

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        store, source = None, None
        while not self._stop.is_set():
            if self.source is None or (not self.active.is_set() and self.tag is None):
                store = None
                time.sleep(POLL_S)
                continue
            try:
                if store is None or source != self.source:
                    store, source = connect(self.source, timeout_s=10.0), self.source
                    if self.cell_size > 1 and self.cell_rank == 0:
                        from cells.training.followers import Followers

                        self.followers = Followers.ensure(self.followers, self, source)
                    set_json(store, P.alive_key(self.cell_id), {"t": time.time()})
                    self.holder.connected(store)
                self.holder.poll(store)
                a = wait_json(store, P.assign_key(self.cell_id), POLL_S) if self.active.is_set() else None
            except Exception as e:  # coordinator restarting: try again shortly
                log.debug("training store unreachable: %s", e)
                store = None
                time.sleep(0.5)
                continue
            key = None if a is None else (a["run"], a["step"], a["attempt"])
            if a is None or key == self._last or not self.active.is_set():
                self._idle(store)
                continue
            self._last = key
            try:
                self.run_attempt(store, a)
            except Exception:  # never let the rank die: the next assignment must find it
                log.exception("cell %s: training attempt crashed", self.cell_id)
                self.drop()

    def _idle(self, store) -> None:
        try:
            if not (self.active.is_set() and self.prepare(store)):
                time.sleep(POLL_S)
        except Exception:
            log.exception("cell %s: preparing a learner failed", self.cell_id)
            time.sleep(POLL_S)

    def run_attempt(self, store, a: dict[str, Any]) -> bool:
        """One attempt of one step; True when it was committed."""
        self.num_attempts += 1
        prefix = P.attempt_prefix(a["step"], a["attempt"], a["run"])
        groups: list = []
        box: dict[str, Any] = {}
        try:
            ok = self._attempt(store, prefix, groups, box)
        except (TransferError, RuntimeError, OSError, ValueError, KeyError) as e:
            log.warning("cell %s: training step %s attempt %s failed: %s", self.cell_id, a["step"], a["attempt"], e)
            ok = False
        for g in groups:
            discard(g, [], broken=not ok)
        groups.clear()  # the reaper drops the last reference (its destructor blocks)
        if not ok:
            self.num_failed += 1
            self._recover(box)
        return ok

    def _recover(self, box: dict[str, Any]) -> None:
        """After a failed attempt: the start-of-update state back where the update began (it
        is still the committed state); a state received part way is dropped."""
        snap, tag = box.get("snapshot"), box.get("tag")
        if snap is not None and self.learner is not None:
            with self._lock:
                if self.cell_size > 1:  # the cell's group is gone: its next attempt gathers the copy
                    self.learner.restore_snapshot(snap, gather=False)
                else:
                    guard.restore(self.learner, snap)
                self.tag = tag
            log.info("cell %s: restored the start-of-update state %s", self.cell_id, tag)
        elif box.get("joining"):
            self.drop()

    def _attempt(self, store, prefix: str, groups: list, box: dict) -> bool:
        spec = wait_json(store, f"{prefix}/spec", 10.0)
        if spec is None or self.cell_id not in spec["cells"]:
            return False
        if store.check([f"{prefix}/commit"]) or store.check([f"{prefix}/abort"]):
            return False  # an attempt that ended before this rank (re)started
        rank, n = spec["cells"].index(self.cell_id) + 1, len(spec["cells"])
        key = (lambda what: f"{prefix}/{what}/{rank}") if self.cell_rank == 0 else \
            (lambda what: f"{prefix}/c/{self.cell_id}/{self.cell_rank}/{what}")
        try:  # a loss this cell's configuration does not name is refused before anything joins
            P.local_objective(spec["hyper"], self.local_loss)
        except ValueError as e:
            log.warning("cell %s: refusing training step: %s", self.cell_id, e)
            set_json(store, key("ack"), {"tag": self.tag, "refused": str(e)[:300]})
            return False
        share = (Share.from_json(wait_json(store, f"{prefix}/share/{rank}", 10.0))
                 if spec.get("kind", "rl") == "rl" else None)
        self.unparked()
        set_json(store, key("ack"), {"tag": self._cell_tag(store, prefix, float(spec["connect_timeout_s"]))})
        try:
            (self._compute if self.cell_size == 1 else self._compute_sharded)(store, prefix, spec, rank, n, share,
                                                                            groups, box)
        except Exception as e:
            set_json(store, key("failed"), {"reason": str(e)[:300]})
            raise
        return self._settle(store, prefix, float(spec["commit_timeout_s"]))

    def _cell_tag(self, store, prefix: str, timeout: float) -> str | None:
        if self.cell_size == 1 or self.cell_rank:
            return self.tag
        from cells.training.sharded import cell_tag

        return cell_tag(self, store, prefix, timeout)

    def _compute_sharded(self, *args) -> None:
        from cells.training.sharded import compute

        compute(self, *args)

    def _compute(self, store, prefix: str, spec: dict, rank: int, n: int, share, groups: list, box: dict) -> None:
        timeout, connect_s = float(spec["timeout_s"]), float(spec["connect_timeout_s"])
        got = wait_any(store, [f"{prefix}/source", f"{prefix}/abort"], connect_s)
        if got != f"{prefix}/source":
            raise TransferError(f"no state source from the coordinator ({got or 'timed out'})")
        source = get_json(store, got)
        if n > 1:
            groups.append(join_group(store, f"{prefix}/dp/", rank - 1, n, timeout_s=timeout,
                                     connect_timeout_s=connect_s, device=self.device, abort_key=f"{prefix}/abort"))
        box["joining"] = rank in source["to"]
        take_state(self, store, prefix, spec, source, rank, groups[0] if groups else None)
        box["joining"] = False
        with self._lock:
            self.learner.lr = float(spec["lr"])
        set_json(store, f"{prefix}/joined/{rank}", {"checksum": weights_checksum(self._params())})
        box["tag"], box["snapshot"] = self.tag, guard.take(self.learner)
        t0 = time.perf_counter()
        if spec.get("kind", "rl") == "rl":
            reducer = GroupReducer(groups[0], n, timeout) if n > 1 else LocalReducer()
            metrics = run_update(self.learner, share, reducer, snapshot=box["snapshot"])
            # the per-token weights this rank's share was trained with, for the write-back (JSON)
            set_json(store, f"{prefix}/weights/{rank}", getattr(self.learner, "used_weights", {}))
        else:
            metrics = self._warmup(store, prefix, spec)
        params = self._params()
        crc = weights_checksum(params)
        if rank == 1:
            set_json(store, f"{prefix}/result", {"metrics": metrics, "checksum": crc,
                                                 "tensors": tensor_checksums(params)})
        set_json(store, f"{prefix}/done/{rank}", {"checksum": crc})
        log.info("cell %s rank %d: %s %.2fs", self.cell_id, rank, spec.get("kind", "rl"), time.perf_counter() - t0)

    def _warmup(self, store, prefix: str, spec: dict) -> dict[str, Any]:
        from cells.training.supervised import warmup

        return warmup(self.learner, store, prefix, spec)

    def _params(self) -> dict[str, torch.Tensor]:
        return {k: p.detach() for k, p in self.learner.params.items()}

    def _settle(self, store, prefix: str, timeout: float) -> bool:
        """Keep the update only once the coordinator committed it. A newer assignment (the
        coordinator restarted, or moved on) or its silence past `timeout` gives it up."""
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
                log.warning("cell %s: a newer assignment before this step's commit: giving it up", self.cell_id)
                return False
        else:
            return False
        c = get_json(store, end)
        with self._lock:
            self.tag, self.committed = c["tag"], c
            self.learner.version, self.learner.cursor = int(c["version"]), int(c.get("cursor") or 0)
        self.holder.announce()
        return True


def _extras(learner: Any) -> dict[str, Any]:
    """What travels with a packed state besides the tensors: the sampling generator and the
    data cursor (a resumed or joining learner continues bitwise)."""
    return {"rng": learner.generator.get_state().tolist(), "cursor": learner.cursor}
