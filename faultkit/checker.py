"""Invariant checkers over a fault campaign's history and store snapshots. Pure functions:
plain dicts in, lists of violation strings out (each starts with its invariant, "I2: ...").

Shapes (what `campaign.read_store` and the clients record):

sample — one consistent read of the durable store at monotonic time `t`:
    {"t": float,
     "requests":   {rid: {"cell": str|None, "epoch": int, "state": str, "n": int,
                          "session": str, "base": int, "reason": str|None}},
     "migrations": {mid: {"request": rid, "src": str, "dst": str, "epoch": int, "state": str,
                          "path": str, "finished_at": float|None, "commit_tokens": int|None}},
     "cells":      {cid: {"state": str, "generation": int, "incarnation": str,
                          "version": int|None, "history": [[state, wall_t, detail], ...]}},
     "versions":   {v: state},  "unscored": {v: tokens with loss mask 1 and no provenance},
     "flips":      {fid: state}}
  (JSON turns int keys into strings; every function here accepts both.)

client — one completion as its client saw it:
    {"request_id": str|None, "session_id": str|None, "max_tokens": int, "tokens": [int],
     "finish_reason": str|None, "error": str|None}

outcome — one migration thread's end as a cell logged it (CELLFLIP_MIGRATION_LOG):
    {"cell", "role": "source"|"destination", "result", "migration_id", "request_id", ...}

Invariants (DESIGN "Concepts and invariants", issue 8):
  I1 every accepted request ends in exactly one terminal state (finished, or failed with a
     reason); no token duplicated or dropped between the cells, the store and the client; in
     batch-invariant mode, under one version, the tokens equal a fault-free run.
  I2 every request has exactly one owner: per snapshot (owned ⇔ owner set, owner not down,
     migrating ⇔ one pending migration from the owner at its epoch), over time (epochs never
     go back, one owner per epoch), and as the cells acted (never both the source and the
     destination of one migration continue the request; no commit from a fenced cell).
  I3 no version is retired while a token sampled under it has no old log-prob.
  I4 no cell serves, and no token carries, a version that was never completely delivered.
  I5 after a scheduler restart the state extends the last committed state (nothing
     committed is lost or goes back).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from faultkit.celllogs import CELL_LOGS
from scheduler.contract.states import FLIP, MIGRATION, REQUEST, VERSION, Machine

STORE_HISTORY = "in the store's token history"
"""Marks the violations `check_token_epochs` and `check_foreign_batches` find: the canary's
catches by the store's own history, counted apart (`canary_store_violations`)."""
OWNED = ("running", "migrating", "parked")
WAITING = ("queued", "suspended")
TERMINAL = ("finished", "failed")


def _ikeys(d: dict) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def reachable(machine: Machine, a: str, b: str) -> bool:
    """Is `b` equal to `a` or reachable from it along the machine's edges?"""
    seen, todo = {a}, [a]
    while todo:
        s = todo.pop()
        if s == b:
            return True
        for n in machine.transitions.get(s, {}):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return False


# -- one snapshot ----------------------------------------------------------------------------
def sample_problems(s: dict) -> list[str]:
    """I2 and I3 within one consistent snapshot of the store."""
    out = []
    cells = s.get("cells", {})
    pending: dict[str, list[tuple[str, dict]]] = {}
    for mid, m in s.get("migrations", {}).items():
        if m["state"] == "pending":
            pending.setdefault(m["request"], []).append((mid, m))
    for rid, r in s.get("requests", {}).items():
        st, cell = r["state"], r["cell"]
        if st in OWNED and cell is None:
            out.append(f"I2: {rid} is {st} without an owner")
        if st in WAITING and cell is not None:
            out.append(f"I2: {rid} is {st} but owned by {cell}")
        if st in OWNED and cell in cells and cells[cell]["state"] == "down":
            out.append(f"I2: {rid} is owned by {cell}, which is down (fenced)")
        ms = pending.pop(rid, [])
        if len(ms) > 1:
            out.append(f"I2: {rid} has {len(ms)} pending migrations {[m for m, _ in ms]}")
        if (st == "migrating") != bool(ms):
            out.append(f"I2: {rid} is {st} with pending migrations {[m for m, _ in ms]}")
        for mid, m in ms:
            if (m["src"], m["epoch"]) != (cell, r["epoch"]):
                out.append(f"I2: migration {mid} is from {m['src']}@{m['epoch']} but {rid} is owned by "
                           f"{cell}@{r['epoch']}")
    for rid, ms in pending.items():
        out.append(f"I2: migrations {[m for m, _ in ms]} pending for unknown request {rid}")
    unscored = _ikeys(s.get("unscored", {}))
    for v, state in _ikeys(s.get("versions", {})).items():
        if state == "retired" and unscored.get(v, 0):
            out.append(f"I3: version {v} is retired while {unscored[v]} of its tokens have no old log-prob")
    return out


# -- over time -------------------------------------------------------------------------------
class SampleChecker:
    """Feeds snapshots in time order; reports per-snapshot and temporal violations. Each
    distinct violation is reported once (with the time it was first seen)."""

    def __init__(self) -> None:
        self.req: dict[str, dict] = {}
        self.owner_at: dict[tuple[str, int], str] = {}
        self.mig: dict[str, str] = {}
        self.ver: dict[int, str] = {}
        self.flip: dict[str, str] = {}
        self.gen: dict[str, int] = {}
        self.seen: set[str] = set()

    def feed(self, s: dict) -> list[str]:
        found = sample_problems(s)
        for rid, r in s.get("requests", {}).items():
            prev = self.req.get(rid)
            if prev is not None:
                if r["epoch"] < prev["epoch"]:
                    found.append(f"I2: epoch of {rid} went back from {prev['epoch']} to {r['epoch']}")
                if r["n"] < prev["n"]:
                    found.append(f"I1: {rid} lost committed tokens: {prev['n']} -> {r['n']}")
                if not reachable(REQUEST, prev["state"], r["state"]):
                    found.append(f"I1: {rid} went {prev['state']} -> {r['state']}")
            if r["state"] in OWNED and r["cell"] is not None:
                key = (rid, r["epoch"])
                other = self.owner_at.setdefault(key, r["cell"])
                if other != r["cell"]:
                    found.append(f"I2: {rid} had two owners at epoch {r['epoch']}: {other} and {r['cell']}")
            self.req[rid] = r
        for mid, m in s.get("migrations", {}).items():
            prev_state = self.mig.get(mid)
            if prev_state is not None and not reachable(MIGRATION, prev_state, m["state"]):
                found.append(f"I2: migration {mid} went {prev_state} -> {m['state']}")
            self.mig[mid] = m["state"]
        for v, state in _ikeys(s.get("versions", {})).items():
            prev_state = self.ver.get(v)
            if prev_state is not None and not reachable(VERSION, prev_state, state):
                found.append(f"I3: version {v} went {prev_state} -> {state}")
            self.ver[v] = state
        for fid, state in s.get("flips", {}).items():
            prev_state = self.flip.get(fid)
            if prev_state is not None and not reachable(FLIP, prev_state, state):
                found.append(f"I5: flip {fid} went {prev_state} -> {state}")
            self.flip[fid] = state
        for cid, c in s.get("cells", {}).items():
            if c["generation"] < self.gen.get(cid, 0):
                found.append(f"I2: generation of {cid} went back {self.gen[cid]} -> {c['generation']}")
            self.gen[cid] = c["generation"]
        new = [v for v in found if v not in self.seen]
        self.seen.update(new)
        return new


def check_samples(samples: Iterable[dict]) -> list[str]:
    c = SampleChecker()
    out: list[str] = []
    for s in samples:
        out += c.feed(s)
    return out


def down_intervals(history: list) -> list[tuple[float, float]]:
    """[(down since, until the next incarnation joined)] from a cell's state history."""
    out, since = [], None
    for state, t, *_ in history:
        if state == "down" and since is None:
            since = t
        elif state != "down" and since is not None:
            out.append((since, t))
            since = None
    if since is not None:
        out.append((since, float("inf")))
    return out


def check_fenced_commits(s: dict) -> list[str]:
    """I2: no KV migration is committed while its destination was fenced (a zombie's stale
    commit). Uses the store's own wall-clock marks (migration finished_at, cell history)."""
    out = []
    cells = s.get("cells", {})
    for mid, m in s.get("migrations", {}).items():
        if m["state"] != "committed" or m.get("path") != "kv" or m.get("finished_at") is None:
            continue
        for a, b in down_intervals(cells.get(m["dst"], {}).get("history", [])):
            if a < m["finished_at"] < b:
                out.append(f"I2: migration {mid} of {m['request']} committed by {m['dst']} at {m['finished_at']:.3f} "
                           f"while {m['dst']} was fenced (down since {a:.3f})")
    return out


def check_token_epochs(requests: dict[str, dict], migrations: dict[str, dict],
                       epochs: dict[str, list[tuple[int, int | None]]]) -> list[str]:
    """I2 in the store's own token history: once a migration committed request r at its
    commit point (`commit_tokens` generated tokens), every sampled token of r past that point
    was accepted under a later epoch; a token at the old epoch or older there is a fenced
    owner's token the store took (a split owner's duplicate). `epochs`: per session, the
    (index, epoch) of its sampled tokens (`read_store`'s `token_epochs`)."""
    out = []
    for mid, m in sorted(migrations.items()):
        k = m.get("commit_tokens")
        r = requests.get(m["request"])
        if m["state"] != "committed" or k is None or r is None:
            continue
        start = r["base"] + k
        stale = [i for i, e in epochs.get(r["session"], []) if i >= start and e is not None and e <= m["epoch"]]
        if stale:
            out.append(f"I2: {STORE_HISTORY}, {m['request']} has {len(stale)} token(s) at epoch <= {m['epoch']} from index "
                       f"{stale[0]}, after {mid} committed it to epoch {m['epoch'] + 1} at index {start}")
    return out


def check_foreign_batches(rows: Iterable[dict]) -> list[str]:
    """I2 in the store's own token history: every batch it took from a cell that was not the
    request's owner at its epoch (`read_store`'s `foreign_batches`; duplicates included)."""
    return [f"I2: {STORE_HISTORY}, {r['request']} took {r['count']} token(s) ({r['new']} new, from index "
            f"{r['start']}) from {r['cell']}@{r['epoch']} while {r['owner']}@{r['owner_epoch']} owned it"
            for r in rows]


def check_migration_outcomes(outcomes: Iterable[dict], migrations: dict[str, dict]) -> list[str]:
    """I2 as the cells acted: per migration, exactly one of source and destination goes on
    with the request, and it is the one the store's record names."""
    by: dict[str, dict[str, list[str]]] = {}
    for o in outcomes:
        by.setdefault(o["migration_id"], {}).setdefault(o["role"], []).append(o["result"])
    out = []
    for mid, roles in sorted(by.items()):
        src, dst = roles.get("source", []), roles.get("destination", [])
        state = migrations.get(mid, {}).get("state")
        rid = migrations.get(mid, {}).get("request", "?")
        if "aborted" in src and "committed" in dst:
            out.append(f"I2: {CELL_LOGS}, split ownership of {rid}: the source of {mid} resumed it and the "
                       "destination committed it")
        elif "aborted" in src and state == "committed":
            out.append(f"I2: the source of {mid} resumed {rid} after the commit won")
        elif "committed" in dst and state == "aborted":
            out.append(f"I2: the destination of {mid} resumed {rid} but the store aborted the migration")
    return out


# -- requests --------------------------------------------------------------------------------
def check_request(client: dict, final: dict | None, rows: list[tuple] | None,
                  reference: list[int] | None) -> tuple[list[str], bool]:
    """I1 for one accepted request. `final` is its store row (None: unknown to the store),
    `rows` its generated token rows `(token_id, loss_mask, version, provenance)` in index
    order, `reference` the fault-free tokens where exactness is promised (else None).
    Returns (violations, lost)."""
    rid = client.get("request_id")
    if rid is None:
        return [], False  # never accepted (429, or the scheduler was down)
    if final is None:
        return [f"I1: accepted request {rid} is unknown to the store"], True
    out: list[str] = []
    state, n = final["state"], final["n"]
    if state not in TERMINAL:
        return [f"I1: {rid} never reached a terminal state (still {state} with {n} tokens)"], True
    if state == "failed" and not final.get("reason"):
        out.append(f"I1: {rid} failed without a reason a client can see")
    rows = rows or []
    ids = [r[0] for r in rows]
    if len(rows) != n:
        out.append(f"I1: {rid} records {n} generated tokens but the buffer holds {len(rows)}")
    if any(r[1] != 1 for r in rows):
        out.append(f"I1: {rid} has generated tokens without loss mask 1")
    if n > client["max_tokens"]:
        out.append(f"I1: {rid} has {n} tokens, more than max_tokens={client['max_tokens']} (duplicated)")
    if state == "finished" and final.get("reason") == "length" and n != client["max_tokens"]:
        out.append(f"I1: {rid} finished by length with {n} of {client['max_tokens']} tokens (dropped)")
    seen = client.get("tokens") or []
    if seen != ids[: len(seen)]:
        k = next((i for i, (a, b) in enumerate(zip(seen, ids, strict=False)) if a != b), min(len(seen), len(ids)))
        out.append(f"I1: the client of {rid} saw {len(seen)} tokens that are not a prefix of the store's {len(ids)} "
                   f"(first difference at {k})")
    elif client.get("finish_reason") and len(seen) != len(ids):
        out.append(f"I1: the client of {rid} got its finish after {len(seen)} of {len(ids)} tokens")
    if reference is not None and state == "finished" and ids != reference[: len(ids)]:
        k = next((i for i, (a, b) in enumerate(zip(ids, reference, strict=False)) if a != b), len(ids))
        out.append(f"I1: {rid} differs from the fault-free run at token {k} of {len(ids)}")
    elif reference is not None and state == "finished" and final.get("reason") == "length" and len(ids) != len(reference):
        out.append(f"I1: {rid} has {len(ids)} tokens, the fault-free run {len(reference)}")
    return out, False


CLIENT_VS_TRAINER = "I6:"
"""The prefix of violations found by comparing what clients received with what the trainer
is handed: independent of the store's own bookkeeping (its rows, its epochs, its history)."""


def check_client_vs_trainer(prompt: list[int], got: list[int], finished: bool, session: dict | None,
                            rid: str) -> list[str]:
    """The tokens one client received against the session the trainer reads
    (`GET /v1/sessions/{id}`: token ids and loss mask): the prompt, then exactly the client's
    tokens, each sampled (mask 1). A token the client got that the trainer does not (a gap or
    a changed token), one the trainer gets that the client never saw after it finished (a
    duplicate or a foreign token), or a prompt that is not the client's is a violation."""
    if session is None:
        return [f"{CLIENT_VS_TRAINER} the trainer is not handed {rid}'s session"] if got else []
    ids, mask = session["token_ids"], session["loss_mask"]
    out = []
    if ids[: len(prompt)] != prompt:
        out.append(f"{CLIENT_VS_TRAINER} {rid}: the trainer's session does not start with the client's prompt")
        return out
    gen, gen_mask = ids[len(prompt):], mask[len(prompt):]
    if gen[: len(got)] != got:
        k = next((i for i, (a, b) in enumerate(zip(got, gen, strict=False)) if a != b), min(len(got), len(gen)))
        out.append(f"{CLIENT_VS_TRAINER} {rid}: token {k} the client received is not the trainer's "
                   f"({len(got)} received, {len(gen)} handed to the trainer)")
    elif finished and len(gen) != len(got):
        out.append(f"{CLIENT_VS_TRAINER} {rid}: the trainer is handed {len(gen) - len(got)} tokens the client "
                   "never received (duplicated or foreign)")
    if any(m != 1 for m in gen_mask):
        out.append(f"{CLIENT_VS_TRAINER} {rid}: the trainer would train on tokens no client was sampled")
    return out


def single_version(rows: list[tuple]) -> int | None:
    """The one version every generated token carries, or None (none, or a mix)."""
    vs = {r[2] for r in rows}
    return vs.pop() if len(vs) == 1 else None


# -- versions --------------------------------------------------------------------------------
def check_versions(served: Iterable[tuple[str, int | None]], token_versions: Iterable[int | None],
                   complete: Iterable[int], partial: Iterable[int]) -> list[str]:
    """I4: every version a cell reported serving and every version a token carries was
    completely delivered (`complete`: versions the trainer held and delivered); none of the
    `partial` ones (whose only source died mid-broadcast) ever is."""
    ok, bad = set(complete), set(partial) - set(complete)
    out = []
    for cell, v in sorted(set(served), key=str):
        if v is not None and (v in bad or v not in ok):
            out.append(f"I4: {cell} served version {v}, which was never completely delivered")
    for v in sorted({v for v in token_versions if v is not None}):
        if v in bad or v not in ok:
            out.append(f"I4: tokens were sampled under version {v}, which was never completely delivered")
    return out


# -- restart ---------------------------------------------------------------------------------
def check_restart(before: dict, after: dict) -> list[str]:
    """I5: `before` is the store as the killed scheduler left it (flips, versions, cells,
    sessions: {sid: [token ids]}); `after` the same as the restarted scheduler serves it
    (read through its API). Every committed thing is there, the same or moved forward."""
    out = []
    for fid, state in before.get("flips", {}).items():
        now = after.get("flips", {}).get(fid)
        if now is None:
            out.append(f"I5: flip {fid} ({state}) is gone after the restart")
        elif not reachable(FLIP, state, now):
            out.append(f"I5: flip {fid} went {state} -> {now} across the restart")
    bv, av = _ikeys(before.get("versions", {})), _ikeys(after.get("versions", {}))
    for v, state in bv.items():
        if v not in av:
            out.append(f"I5: version {v} ({state}) is gone after the restart")
        elif not reachable(VERSION, state, av[v]):
            out.append(f"I5: version {v} went {state} -> {av[v]} across the restart")
    for sid, ids in before.get("sessions", {}).items():
        now = after.get("sessions", {}).get(sid)
        if now is None:
            out.append(f"I5: session {sid} is gone after the restart")
        elif now[: len(ids)] != ids:
            out.append(f"I5: session {sid} had {len(ids)} committed tokens; after the restart they differ")
    for cid, g in before.get("generations", {}).items():
        if after.get("generations", {}).get(cid, g) < g:
            out.append(f"I5: generation of {cid} went back across the restart")
    for rid, r in before.get("requests", {}).items():
        a = after.get("requests", {}).get(rid)
        if a is None:
            out.append(f"I5: request {rid} is gone after the restart")
        elif a["epoch"] < r["epoch"] or a["n"] < r["n"] or not reachable(REQUEST, r["state"], a["state"]):
            out.append(f"I5: request {rid} went back across the restart: {r} -> {a}")
    return out


# -- recovery --------------------------------------------------------------------------------
def recovery_s(samples: list[dict], t_fault: float, request_ids: Iterable[str],
               in_flight_s: float = 0.3) -> float | None:
    """Seconds from the fault until every listed request that was unfinished at the fault
    made progress (a token committed) or ended; 0.0 if none was unfinished; None if one never
    did within the samples. Tokens sampled before the fault may still land within
    `in_flight_s` (one sync): progress is counted from the store as it was then."""
    t_base = t_fault + in_flight_s
    before = [s for s in samples if s["t"] <= t_base]
    after = [s for s in samples if s["t"] > t_base]
    base = before[-1]["requests"] if before else (after[0]["requests"] if after else {})
    worst = 0.0
    for rid in request_ids:
        r0 = base.get(rid)
        if r0 is None or r0["state"] in TERMINAL:
            continue
        t = next((s["t"] for s in after if (r := s["requests"].get(rid)) is not None
                  and (r["n"] > r0["n"] or r["state"] in TERMINAL)), None)
        if t is None:
            return None
        worst = max(worst, t - t_fault)
    return worst
