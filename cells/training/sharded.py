"""A step attempt on a cell of S training ranks (`cells.train_ranks`, cells/rl/shard.py).

The coordinator sees one rank per cell, as with S = 1: the cell's rank 0 (the agent's
`TrainingWorker`) acks, reports checksums and results, announces what the cell holds and
answers its jobs; ranks 1..S-1 (cells/training/cell_ranks.py) read the same assignment,
spec and share, and report to rank 0 under `{prefix}/c/<cell>/<i>/` keys, which rank 0
checks before it reports for the cell. Per attempt, on the coordinator's store, each rank
joins three stateless groups:

    all             every rank of the step (C x S): the update's scalar sums and metrics
    cell/<cell>     the cell's S ranks: reduce-scatter, norm, all-gather of the slices
    dp/<i>          rank i of each of the step's C cells: the gradient slice's all-reduce,
                    and a joining cell's slices from a cell of the step (membership per step)

The cell's share is split across its ranks by tokens (`plan.split_share`), N0 global. A stale
rank i takes the committed state's slice i: built from the start weights, sent by rank i of a
cell of the step, served by rank i of a peer cell that holds it parked, or read from the
checkpoint's shard files (re-sharded when they were written by another S; a one-rank
checkpoint is sliced).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from cells.rl import guard
from cells.rl.plan import split_share
from cells.rl.reduce import GroupReducer
from cells.rl.shard import ShardGroups
from cells.rl.shard_state import install_shard, pack_shard
from cells.rl.update import run_update
from cells.training import protocol as P
from cells.training import shard_files
from cells.training.wire import tensor_checksums, weights_checksum
from cells.transport.p2p import TransferError, count_bytes, join_group, wait_work
from cells.transport.store import get_json, set_json, wait_any, wait_json

log = logging.getLogger("cellflip.training")

HOST = torch.device("cpu")
"""The flat layout's learner tensors are host tensors, so its groups are gloo."""


def group_device(w: Any, hyper: dict) -> torch.device:
    """Where a rank's `cell/<cell>` and `dp/<i>` groups run: its device (`cuda:<i>`: NCCL) for
    the gathered layout, whose slices live there; host memory (gloo) for the flat layout."""
    from cells.training.followers import rank_device

    return torch.device(rank_device(w.device, w.cell_rank)) if hyper.get("shard_layout") == "gathered" else HOST


def held_params(w: Any) -> dict | None:
    """The cell's whole parameters, for its checksums: the flat layout's compute copy, or
    gathered from the slices (the gathered layout: a collective of the cell; rank 0 keeps
    them in host memory as `published`, the version it publishes; the other ranks take part
    and keep nothing: None)."""
    lrn = w.learner
    if not hasattr(lrn, "full_params"):
        return w._params()
    full = lrn.full_params("cpu" if w.cell_rank == 0 else None)
    lrn.published = full if w.cell_rank == 0 else None
    return lrn.published


def cell_key(prefix: str, cell: str, i: int, what: str) -> str:
    """A key rank i (> 0) of `cell` reports under, for its rank 0."""
    return f"{prefix}/c/{cell}/{i}/{what}"


def report(w: Any, store, prefix: str, rank: int, what: str, value: dict, timeout_s: float,
           result: dict | None = None) -> None:
    """Rank i > 0: `value` under its cell key. Rank 0: once every rank of the cell reported the
    same checksum as its own, `result` (the step's, rank 1 of the step only) and `value` for
    the coordinator (`{prefix}/<what>/<rank>`)."""
    if w.cell_rank:
        set_json(store, cell_key(prefix, w.cell_id, w.cell_rank, what), value)
        return
    for i in range(1, w.cell_size):
        got = wait_any(store, [cell_key(prefix, w.cell_id, i, what), cell_key(prefix, w.cell_id, i, "failed"),
                               f"{prefix}/abort"], timeout_s)
        if got != cell_key(prefix, w.cell_id, i, what):
            raise TransferError(f"cell rank {i} did not report {what} ({got or 'timed out'})")
        crc = get_json(store, got)["checksum"]  # None: a gathered layout's rank, no copy of its own
        if crc is not None and int(crc) != int(value["checksum"]):
            raise TransferError(f"cell rank {i} holds other parameters than rank 0 after {what}")
    if result is not None:
        set_json(store, f"{prefix}/result", result)
    set_json(store, f"{prefix}/{what}/{rank}", value)


def cell_tag(w: Any, store, prefix: str, timeout: float) -> str | None:
    """The tag rank 0 acks for the cell: its own only if every rank of the cell holds it (else
    the whole cell takes the state again). A rank that does not answer (dead, stopped, stuck)
    takes the cell out of this attempt; rank 0 restarts it, empty, at the next."""
    from cells.training.followers import Followers

    w.followers = Followers.ensure(w.followers, w, w.source)
    acks = [wait_json(store, cell_key(prefix, w.cell_id, i, "ack"), timeout) for i in range(1, w.cell_size)]
    if any(a is None for a in acks):
        w.followers.stop()
        w.followers = None
        raise TransferError(f"cell ranks {[i for i, a in enumerate(acks, 1) if a is None]} did not answer")
    return w.tag if all(a.get("tag") == w.tag for a in acks) else None


def compute(w: Any, store, prefix: str, spec: dict, rank: int, n: int, share, groups: list, box: dict) -> None:
    """The sharded counterpart of `TrainingWorker._compute` (same keys towards the coordinator)."""
    S, i = w.cell_size, w.cell_rank
    timeout, connect_s = float(spec["timeout_s"]), float(spec["connect_timeout_s"])
    got = wait_any(store, [f"{prefix}/source", f"{prefix}/abort"], connect_s)
    if got != f"{prefix}/source":
        raise TransferError(f"no state source from the coordinator ({got or 'timed out'})")
    source = get_json(store, got)
    dev = group_device(w, spec["hyper"])
    kw = {"timeout_s": timeout, "connect_timeout_s": connect_s, "device": dev, "abort_key": f"{prefix}/abort"}
    # the update's scalar sums stay gloo (it takes host and CUDA tensors; NCCL only the latter)
    every = join_group(store, f"{prefix}/all/", (rank - 1) * S + i, n * S, **{**kw, "device": HOST})
    cell = join_group(store, f"{prefix}/cell/{w.cell_id}/", i, S, **kw)
    cross = join_group(store, f"{prefix}/dp/{i}/", rank - 1, n, **kw) if n > 1 else None
    groups += [g for g in (every, cell, cross) if g is not None]
    sg = ShardGroups(cell, i, S, cross, n, timeout)
    box["joining"] = rank in source["to"]
    take_shards(w, store, prefix, spec, source, rank, sg)
    box["joining"] = False
    with w._lock:
        w.learner.groups = sg
        if w.learner.stale_copy:
            w.learner.gather_params()
        w.learner.lr = float(spec["lr"])
    params = held_params(w)
    crc = None if params is None else weights_checksum(params)
    report(w, store, prefix, rank, "joined", {"checksum": crc}, connect_s + 2 * timeout)
    box["tag"], box["snapshot"] = w.tag, guard.take(w.learner)
    t0 = time.perf_counter()
    if spec.get("kind", "rl") == "rl":
        mine = split_share(share, S, w.learner.objective.tree)[i]
        metrics = run_update(w.learner, mine, GroupReducer(every, n * S, timeout), snapshot=box["snapshot"])
    else:
        w.learner.solo_grads = True  # every rank runs the same demonstrations: rank 0's gradient counts
        try:
            metrics = w._warmup(store, prefix, spec)
        finally:
            w.learner.solo_grads = False
    params = held_params(w)
    crc = None if params is None else weights_checksum(params)
    result = ({"metrics": metrics, "checksum": crc, "tensors": tensor_checksums(params)}
              if rank == 1 and i == 0 else None)
    report(w, store, prefix, rank, "done", {"checksum": crc}, timeout, result)
    log.info("cell %s rank %d.%d: %s on %s %.2fs", w.cell_id, rank, i, spec.get("kind", "rl"), type(w.learner).__name__,
             time.perf_counter() - t0)


def _fresh(w: Any, store, spec: dict, sg: ShardGroups, weights: dict | None = None) -> Any:
    """A sharded learner of the step's hyper-parameters: of `weights`, or zeros of the
    skeleton's shapes (a join then writes its slices)."""
    h = spec["hyper"]
    if weights is None:
        weights = {k: torch.zeros(s) for k, s in get_json(store, P.SKELETON_KEY)["params"]}
    return P.build_learner(h, {"entries": []}, local_loss=w.local_loss, weights=weights,
                           groups=ShardGroups(None, sg.cell_rank, sg.cell_size), device=group_device(w, h))


def _target(w: Any, store, spec: dict, sg: ShardGroups) -> Any:
    """The learner a joining slice goes into: the one held if its hyper-parameters match."""
    if w.learner is not None and w.hyper is not None and P.same_learner(w.hyper, spec["hyper"]) \
            and getattr(w.learner, "groups", None) is not None:
        return w.learner
    return _fresh(w, store, spec, sg)


def take_shards(w: Any, store, prefix: str, spec: dict, source: dict, rank: int, sg: ShardGroups) -> None:
    kind, stale = source["kind"], rank in source["to"]
    if stale and kind == "build":
        from cells.rl.sft import start_weights

        weights = start_weights(P.spec_from_signature(spec["hyper"]["model"]), spec["start"])
        _hold(w, spec, _fresh(w, store, spec, sg, weights), None)
    elif stale and kind == "checkpoint":
        lrn = _target(w, store, spec, sg)
        shard_files.load_into(lrn, source["path"], spec["hyper"], w.local_loss)
        _hold(w, spec, lrn, spec["tag"])
    elif stale and kind == "peer":
        _fetch_from_peer(w, store, prefix, spec, source["cell"], sg)
    elif kind == "rank":
        src = int(source["rank"])
        if rank == src:
            _send(w, store, prefix, sg, [r for r in source["to"] if r != src], float(spec["timeout_s"]))
        elif stale:
            _receive(w, store, prefix, spec, sg, src)
    if w.learner is None or getattr(w.learner, "groups", None) is None:
        raise TransferError(f"rank {rank}.{sg.cell_rank} holds no sharded state after the join ({kind})")


def _hold(w: Any, spec: dict, learner: Any, tag: str | None) -> None:
    with w._lock:
        w.learner, w.hyper, w.tag, w.committed, w._rx, w._zeroed = learner, spec["hyper"], tag, None, None, False


def _send(w: Any, store, prefix: str, sg: ShardGroups, ranks: list[int], timeout: float) -> None:
    meta, flat = pack_shard(w.learner)
    flat = flat.to(group_device(w, w.hyper or {}))
    set_json(store, f"{prefix}/shard/{sg.cell_rank}", {**meta, "numel": flat.numel()})
    for r in ranks:
        count_bytes("send", flat)
        wait_work(sg.cross.send([flat], r - 1, 0), timeout, f"state slice to rank {r}")


def _receive(w: Any, store, prefix: str, spec: dict, sg: ShardGroups, src: int) -> None:
    t0, timeout = time.perf_counter(), float(spec["timeout_s"])
    meta = wait_json(store, f"{prefix}/shard/{sg.cell_rank}", float(spec["connect_timeout_s"]) + timeout)
    if meta is None:
        raise TransferError("no slice manifest from the source rank")
    with w._lock:
        w.committed, w.tag = None, None
    flat = torch.empty(int(meta.pop("numel")), device=group_device(w, spec["hyper"]))
    count_bytes("recv", flat)
    wait_work(sg.cross.recv([flat], src - 1, 0), timeout, f"state slice from rank {src}")
    lrn = _target(w, store, spec, sg)
    install_shard(lrn, meta, flat)
    _hold(w, spec, lrn, spec["tag"])
    log.info("cell %s.%d: slice of %.0f MB from rank %d in %.2fs", w.cell_id, sg.cell_rank, flat.numel() * 4 / 1e6,
             src, time.perf_counter() - t0)


def _fetch_from_peer(w: Any, store, prefix: str, spec: dict, peer: str, sg: ShardGroups) -> None:
    """Slice i of the committed state from rank i of `peer`, a cell outside the step."""
    from cells.training.jobs import post
    from cells.transport.p2p import discard

    timeout, where = float(spec["timeout_s"]), f"{prefix}/serve/{sg.cell_rank}/"
    post(store, peer, {"op": "serve", "group": where, "tag": spec["tag"], "shard": sg.cell_rank})
    with w._lock:
        w.committed, w.tag = None, None
    dev = group_device(w, spec["hyper"])
    group = join_group(store, where, 1, 2, timeout_s=timeout, connect_timeout_s=float(spec["connect_timeout_s"]),
                       device=dev, abort_key=f"{prefix}/abort")
    try:
        meta = wait_json(store, f"{where}meta", timeout)
        if meta is None or meta.get("refused"):
            raise TransferError(f"peer {peer} does not serve slice {sg.cell_rank}: {meta}")
        flat = torch.empty(int(meta.pop("numel")), device=dev)
        wait_work(group.recv([flat], 0, 0), timeout, f"state slice from peer {peer}")
        set_json(store, f"{where}received", {"ok": True})
    finally:
        discard(group, [], broken=False)
        group = None
    lrn = _target(w, store, spec, sg)
    install_shard(lrn, meta, flat)
    _hold(w, spec, lrn, spec["tag"])
    log.info("cell %s.%d: slice of %.0f MB from peer %s", w.cell_id, sg.cell_rank, flat.numel() * 4 / 1e6, peer)


def serve(w: Any, store, job: dict) -> None:
    """A peer's rank i serving its slice (`_fetch_from_peer`'s other end)."""
    from cells.transport.p2p import discard

    where = job["group"]
    if w.tag != job["tag"] or w.learner is None:
        set_json(store, f"{where}meta", {"refused": f"holds {w.tag}, not {job['tag']}"})
        return
    dev = group_device(w, w.hyper or {})
    group = join_group(store, where, 0, 2, timeout_s=30.0, connect_timeout_s=30.0, device=dev)
    try:
        with w._lock:
            meta, flat = pack_shard(w.learner)
        flat = flat.to(dev)
        set_json(store, f"{where}meta", {**meta, "numel": flat.numel()})
        wait_work(group.send([flat], 1, 0), 30.0, "state slice to a peer")
        wait_json(store, f"{where}received", 30.0)
    finally:
        discard(group, [], broken=False)
        group = None
