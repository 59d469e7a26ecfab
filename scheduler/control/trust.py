"""Cells are untrusted until verified: the fleet's model limits, each cell's trust, the checks on
everything a cell reports, and quarantine.

- **Model limits.** The first cell to register fixes the fleet's vocabulary, context length and
  output ids (durably); a cell reporting other limits is refused. Requests are checked against
  them before anything is recorded or placed (`check_request`), and so is every sampled token.
- **Trust.** A cell registers `unverified`, with its answer to the registration probe
  (scheduler/contract/probe.py): log-probs of a short sequence fixed by the version. It becomes
  `verified` when its answer agrees with the version's reference (the fleet's first probing
  cell's answer, or, for a version without one, the answer two cells first agree on), and is
  refused when it disagrees. Only trusted cells are given requests and count toward
  `min_rollout_cells`: verified ones, and with `scheduler.trust_unprobed_cells` those that
  send no probe (an engine that cannot score yet).
- **Ingest checks.** A sampled token outside the vocabulary or the output ids, a log-prob that is
  not finite or above 0, a version the cell was never told to serve: the cell is quarantined.
  So is a cell whose sampled log-probs a verified cell's exact scoring contradicts (bit for
  bit where both are batch-invariant, within `scheduler.verify_tolerance` otherwise), or whose
  tokens a verified cell scores as impossible. Compared only where the sampler computed the
  whole context under the scored version: the request came to it (placed, or re-prefilled)
  when it already reported serving that version, and every token it sampled carries it. A
  cell continues its running requests across a version change over KV of the previous
  version (the `continue` policy): their log-probs are honestly not the new version's, and
  KV that arrived by migration was computed elsewhere.
- **Quarantine.** The cell is fenced (`trust` quarantined, so its id is refused until an admin
  readmits it). A live request's tokens it sampled that no client was shown are taken back
  and sampled again by a trusted cell (the session stays trainable); where a client saw
  some, the request goes on from there on a trusted cell, and the session is never handed
  out for training (kept in the store as its clients saw it, handed out as dropped).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.contract.errors import Conflict, Invalid
from scheduler.contract.probe import agree, well_formed
from scheduler.contract.records import TokenRecords

if TYPE_CHECKING:
    from scheduler.contract.protocol import Capabilities, RegisterRequest, TokenBatch
    from scheduler.contract.sampling import SamplingParams
    from scheduler.control.context import Context, Effects
    from scheduler.store.fleet import CellRow

log = logging.getLogger("cellflip.trust")

MODEL_KEY = "fleet.model"
PROBE_KEY = "probe.reference.{}"
GENESIS_KEY = "probe.genesis"
KV_VERSIONS_KEPT = 1 << 16
TOKEN_ID_MAX = (1 << 31) - 1
"""The greatest token id (the store packs ids as int32: scheduler/store/tokenpack.py)."""
"""Requests whose placement versions are remembered for the cross-check (the oldest forgotten:
their tokens are then not cross-checked; so are all after a scheduler restart)."""
"""Which cell set the fleet's first probe reference."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    output_ranges: tuple[tuple[int, int], ...] | None

    @classmethod
    def of(cls, caps: Capabilities) -> ModelLimits:
        ranges = tuple((int(lo), int(hi)) for lo, hi in caps.output_ranges) if caps.output_ranges else None
        return cls(int(caps.vocab_size), int(caps.max_context), ranges)

    def to_dict(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "max_context": self.max_context,
                "output_ranges": [list(r) for r in self.output_ranges] if self.output_ranges else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelLimits:
        ranges = tuple((int(lo), int(hi)) for lo, hi in d["output_ranges"]) if d.get("output_ranges") else None
        return cls(int(d["vocab_size"]), int(d["max_context"]), ranges)

    def sampleable(self, token: int) -> bool:
        if not 0 <= token < self.vocab_size:
            return False
        return self.output_ranges is None or any(lo <= token < hi for lo, hi in self.output_ranges)


def trusted(trust: str, probed: bool, trust_unprobed: bool) -> bool:
    """A verified cell, or (where the config allows it) one that sent no probe."""
    return trust == "verified" or (trust == "unverified" and not probed and trust_unprobed)


class Trust:
    """Owns the fleet's model limits and each cell's trust (mirrored from the store's cells)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        raw = ctx.store.fleet.setting(MODEL_KEY)
        self.limits: ModelLimits | None = ModelLimits.from_dict(raw) if raw else None
        self.told: dict[str, set[int]] = {c.id: {c.version} for c in ctx.store.fleet.list_cells()
                                          if c.state != "down" and c.version is not None}
        """cell → versions it registered with (its tokens may carry them besides published ones);
        after a restart, the version each cell last reported."""
        self.quarantine_cell: Callable[[Effects, CellRow, str], None] | None = None
        """Fences a cell (the controller wires Membership.fence_in_tx here)."""
        self.requeue_request: Callable[..., None] | None = None
        """Takes a request from its owner to be re-placed (Ownership.revoke)."""
        self.rewind_request: Callable[..., int | None] | None = None
        """Takes back a live request's tokens from an index on when no client was shown them,
        to be sampled again elsewhere; None when some were shown (the controller's `_rewind`)."""
        self.kv_version: OrderedDict[str, dict[str, int | None]] = OrderedDict()
        """request id → {cell: the version it served when the request came to it with fresh KV,
        None when its KV moved in}: where the cross-check may compare (`placed`)."""

    # ------------------------------------------------------------------ registration
    def placed(self, request_id: str, cell_id: str, fresh_kv: bool) -> None:
        """`request_id` came to `cell_id`: with `fresh_kv` (placed, or re-prefilled there) its
        KV will be computed there under the version the cell last reported serving (it never
        goes back; a later change shows in its tokens' versions); else (KV moved in) unknown."""
        version = None
        if fresh_kv:
            entry = self.ctx.registry.live.get(cell_id)
            if entry is not None and entry.summary is not None:
                version = entry.summary.version
            elif (row := self.ctx.store.fleet.get_cell(cell_id)) is not None:
                version = row.version
        self.kv_version.setdefault(request_id, {})[cell_id] = version
        self.kv_version.move_to_end(request_id)
        while len(self.kv_version) > KV_VERSIONS_KEPT:
            self.kv_version.popitem(last=False)

    def admit(self, fx: Effects, row: CellRow, msg: RegisterRequest, admin: bool) -> None:
        """A (re-)registration: model limits, the id rule, the probe. Refusals raise before
        anything is written; the caller puts `row`."""
        ctx = self.ctx
        self._check_limits(msg.capabilities)
        self.told.setdefault(row.id, set()).update({msg.version} if msg.version is not None else set())
        if row.incarnation == msg.incarnation and row.trust == "verified":
            return  # the same process again (a scheduler restart): it proved itself already
        row.trust, row.probe = "unverified", None
        if msg.probe is None:
            return
        if not well_formed(msg.probe):
            raise Invalid("probe must be the probe's log-probs: finite, <= 0, one per predicted token")
        exact = bool(msg.capabilities.batch_invariant)
        row.probe = {"version": msg.version, "logprobs": [float(x) for x in msg.probe], "exact": exact}
        ref = ctx.store.fleet.setting(PROBE_KEY.format(msg.version))
        if ref is None and ctx.store.fleet.setting(GENESIS_KEY) is None:
            # the fleet's first probing cell: its answer is the first reference (a cell that
            # registers before every real one is the one case this trusts blindly)
            ctx.store.fleet.put_setting(GENESIS_KEY, {"cell": row.id, "version": msg.version})
            ctx.store.fleet.put_setting(PROBE_KEY.format(msg.version), row.probe)
            row.trust = "verified"
            fx.later(lambda: ctx.metrics.probes.labels("verified").inc())
            return
        if ref is not None:
            if not self._agree(ref, row.probe):
                fx.later(lambda: ctx.metrics.probes.labels("refused").inc())
                raise Conflict(f"{row.id}'s probe at version {msg.version} disagrees with the fleet's: it does not "
                               "run the fleet's model", code="probe_mismatch")
            row.trust = "verified"
            fx.later(lambda: ctx.metrics.probes.labels("verified").inc())
            return
        for peer in ctx.store.fleet.list_cells():
            p = peer.probe
            if (peer.id == row.id or peer.state == "down" or p is None or p.get("version") != msg.version
                    or not self._agree(p, row.probe)):
                continue
            ctx.store.fleet.put_setting(PROBE_KEY.format(msg.version), row.probe)
            row.trust = "verified"
            self._settle(fx, msg.version, row.probe, skip=row.id)
            log.info("version %s: %s and %s agree on the probe: both verified", msg.version, row.id, peer.id)
            return

    def readmit(self, cell_id: str) -> dict[str, Any]:
        """An admin clears a quarantine: the id may register again (unverified, probed anew)."""
        from scheduler.contract.errors import NotFound

        with self.ctx.txn(durable=True):
            row = self.ctx.store.fleet.get_cell(cell_id)
            if row is None:
                raise NotFound(f"unknown cell {cell_id!r}")
            if row.trust != "quarantined":
                raise Conflict(f"{cell_id} is not quarantined ({row.trust})", code="not_quarantined")
            row.trust, row.probe = "unverified", None
            self.ctx.store.fleet.put_cell(row)
        return row.to_api()

    def _agree(self, a: dict, b: dict) -> bool:
        return agree(a["logprobs"], b["logprobs"], bool(a.get("exact")) and bool(b.get("exact")),
                     self.ctx.cfg.verify_tolerance)

    def _settle(self, fx: Effects, version: int | None, ref: dict, skip: str) -> None:
        """A reference was just set: every unverified live cell of that version is verified or
        quarantined by it."""
        for cell in self.ctx.store.fleet.list_cells():
            p = cell.probe
            if cell.id == skip or cell.state == "down" or cell.trust != "unverified" or p is None:
                continue
            if p.get("version") != version:
                continue
            row = self.ctx.store.fleet.get_cell(cell.id)
            assert row is not None
            if self._agree(ref, p):
                row.trust = "verified"
                self.ctx.store.fleet.put_cell(row)
                fx.later(lambda: self.ctx.metrics.probes.labels("verified").inc())
            else:
                self.quarantine(fx, row, f"probe at version {version} disagrees with the fleet's")

    def _check_limits(self, caps: Capabilities) -> None:
        if not caps.vocab_size:
            return  # an engine that does not report them (the fleet's, if known, still apply)
        ranges = caps.output_ranges or []
        if caps.vocab_size < 0 or caps.max_context < 0 or not all(
                len(r) == 2 and 0 <= r[0] < r[1] <= caps.vocab_size for r in ranges):
            raise Invalid("model limits: vocab_size and max_context >= 0, output_ranges a list of [lo, hi) "
                          "inside the vocabulary")
        mine = ModelLimits.of(caps)
        if self.limits is None:
            self.limits = mine
            self.ctx.store.fleet.put_setting(MODEL_KEY, mine.to_dict())
        elif mine != self.limits:
            raise Conflict(f"model limits {mine.to_dict()} differ from the fleet's {self.limits.to_dict()}",
                           code="model_mismatch")

    def counts(self, cell_id: str, row: CellRow | None = None) -> bool:
        """Is the cell trusted: given requests, and counted toward `min_rollout_cells`?"""
        row = row or self.ctx.store.fleet.get_cell(cell_id)
        return row is not None and trusted(row.trust, row.probe is not None, self.ctx.cfg.trust_unprobed_cells)

    # ------------------------------------------------------------------ requests
    def check_request(self, new_ids: list[int], context_len: int, params: SamplingParams) -> None:
        """What a cell would refuse, refused here first (422), before anything is recorded:
        ids outside the vocabulary, a context plus max_tokens past the model's length."""
        lim = self.limits
        if lim is None:
            return
        bad = next((t for t in new_ids if not 0 <= t < lim.vocab_size), None)
        if bad is not None:
            raise Invalid(f"token id {bad} is outside the model's vocabulary [0, {lim.vocab_size})", code="bad_token")
        stop_bad = next((t for t in params.stop_token_ids if not 0 <= t < lim.vocab_size), None)
        if stop_bad is not None:
            raise Invalid(f"stop token id {stop_bad} is outside the vocabulary [0, {lim.vocab_size})", code="bad_token")
        need = context_len + params.max_tokens
        if lim.max_context and need > lim.max_context:
            raise Invalid(f"the context ({context_len} tokens) plus max_tokens ({params.max_tokens}) is "
                          f"{need}, past the model's {lim.max_context}", code="context_length_exceeded")

    # ------------------------------------------------------------------ ingest
    def invalid_records(self, cell_id: str, records: TokenRecords, allowed: set[int] | None = None) -> str | None:
        """Why a cell's sampled records cannot be true (None when they can). `allowed`: the
        versions it may tag tokens with, when the caller has them (`servable_by`). A batch that
        passes the column-wide checks (`_plausible`) is not looked at token by token."""
        if allowed is not None and self._plausible(records, allowed):
            return None
        for tok, lp, version in zip(records.token_ids, records.logprobs, records.versions):
            if not (isinstance(lp, int | float) and math.isfinite(lp) and lp <= 0):
                return f"log-prob {lp!r} is not a finite number <= 0"
            if not 0 <= tok <= TOKEN_ID_MAX:
                return f"token id {tok} is not a token id (0 to 2^31 - 1)"
            if self.limits is not None and not self.limits.sampleable(int(tok)):
                return f"token id {tok} is not one the model can sample"
            if allowed is None:
                allowed = self.servable_by(cell_id)
            if version not in allowed:
                return f"version {version} was never served to it"
        return None

    def invalid_batches(self, cell_id: str, batches: list[TokenBatch]) -> str | None:
        """Why one of a sync's batches cannot be true ("request ID: why"; None when all can):
        every batch's columns joined and judged at once (`_plausible`), batch by batch only
        when that cannot tell."""
        if not batches:
            return None
        joined = TokenRecords.joined([b.records for b in batches]) if len(batches) > 1 else batches[0].records
        if joined is not None and self._plausible(joined, self.servable_among(cell_id, joined.versions)):
            return None
        allowed = self.servable_by(cell_id)
        for b in batches:
            if (why := self.invalid_records(cell_id, b.records, allowed)) is not None:
                return f"request {b.request_id}: {why}"
        return None

    def _plausible(self, records: TokenRecords, allowed: set[int]) -> bool:
        """Every record passes `invalid_records`' rules, judged a column at a time (C speed):
        the ids by their range, the log-probs by their sum and greatest value, the versions as a
        set. False says only "look token by token"."""
        if not records:
            return True
        ids, lps = records.token_ids, records.logprobs
        try:
            if not (math.isfinite(math.fsum(lps)) and max(lps) <= 0):
                return False
            lo, hi = min(ids), max(ids)
        except (TypeError, OverflowError):
            return False
        lim = self.limits
        if lo < 0 or hi > TOKEN_ID_MAX or (lim is not None and (lim.output_ranges is not None or hi >= lim.vocab_size)):
            return False
        return set(records.versions) <= allowed

    def servable_among(self, cell_id: str, versions: Iterable[int]) -> set[int]:
        """`servable_by(cell_id) & set(versions)`, looking up only those versions (a sync's
        batches carry one or two: not every version the store ever published)."""
        want = set(versions)
        told = self.told.get(cell_id, set())
        return (want & told) | self.ctx.store.fleet.published_among(want - told)

    def servable_by(self, cell_id: str) -> set[int]:
        """Versions a cell may tag tokens with: those it registered with, and every published
        version (it may have been told any of them; a retired one's last tokens can still be
        on their way)."""
        out = set(self.told.get(cell_id, ()))
        out.update(v.v for v in self.ctx.store.fleet.list_versions())
        return out

    # ------------------------------------------------------------------ scoring cross-check
    def cross_check(self, fx: Effects, scorer: str, session_id: str, base: int, start: int, version: int | None,
                    old: list[float | None], request_id: str | None = None) -> list[float | None]:
        """A verified scorer's exact log-probs for [start, start + len(old)) of request
        `request_id` against what each token's sampler reported; returns `old` with non-finite
        values replaced by None (never stored). A contradicted sampler is quarantined."""
        ctx = self.ctx
        clean = [x if x is None or math.isfinite(x) else None for x in old]
        srow = ctx.store.fleet.get_cell(scorer)
        if srow is None or srow.trust != "verified":
            return clean
        t = ctx.store.sessions.read(session_id, base, start + len(old))
        cells = ctx.store.sessions.samplers(session_id, base, start + len(old))
        if any(m == 1 and v != version for m, v in zip(t.loss_mask, t.versions)):
            return clean  # the request changed version: its earlier KV was not this version's
        culprits: dict[str, str] = {}
        offset = start - base
        for i, x in enumerate(old):
            j = offset + i
            sampler = cells[j]
            if t.loss_mask[j] != 1 or sampler is None or sampler == scorer or sampler in culprits:
                continue
            if x is None:
                continue
            if not math.isfinite(x):
                culprits[sampler] = f"sampled token {t.token_ids[j]} that {scorer}'s exact scoring finds impossible"
                continue
            if t.truncated[j]:  # truncated (top-k/top-p): its behaviour log-prob is of another distribution
                continue
            if self.kv_version.get(request_id or "", {}).get(sampler) != version:
                continue  # its context's KV may be another version's (see the module's notes)
            srow2 = ctx.store.fleet.get_cell(sampler)
            exact = bool(srow2 and srow2.capabilities.get("batch_invariant") and srow.capabilities.get("batch_invariant"))
            if not agree([t.logprobs[j]], [x], exact, ctx.cfg.verify_tolerance):
                culprits[sampler] = (f"reported log-prob {t.logprobs[j]!r} where {scorer}'s exact scoring gives {x!r} "
                                     f"(session {session_id}, token {offset + i + base})")
        for sampler, why in culprits.items():
            row = ctx.store.fleet.get_cell(sampler)
            if row is not None and row.trust != "quarantined":
                self.quarantine(fx, row, why)
        return clean

    # ------------------------------------------------------------------ quarantine
    def quarantine(self, fx: Effects, row: CellRow, reason: str) -> None:
        """Fence the cell for what it reported, and take back what it sampled (inside the
        caller's durable transaction; the row is put here)."""
        ctx = self.ctx
        log.error("cell %s quarantined: %s", row.id, reason)
        store = ctx.store
        for session_id, first in store.sessions.sampled_by(row.id):
            self._take_back(fx, session_id, first, f"sampler {row.id} quarantined: {reason}")
        row.trust = "quarantined"
        if row.state != "down" and self.quarantine_cell is not None:
            self.quarantine_cell(fx, row, f"quarantined: {reason}")
        store.fleet.put_cell(row)
        fx.later(lambda: ctx.metrics.quarantined.inc())

    def _take_back(self, fx: Effects, session_id: str, first: int, reason: str) -> None:
        """Tokens from `first` on were sampled by a quarantined cell (or follow them). Those of
        the live request that no client was shown are removed and sampled again by a trusted
        cell from there: the session stays trainable. Otherwise a client saw some: nothing is
        removed (the store keeps what was shown), the live request goes on from there on a
        trusted cell (its client's stream does not break), and the session is never trained
        on; its unscored tokens need no score."""
        store = self.ctx.store
        if store.sessions.get(session_id) is None:
            return
        metrics = self.ctx.metrics
        req = store.owners.active_request_for_session(session_id)
        if req is not None and self.rewind_request is not None:
            n = self.rewind_request(fx, req, first, reason)
            if n is not None:
                log.warning("request %s: %d token(s) from index %d taken back to be sampled again (%s)",
                            req.id, n, first, reason)
                fx.later(lambda: metrics.tokens_resampled.inc(n))
                return
            req = store.owners.active_request_for_session(session_id)  # (a stuck one ended meanwhile)
        if req is not None and req.cell_id is not None and self.requeue_request is not None:
            self.requeue_request(fx, req, reason)  # it goes on from what its client saw, on a trusted cell
        store.sessions.taint(session_id)
        n = store.sessions.mark_missing_from(session_id, first)
        fx.later(lambda: (metrics.logprob_missing.inc(n), metrics.sessions_tainted.inc()))
