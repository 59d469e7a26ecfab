"""The training state on the wire: tensors over torch.distributed, metadata as JSON. No pickle.

State = parameters, AdamW moments (and step counts), the KL reference, the PPO-EWMA copy and
its weight, the optimizer-step and version counters. `pack` flattens it into one float32
buffer and one int64 buffer of row indices plus a JSON manifest; `unpack` rebuilds it.

A joining cell receives exactly what it needs: for the vocabulary tables (151,936 rows, of
which a step touches a few hundred) the moments travel only on rows that are not zero, and
the reference and the EWMA copy only on rows that differ from the parameters; every other
row is implied (zero, or equal to the parameter row), so the rebuilt state is bitwise the
sender's. Everything else travels dense.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor

from cells.transport.buckets import crc32  # zlib's CRC-32, bit for bit (isal's where installed)
from cells.transport.p2p import wait_work

ROW_SPARSE_MIN_ROWS = 4096
"""Tensors with at least this many rows travel row-sparse (the vocabulary tables)."""


def weights_checksum(weights: dict[str, Tensor]) -> int:
    """CRC32 of the parameters' bytes in name order: what a version is, bitwise."""
    crc = 0
    for k in sorted(weights):
        t = weights[k].detach().contiguous()
        crc = crc32(k.encode(), crc)
        crc = crc32(t.view(torch.uint8).reshape(-1).numpy() if t.numel() else b"", crc)
    return crc


def _entries(learner: Any, reference: bool) -> list[tuple[str, str, Tensor, Tensor | None]]:
    """(kind, name, tensor, base) for every tensor of the state; base None: dense."""
    out = []
    params = {k: p.detach() for k, p in learner.params.items()}
    for k, p in params.items():
        out.append(("param", k, p, None))
    for k in params:
        st = learner.optimizer.state.get(learner.params[k], {})
        for slot in ("exp_avg", "exp_avg_sq"):
            if slot in st:
                out.append((slot, k, st[slot], torch.zeros(())))
    for k in params:
        if reference:
            out.append(("reference", k, learner.reference[k], params[k]))
        out.append(("ewma", k, learner.ewma.params[k], params[k]))
    return out


def pack(learner: Any, reference: bool = True) -> tuple[dict[str, Any], Tensor, Tensor]:
    """(manifest, float32 values, int64 rows) of the learner's training state; without the
    reference when `reference` is False (an update never changes it: the result of a step
    goes back to a coordinator that has it)."""
    manifest: list[dict[str, Any]] = []
    values = []
    for kind, name, t, base in _entries(learner, reference):
        rec = {"kind": kind, "name": name, "shape": list(t.shape)}
        if base is not None and t.dim() == 2 and t.shape[0] >= ROW_SPARSE_MIN_ROWS:
            diff = (t != base).any(dim=1) if base.dim() else (t != 0).any(dim=1)
            idx = torch.nonzero(diff).flatten()
            rec["rows"] = int(idx.numel())
            values.append((t, idx))
        else:
            values.append((t, None))
        manifest.append(rec)
    opt = {k: int(learner.optimizer.state[learner.params[k]]["step"])
           for k in learner.params if "step" in learner.optimizer.state.get(learner.params[k], {})}
    rows = [r for _, r in values if r is not None]
    meta = {"entries": manifest, "reference": reference, "adam_steps": opt, "ewma_weight": learner.ewma.weight,
            "ewma_num_resets": learner.ewma.num_resets, "version": learner.version, "step": learner.step,
            "rl_start_step": learner.rl_start_step, "lr": learner.lr,
            "num_values": int(sum(t.numel() if r is None else r.numel() * t.shape[1] for t, r in values)),
            "num_rows": int(sum(r.numel() for r in rows))}
    flat = torch.empty(meta["num_values"], dtype=torch.float32)
    pos = 0
    for t, r in values:  # each tensor (or its rows) read once, straight into the buffer
        if r is None:
            flat[pos: pos + t.numel()].view(t.shape).copy_(t)
            pos += t.numel()
        else:
            torch.index_select(t, 0, r, out=flat[pos: pos + r.numel() * t.shape[1]].view(-1, t.shape[1]))
            pos += r.numel() * t.shape[1]
    idx = torch.cat(rows).to(torch.long) if rows else torch.zeros(0, dtype=torch.long)
    return meta, flat, idx.contiguous()


@torch.no_grad()
def unpack(learner: Any, meta: dict[str, Any], flat: Tensor, idx: Tensor, fresh: bool = False) -> None:
    """Make `learner`'s state bitwise the packed one (parameters first: the sparse rows of
    the reference and EWMA copy are relative to them). `fresh`: the learner was just built
    from these parameters (`protocol.build_learner` with `flat`), so its parameters,
    reference and EWMA copy already equal them: only what differs is written, in place."""
    vpos = rpos = 0
    params = learner.params
    held = {"reference": learner.reference, "ewma": learner.ewma.params} if fresh else {}
    got: dict[str, dict[str, Tensor]] = {}
    for rec in meta["entries"]:
        kind, name, shape = rec["kind"], rec["name"], tuple(rec["shape"])
        n = rec["rows"] * shape[1] if "rows" in rec else math.prod(shape)
        vals, vpos = flat[vpos: vpos + n], vpos + n
        if kind == "param":
            if not fresh:
                params[name].copy_(vals.view(shape))
            continue
        if "rows" in rec:
            rows, rpos = idx[rpos: rpos + rec["rows"]], rpos + rec["rows"]
            if kind in held:
                t = held[kind][name]  # equal to the parameter already
            else:
                t = torch.zeros(shape) if kind.startswith("exp_avg") else params[name].detach().clone()
            t[rows] = vals.view(-1, shape[1])
        elif kind in held:
            t = held[kind][name].copy_(vals.view(shape))
        else:
            t = vals.view(shape).clone()
        got.setdefault(kind, {})[name] = t
    _restore(learner, meta, got)


def _restore(learner: Any, meta: dict[str, Any], got: dict[str, dict[str, Tensor]]) -> None:
    learner.optimizer.state.clear()
    for k, n in meta["adam_steps"].items():
        p = learner.params[k]
        learner.optimizer.state[p] = {"step": torch.tensor(float(n)), "exp_avg": got["exp_avg"][k],
                                      "exp_avg_sq": got["exp_avg_sq"][k]}
    if meta["reference"]:
        learner.reference = dict(got["reference"])
    learner.ewma.params = dict(got["ewma"])
    learner.ewma.weight = float(meta["ewma_weight"])
    learner.ewma.num_resets = int(meta["ewma_num_resets"])
    learner.version, learner.step = int(meta["version"]), int(meta["step"])
    start = meta["rl_start_step"]
    learner.rl_start_step = None if start is None else int(start)
    learner.lr = float(meta["lr"])


def params_view(meta: dict[str, Any], flat: Tensor) -> dict[str, Tensor]:
    """The parameters inside a packed state (views of `flat`; they travel dense, first)."""
    out, pos = {}, 0
    for rec in meta["entries"]:
        if rec["kind"] != "param":
            break
        n = math.prod(rec["shape"])
        out[rec["name"]] = flat[pos: pos + n].view(tuple(rec["shape"]))
        pos += n
    return out


def send_state(pg, dst: int, flat: Tensor, idx: Tensor, timeout_s: float, tag: int = 0) -> None:
    """Send the packed buffers to rank `dst` of `pg` (the manifest travels as JSON beside)."""
    for i, t in enumerate((flat, idx)):
        if t.numel():
            wait_work(pg.send([t], dst, tag + i), timeout_s, f"state to rank {dst}")


def recv_state(pg, src: int, meta: dict[str, Any], timeout_s: float, tag: int = 0) -> tuple[Tensor, Tensor]:
    flat = torch.empty(int(meta["num_values"]), dtype=torch.float32)
    idx = torch.empty(int(meta["num_rows"]), dtype=torch.long)
    for i, t in enumerate((flat, idx)):
        if t.numel():
            wait_work(pg.recv([t], src, tag + i), timeout_s, f"state from rank {src}")
    return flat, idx


def state_checksum(learner: Any) -> int:
    """CRC32 of the whole packed state (manifest, values, rows): equal iff bitwise equal."""
    return packed_checksum(*pack(learner))


def packed_checksum(meta: dict[str, Any], flat: Tensor, idx: Tensor) -> int:
    """CRC32 of a packed state as it travels: a receiver that computes it over what it
    received, and unpacks that (deterministic, `unpack(pack(x))` is bitwise x), holds the
    sender's state bitwise."""
    crc = crc32(json.dumps(meta, sort_keys=True).encode())
    crc = crc32(flat.view(torch.uint8).numpy(), crc)
    return crc32(idx.view(torch.uint8).numpy(), crc)


def state_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two learners' training states (tests, the bench's join check)."""
    ma, fa, ia = pack(a)
    mb, fb, ib = pack(b)
    return ma == mb and torch.equal(fa, fb) and torch.equal(ia, ib)
