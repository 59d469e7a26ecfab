"""The training state on the wire: tensors over torch.distributed, metadata as JSON. No pickle.

State = parameters, AdamW moments (and step counts), the KL reference, the PPO-EWMA copy and
its weight, the optimizer-step and version counters. `pack` flattens it into one float32
buffer and one int64 buffer of row indices plus a JSON manifest; `unpack` rebuilds it.

A joining cell receives exactly what it needs: for the vocabulary tables (151,936 rows, of
which a step touches a few hundred) the moments travel only on rows that are not zero, and
the reference and the EWMA copy only on rows that differ from the parameters; every other
row is implied (zero, or equal to the parameter row), so the rebuilt state is bitwise the
sender's. Everything else travels dense.

The reference travels last: a state packed without it (a step's result) is a prefix of the
whole state, and `with_reference` extends one into the other, which then travels in pieces.
A receiver writes into tensors it holds (`unpack(..., held="warm")`) and receives the
parameters in place when its learner's parameters live at the front of its receive buffer.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
from torch import Tensor

from cells.transport.buckets import crc32  # zlib's CRC-32, bit for bit (isal's where installed)
from cells.transport.p2p import count_bytes, wait_work

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


def tensor_checksums(weights: dict[str, Tensor]) -> list[int]:
    """CRC32 of each parameter's bytes in name order: a commit's per-tensor record (which
    tensor differs), a list because both ends know the names (the skeleton)."""
    return [crc32(weights[k].detach().contiguous().view(torch.uint8).reshape(-1).numpy()
                  if weights[k].numel() else b"") for k in sorted(weights)]


def _entries(learner: Any, reference: bool) -> list[tuple[str, str, Tensor, Tensor | None]]:
    """(kind, name, tensor, base) for every tensor of the state; base None: dense. The
    reference comes last, so a state packed without it is a prefix of one packed with it
    (`with_reference` extends one into the other)."""
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
        out.append(("ewma", k, learner.ewma.params[k], params[k]))
    if reference:
        out += _reference_entries(learner)
    return out


def _reference_entries(learner: Any) -> list[tuple[str, str, Tensor, Tensor | None]]:
    return [("reference", k, learner.reference[k], p.detach()) for k, p in learner.params.items()]


def _pack_entries(entries: list, out: Tensor | None = None) -> tuple[list[dict[str, Any]], Tensor, Tensor]:
    """(records, float32 values, int64 rows) of `entries`: each tensor (or the rows of it that
    differ from its base) read once, straight into one buffer (the front of `out` when it is
    large enough)."""
    records: list[dict[str, Any]] = []
    values = []
    for kind, name, t, base in entries:
        rec = {"kind": kind, "name": name, "shape": list(t.shape)}
        if base is not None and t.dim() == 2 and t.shape[0] >= ROW_SPARSE_MIN_ROWS:
            diff = (t != base).any(dim=1) if base.dim() else (t != 0).any(dim=1)
            idx = torch.nonzero(diff).flatten()
            rec["rows"] = int(idx.numel())
            values.append((t, idx))
        else:
            values.append((t, None))
        records.append(rec)
    n = int(sum(t.numel() if r is None else r.numel() * t.shape[1] for t, r in values))
    flat = out[:n] if out is not None and out.numel() >= n else torch.empty(n, dtype=torch.float32)
    pos = 0
    for t, r in values:
        if r is None:
            flat[pos: pos + t.numel()].view(t.shape).copy_(t)
            pos += t.numel()
        else:
            torch.index_select(t, 0, r, out=flat[pos: pos + r.numel() * t.shape[1]].view(-1, t.shape[1]))
            pos += r.numel() * t.shape[1]
    rows = [r for _, r in values if r is not None]
    idx = torch.cat(rows).to(torch.long) if rows else torch.zeros(0, dtype=torch.long)
    return records, flat, idx.contiguous()


def pack(learner: Any, reference: bool = True, out: Tensor | None = None) -> tuple[dict[str, Any], Tensor, Tensor]:
    """(manifest, float32 values, int64 rows) of the learner's training state; without the
    reference when `reference` is False (an update never changes it: the result of a step
    goes back to a coordinator that has it). `out`: a warm buffer for the values."""
    records, flat, idx = _pack_entries(_entries(learner, reference), out)
    opt = {k: int(learner.optimizer.state[learner.params[k]]["step"])
           for k in learner.params if "step" in learner.optimizer.state.get(learner.params[k], {})}
    meta = {"entries": records, "reference": reference, "adam_steps": opt, "ewma_weight": learner.ewma.weight,
            "ewma_num_resets": learner.ewma.num_resets, "version": learner.version, "step": learner.step,
            "rl_start_step": learner.rl_start_step, "lr": learner.lr,
            "num_values": int(flat.numel()), "num_rows": int(idx.numel())}
    return meta, flat, idx


def with_reference(learner: Any, meta: dict[str, Any], flat: Tensor, idx: Tensor
                   ) -> tuple[dict[str, Any], list[Tensor], list[Tensor]]:
    """A state packed without the reference (`meta`, `flat`, `idx`: the learner's own, e.g. a
    step's result just installed) extended with the learner's reference: (manifest, value
    pieces, row pieces), whose concatenations are bitwise `pack(learner)`. Only the
    reference's rows are scanned; the rest is not copied."""
    if meta["reference"]:
        raise ValueError("the state already holds the reference")
    records, rflat, ridx = _pack_entries(_reference_entries(learner))
    full = {**meta, "entries": meta["entries"] + records, "reference": True,
            "num_values": int(flat.numel() + rflat.numel()), "num_rows": int(idx.numel() + ridx.numel()),
            "pieces": [[int(flat.numel()), int(idx.numel())], [int(rflat.numel()), int(ridx.numel())]]}
    return full, [flat, rflat], [idx, ridx]


@torch.no_grad()
def unpack(learner: Any, meta: dict[str, Any], flat: Tensor, idx: Tensor, held: str = "none",
           zero_moments: bool = False) -> None:
    """Make `learner`'s state bitwise the packed one (parameters first: the sparse rows of
    the reference and EWMA copy are relative to them). `held` says which of the learner's
    tensors are written in place: "none" (fresh tensors), "fresh" (the learner was just built
    from these parameters, `protocol.build_learner` with `flat`: its parameters, reference and
    EWMA copy already equal them, so only what differs is written) or "warm" (every tensor
    of the state, moments included, exists with the right shape but holds anything: each is
    overwritten where it stands, no allocation; `zero_moments`: the moments hold zeros, as a
    prepared learner's do, so only their travelling rows are written). Parameters that live
    in `flat` already (received in place, `Learner(param_storage=...)`) are not copied."""
    if held not in ("none", "fresh", "warm"):
        raise ValueError(f"held must be none, fresh or warm, not {held!r}")
    vpos = rpos = 0
    params = learner.params
    targets = _held_tensors(learner, held)
    got: dict[str, dict[str, Tensor]] = {}
    for rec in meta["entries"]:
        kind, name, shape = rec["kind"], rec["name"], tuple(rec["shape"])
        n = rec["rows"] * shape[1] if "rows" in rec else math.prod(shape)
        vals, vpos = flat[vpos: vpos + n], vpos + n
        if kind == "param":
            if held != "fresh" and params[name].data_ptr() != vals.data_ptr():
                params[name].copy_(vals.view(shape))
            continue
        t = targets.get(kind, {}).get(name)
        if t is not None and tuple(t.shape) != shape:
            t = None
        if "rows" in rec:
            rows, rpos = idx[rpos: rpos + rec["rows"]], rpos + rec["rows"]
            moment = kind.startswith("exp_avg")
            if t is None:
                t = torch.zeros(shape) if moment else params[name].detach().clone()
            elif held == "warm" and not moment:  # the rows that do not travel: the parameter's
                t.copy_(params[name])
            elif held == "warm" and not zero_moments:  # ... or zero
                t.zero_()
            t[rows] = vals.view(-1, shape[1])
        elif t is not None:
            t.copy_(vals.view(shape))
        else:
            t = vals.view(shape).clone()
        got.setdefault(kind, {})[name] = t
    _restore(learner, meta, got)


def _held_tensors(learner: Any, held: str) -> dict[str, dict[str, Tensor]]:
    if held == "none":
        return {}
    out = {"reference": learner.reference, "ewma": learner.ewma.params}
    if held == "warm":
        st = learner.optimizer.state
        for slot in ("exp_avg", "exp_avg_sq"):
            out[slot] = {k: st[p][slot] for k, p in learner.params.items() if slot in st.get(p, {})}
    return out


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


def pieces(meta: dict[str, Any]) -> list[tuple[int, int]]:
    """(values, rows) of each piece a packed state travels in (one unless `with_reference`)."""
    return [tuple(x) for x in meta.get("pieces", [[meta["num_values"], meta["num_rows"]]])]


def send_state(pg, dst: int, values: Tensor | list[Tensor], rows: Tensor | list[Tensor], timeout_s: float,
               tag: int = 0) -> None:
    """Send the packed buffers (or their pieces, in order) to rank `dst` of `pg` (the
    manifest travels as JSON beside)."""
    values = [values] if isinstance(values, Tensor) else values
    rows = [rows] if isinstance(rows, Tensor) else rows
    for i, (v, r) in enumerate(zip(values, rows, strict=True)):
        for j, t in enumerate((v, r)):
            if t.numel():
                count_bytes("send", t)
                wait_work(pg.send([t], dst, tag + 2 * i + j), timeout_s, f"state to rank {dst}")


def recv_state(pg, src: int, meta: dict[str, Any], timeout_s: float, tag: int = 0,
               into: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """The packed buffers from rank `src`, each piece received in place into one values and
    one rows buffer; `into`: warm buffers to receive into where they are large enough."""
    nv, nr = int(meta["num_values"]), int(meta["num_rows"])
    flat = into[0][:nv] if into is not None and into[0].numel() >= nv else torch.empty(nv, dtype=torch.float32)
    idx = into[1][:nr] if into is not None and into[1].numel() >= nr else torch.empty(nr, dtype=torch.long)
    vpos = rpos = 0
    for i, (v, r) in enumerate(pieces(meta)):
        for j, t in enumerate((flat[vpos: vpos + v], idx[rpos: rpos + r])):
            if t.numel():
                count_bytes("recv", t)
                wait_work(pg.recv([t], src, tag + 2 * i + j), timeout_s, f"state from rank {src}")
        vpos, rpos = vpos + v, rpos + r
    if (vpos, rpos) != (nv, nr):
        raise ValueError(f"state pieces cover {vpos}/{rpos} of {nv}/{nr} values/rows")
    return flat, idx


def state_checksum(learner: Any) -> int:
    """CRC32 of the whole packed state (manifest, values, rows): equal iff bitwise equal."""
    return packed_checksum(*pack(learner))


def packed_checksum(meta: dict[str, Any], values: Tensor | list[Tensor], rows: Tensor | list[Tensor]) -> int:
    """CRC32 of a packed state as it travels (pieces: of their concatenation): a receiver
    that computes it over what it received, and unpacks that (deterministic, `unpack(pack(x))`
    is bitwise x), holds the sender's state bitwise."""
    crc = crc32(json.dumps(meta, sort_keys=True).encode())
    for t in ([values] if isinstance(values, Tensor) else values) + ([rows] if isinstance(rows, Tensor) else rows):
        if t.numel():
            crc = crc32(t.view(torch.uint8).numpy(), crc)
    return crc


def state_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two learners' training states (tests, the bench's join check)."""
    ma, fa, ia = pack(a)
    mb, fb, ib = pack(b)
    return ma == mb and torch.equal(fa, fb) and torch.equal(ia, ib)
