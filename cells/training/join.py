"""How a training rank whose state is stale takes the committed one, from where the coordinator
named (`{prefix}/source`), never from the trainer:

    none        every rank holds it already
    build       nothing committed yet: each rank builds the start state itself (the user's
                Hugging Face directory, loaded straight into place, or the seeded init)
    rank        a rank of the step holds it: it sends its packed state to each stale rank
                over the step's `dp` group (NCCL on GPU cells)
    peer        a cell outside the step holds it (parked through a rollout stint): the first
                stale rank fetches it in a group of two (the peer's holder serves it,
                cells/training/holder.py) and then serves the other stale ranks as `rank`
    checkpoint  no cell holds it: each stale rank reads the newest checkpoint

Every rank then reports its parameters' checksum, which the coordinator compares with the
commit's (worker.py); a state received part way is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cells.training import protocol as P
from cells.training import state_files
from cells.training.jobs import post
from cells.training.wire import packed_checksum, recv_state, send_state, unpack
from cells.transport.p2p import TransferError, discard, join_group
from cells.transport.store import set_json, wait_json

log = logging.getLogger("cellflip.training")


def take_state(w: Any, store, prefix: str, spec: dict, source: dict, rank: int, group) -> None:
    kind, stale = source["kind"], rank in source["to"]
    if stale and kind == "build":
        _build(w, spec)
    elif stale and kind == "checkpoint":
        _install(w, spec, *state_files.load_packed(source["path"]))
    elif stale and kind == "peer" and rank == source["rank"]:
        _fetch_from_peer(w, store, prefix, spec, source["cell"])
    if kind in ("rank", "peer"):
        src = source["rank"]
        others = [r for r in source["to"] if r != src]
        if rank == src and others:
            _send(w, store, prefix, group, others, float(spec["timeout_s"]))
        elif rank in others:
            _receive(w, store, prefix, spec, group, src)
    if w.learner is None:
        raise TransferError(f"rank {rank} holds no state after the join ({kind})")


def _build(w: Any, spec: dict) -> None:
    from cells.rl.learner import Learner  # noqa: F401 (loaded before the weights)
    from cells.rl.sft import start_weights

    h = spec["hyper"]
    weights = start_weights(P.spec_from_signature(h["model"]), spec["start"])
    learner = P.build_learner(h, {"entries": []}, local_loss=w.local_loss, weights=weights)
    with w._lock:
        w.learner, w.hyper, w.tag, w.committed, w._rx, w._zeroed = learner, h, None, None, None, False


def _install(w: Any, spec: dict, meta: dict, flat, idx) -> None:
    """A packed state into this rank's learner (in place where it holds one of the same
    hyper-parameters), with its generator and cursor."""
    h = spec["hyper"]
    with w._lock:
        warm = w.learner is not None and w.hyper is not None and P.same_learner(w.hyper, h)
        if not warm:
            w.learner, w.hyper = P.build_learner(h, meta, flat, param_storage=flat, local_loss=w.local_loss), h
        unpack(w.learner, meta, flat, idx, held="warm" if warm else "fresh", zero_moments=warm and w._zeroed)
        set_extras(w.learner, meta)
        w._zeroed, w.tag, w.committed = False, spec["tag"], None
        if not warm:  # the learner's parameters live at the front of `flat`: the next join's buffers
            w._rx = (flat, idx)


def _send(w: Any, store, prefix: str, group, ranks: list[int], timeout: float) -> None:
    t0 = time.perf_counter()
    meta, flat, idx = w.packed()
    set_json(store, f"{prefix}/state", {**meta, "checksum": packed_checksum(meta, flat, idx)})
    for r in ranks:
        send_state(group, r - 1, flat, idx, timeout)
    log.info("cell %s: state of %.0f MB to ranks %s in %.2fs", w.cell_id, (flat.numel() * 4 + idx.numel() * 8) / 1e6,
             ranks, time.perf_counter() - t0)


def _receive(w: Any, store, prefix: str, spec: dict, group, src: int) -> None:
    t0 = time.perf_counter()
    meta = wait_json(store, f"{prefix}/state", float(spec["connect_timeout_s"]) + float(spec["timeout_s"]))
    if meta is None:
        raise TransferError("no state manifest from the source rank")
    with w._lock:
        w.committed, w.tag = None, None  # whatever this learner held is overwritten now
    flat, idx = recv_state(group, src - 1, meta, float(spec["timeout_s"]), into=w._rx)
    _check(meta, flat, idx)
    _install(w, spec, meta, flat, idx)
    log.info("cell %s: state of %.0f MB from rank %d in %.2fs", w.cell_id,
             (flat.numel() * 4 + idx.numel() * 8) / 1e6, src, time.perf_counter() - t0)


def _check(meta: dict, flat, idx) -> None:
    want = meta.pop("checksum", None)
    if want is not None and packed_checksum(meta, flat, idx) != int(want):
        raise TransferError("the received state fails its checksum")


def _fetch_from_peer(w: Any, store, prefix: str, spec: dict, peer: str) -> None:
    """The committed state from `peer`, a cell outside the step that holds it."""
    t0, timeout = time.perf_counter(), float(spec["timeout_s"])
    where = f"{prefix}/serve/"
    post(store, peer, {"op": "serve", "group": where, "tag": spec["tag"]})
    with w._lock:
        w.committed, w.tag = None, None
    group = join_group(store, where, 1, 2, timeout_s=timeout, connect_timeout_s=float(spec["connect_timeout_s"]),
                       device=w.device, abort_key=f"{prefix}/abort")
    try:
        meta = wait_json(store, f"{where}meta", timeout)
        if meta is None or meta.get("refused"):
            raise TransferError(f"peer {peer} does not serve the state: {meta}")
        flat, idx = recv_state(group, 0, meta, timeout, into=w._rx)
        set_json(store, f"{where}received", {"ok": True})
    finally:
        discard(group, [], broken=False)
        group = None
    _check(meta, flat, idx)
    _install(w, spec, meta, flat, idx)
    log.info("cell %s: state from peer %s in %.2fs", w.cell_id, peer, time.perf_counter() - t0)


def serve(w: Any, store, job: dict) -> None:
    """The peer's side of `_fetch_from_peer` (run by its holder): send the held state if it is
    the one asked for."""
    where = job["group"]
    if w.tag != job["tag"]:
        set_json(store, f"{where}meta", {"refused": f"holds {w.tag}, not {job['tag']}"})
        return
    group = join_group(store, where, 0, 2, timeout_s=30.0, connect_timeout_s=30.0, device=w.device)
    try:
        meta, flat, idx = w.packed()
        set_json(store, f"{where}meta", {**meta, "checksum": packed_checksum(meta, flat, idx)})
        send_state(group, 1, flat, idx, 30.0)
        wait_json(store, f"{where}received", 30.0)  # the group outlives the receive
    finally:
        discard(group, [], broken=False)
        group = None


def set_extras(learner: Any, meta: dict[str, Any]) -> None:
    """The learner's sampling generator and trajectory cursor, from a state's metadata."""
    if "rng" in meta:
        learner.generator.set_state(torch.tensor(meta["rng"], dtype=torch.uint8))
    learner.cursor = int(meta.get("cursor") or 0)
