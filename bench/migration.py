"""Live KV migration of one request between two cell processes, across context lengths, as
its client feels it.

A real scheduler (SQLite, synchronous=FULL) and two real cells (tiny preset, batch-invariant
mode). For each context: a streamed request decodes on the source; the other cell joins
rollout and the owner flips to training, so the request moves with its KV and keeps
decoding on the destination; then back again, MOVES times in all (5 with --quick, 9
without). Every per-point figure is the median over its moves: the machine is shared, one
move is one sample of its noise.

Client-visible stall of one move (arrival instants are the client's wall clock):
- the move's window runs from the flip command (the bench's POST, before the scheduler even
  sends `migrate_out`) to the 32nd token after the destination's commit;
- typical gap = span / count of the tokens that arrived in the 2 s before the command
  (tokens arrive in small bursts, one per sync: a median of per-token gaps would be 0);
- excess = the largest inter-token gap in the window minus the typical gap; excess_total =
  the sum over the window's gaps of what each exceeds the typical gap by;
- a control request of the same context, never moved, decodes on a cell after the moves and
  gives the same figures over the same token indices (its own typical gap from its own 2 s
  before the window): what the stream's ordinary burstiness contributes;
- stall_over_control = excess(moved) - excess(control); stall_total_ms likewise from
  excess_total.
Per point: stall_max_ms = the largest excess(moved) over the point's moves (the worst a moved
stream's client felt: its largest gap minus its own typical gap), stall_p50_ms its median,
stall_over_control_ms the median control-subtracted figure (what the move adds to the stream's
ordinary burstiness), stall_total_ms (median), downtime_ms (the hand-over gap, located by token
index: from the last token the source synced to the next one, minus the typical gap), and the
raw figures behind them (moved_/control_excess_ms: medians; stall_all_ms: every move's excess;
worst_gap_phase: where each move's largest gap lay — `flip` before the source joined the
transfer, `copy` during the copy rounds, `hand-over` from the stop to the destination's resume,
`after` on the destination; `+` when it spans into the next phase).

Transfer rate, like for like:
- gbps: a move's KV bytes over the time its messages spent on the link, each message from
  the instant the source began sending it (the receive is posted) to the instant the
  destination had all of it (cells' migration records, `sends`);
- raw_p2p_gbps: the same message sizes, one repetition per move, over a plain pair channel
  between the same two cell processes, timed between the same two points, each message under
  the same decode pause as a copy round, while the control request decodes on the sender
  (cells/transport/probe.py); raw_under_load says the control was still decoding when the
  reference finished (it decodes PROBE_TOKENS past the moved request's length for that).

recompute_ms: the median of 3 warm re-prefills of the same context in the mode the cells run
(an identical in-process engine, batch-invariant as the shipped configs serve, after a full
cold run of the request that also gives the never-moved reference), time to the first token:
what a move without its KV would cost; recompute_fast_ms the same with the fast kernels (not
token-exact). token_exact: every moved stream equals that reference token for token.

Summary: stall_flatness_ms = stall_max_ms(largest context) - stall_max_ms(smallest);
recompute_over_stall_8k = recompute_ms / stall_max_ms at 8k (the stall floored at 1 ms), and
recompute_fast_over_stall_8k with the fast re-prefill;
gbps_over_raw_largest. Targets: bench/targets.yaml (`finish` judges them; exit 1 on a miss).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import Timer, finish, parse_args, set_threads

from cells.localcluster import Cluster, Streamer, find_free_port
from scheduler.contract.config import parse_config

CONTEXTS = [1024, 2048, 4096, 8192, 16384]
HISTORY_S = 2.0
"""Decoding before each command: the typical gap is measured over it."""
AFTER_COMMIT = 32
"""Tokens after the commit that close a move's window."""
PROBE_TOKENS = 64
"""Tokens the control decodes beyond the moved request's length, so that it still decodes
while the raw link reference runs after its window (a few seconds at 16k)."""
TOKENS_PER_MOVE = {1024: 480, 2048: 400, 4096: 320, 8192: 260, 16384: 230}
"""Generated tokens allotted to one move (the flip that readies the destination, HISTORY_S of
decoding, the move, AFTER_COMMIT tokens): a move's use grows with the decode rate and with
the flips' times, and a stream that runs out inside a window ends the bench, so this leaves
2-2.5x the mean use per move measured here (160, 136, 125, 100, 79 tokens at 1k..16k; each
move's use is printed). The tokens left after the last window decode before the control
starts: they cost time, not accuracy."""
WARM_RECOMPUTES = 3


def make_cfg(tmp: Path) -> dict:
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 60.0, "min_rollout_cells": 1,
                      "drain_deadline_s": 120.0},
        "cells": {"count": 2, "engine": {"type": "embedded", "model": {"preset": "tiny"}, "num_blocks": 1400,
                                         "block_size": 16, "max_running": 4, "prefill_chunk": 1024,
                                         "batch_invariant": True}},
        "migration": {"transfer_timeout_s": 60.0, "max_copy_rounds": 4, "stop_copy_blocks": 2},
    }


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(mig_log: Path, rid: str, role: str, k: int, timeout_s: float = 30) -> dict:
    """The k-th committed outcome of `rid` on `role`'s side (records land as threads are reaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [r for r in read_log(mig_log) if r["request_id"] == rid and r["role"] == role and r["result"] == "committed"]
        if len(recs) > k:
            return recs[k]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no committed {role} record #{k} of {rid} in {mig_log}")
        time.sleep(0.01)


def count_after(wall: list[float], t: float) -> int:
    return sum(1 for w in wall if w > t)


def move_requests(c: Cluster, src: str, dst: str, prompt: list[int], seed: int, moves: int, mig_log: Path) -> dict:
    """One request moved `moves` times between the two cells; returns the stream and each
    move's command instant and its two migration records."""
    assert c.cell(src)["state"] == "rollout" and c.cell(dst)["state"] == "training"
    max_tokens = moves * TOKENS_PER_MOVE[len(prompt)]
    s = Streamer(c.url, prompt, max_tokens=max_tokens, seed=seed, timeout_s=1200, token=c.agent_token)
    s.start()
    c.wait(lambda: len(s.tokens) >= 2, 600, "decoding on the source", every=0.01)
    quiet_from = s.wall_times[0]
    done = []
    for k in range(moves):
        assert c.wait_flip(c.flip(dst, "rollout")["id"], 120)["state"] == "done"
        c.wait(lambda q=quiet_from: s.wall_times[-1] - q >= HISTORY_S, 120, "decoding history", every=0.01)
        if s.finish_reason or s.error:
            raise RuntimeError(f"the stream ended after {len(s.tokens)} tokens, before move {k}: "
                               f"raise TOKENS_PER_MOVE[{len(prompt)}]")
        t_cmd = time.time()
        flip = c.wait_flip(c.flip(src, "training")["id"], 600)
        assert flip["state"] == "done" and flip["migrated"] == 1, flip
        out_src, out_dst = outcome(mig_log, s.request_id, "source", k), outcome(mig_log, s.request_id, "destination", k)
        commit = out_dst["marks"]["committed"]
        c.wait(lambda t=commit: count_after(s.wall_times, t) >= AFTER_COMMIT or s.finish_reason is not None, 600,
               "tokens after the commit", every=0.01)
        if count_after(s.wall_times, commit) < AFTER_COMMIT:
            raise RuntimeError(f"the stream ended inside move {k}'s window: raise TOKENS_PER_MOVE[{len(prompt)}]")
        done.append({"command": t_cmd, "source": out_src, "destination": out_dst})
        print(f"# {len(prompt)}: move {k} done after {len(s.tokens)} of {max_tokens} tokens", flush=True)
        quiet_from = s.wall_times[-1]
        src, dst = dst, src
    s.join(1200)
    assert s.error is None and len(s.tokens) == max_tokens, (s.error, len(s.tokens))
    return {"stream": s, "moves": done}


def typical_gap(wall: list[float], until: float) -> float:
    """span / count of the arrivals in the HISTORY_S before `until`."""
    seen = [w for w in wall if until - HISTORY_S <= w <= until]
    if len(seen) < 2:
        raise RuntimeError(f"{len(seen)} tokens in the {HISTORY_S} s before the window: no typical gap")
    return (seen[-1] - seen[0]) / (len(seen) - 1)


def excess(wall: list[float], first: int, last: int, typical: float) -> tuple[float, float]:
    """(largest gap - typical, sum of each gap's excess) over the gaps ending at token
    indices first..last."""
    gaps = [wall[j] - wall[j - 1] for j in range(first, last + 1)]
    return max(gaps) - typical, sum(max(0.0, g - typical) for g in gaps)


def phase_of(t0: float, t1: float, m: dict) -> str:
    """Where a gap (t0, t1) of the moved stream lies in its move: before the source joined the
    transfer (the flips), during the copy rounds, from the stop to the destination's resume (the
    hand-over), or after it (the destination decoding)."""
    src, dst = m["source"]["marks"], m["destination"]["marks"]
    edges = [("flip", src.get("joined")), ("copy", src.get("stop_requested")), ("hand-over", dst.get("resumed"))]
    for name, end in edges:
        if end is not None and t0 < end:
            return name if t1 <= end or name == "hand-over" else f"{name}+"
    return "after"


def stalls(moved: list[float], control: list[float], moves: list[dict]) -> list[dict]:
    out = []
    for m in moves:
        t_cmd, commit = m["command"], m["destination"]["marks"]["committed"]
        first = next(j for j, w in enumerate(moved) if w > t_cmd)  # the first gap ending in the window
        last = next(j for j, w in enumerate(moved) if w > commit) + AFTER_COMMIT - 1
        typ = typical_gap(moved, t_cmd)
        mx, tot = excess(moved, first, last, typ)
        worst = max(range(first, last + 1), key=lambda j: moved[j] - moved[j - 1])
        c_typ = typical_gap(control, control[first - 1])
        c_mx, c_tot = excess(control, first, last, c_typ)
        k = m["source"]["num_generated"]  # tokens before k came through the source
        out.append({"stall_s": mx - c_mx, "stall_total_s": tot - c_tot, "moved_excess_s": mx,
                    "control_excess_s": c_mx, "downtime_s": moved[k] - moved[k - 1] - typ,
                    "window_tokens": last - first + 1, "total_s": m["source"]["total_s"],
                    "worst_gap_phase": phase_of(moved[worst - 1], moved[worst], m)})
    return out


def link_rate(sends: list, recvs: list) -> tuple[float, int]:
    """(seconds on the link, bytes) of one move's KV messages, each from the send's start to
    the receiver having the bytes."""
    assert [b for _, b in sends] == [b for _, b in recvs], (sends, recvs)
    return sum(r - s for (s, _), (r, _) in zip(sends, recvs)), sum(b for _, b in sends)


class Probe:
    """The bench's end of cells/transport/probe.py."""

    def __init__(self, d: Path) -> None:
        self.dir, self.seq = d, 0
        d.mkdir(parents=True, exist_ok=True)

    def run(self, reps: list[list[int]], timeout_s: float = 300) -> list[list[list[float]]]:
        req, out = self.dir / f"probe-{self.seq}.json", self.dir / f"probe-{self.seq}.out.json"
        tmp = req.with_suffix(".tmp")
        tmp.write_text(json.dumps({"reps": reps, "warmup": True}))
        os.replace(tmp, req)
        deadline = time.monotonic() + timeout_s
        while not out.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"link probe {self.seq} did not answer")
            time.sleep(0.02)
        self.seq += 1
        res = json.loads(out.read_text())
        if res.get("error"):
            raise RuntimeError(f"link probe failed: {res['error']}")
        return res["reps"]


def control_and_reference_link(c: Cluster, probe: Probe, prompt: list[int], seed: int, max_tokens: int,
                               upto: int, reps: list[list[int]]) -> tuple[Streamer, list, bool]:
    """The control request on cell-0 (never moved); once it has passed token `upto`, the raw
    link reference runs cell-0 → cell-1 while it decodes."""
    layout(c, "cell-0", "cell-1")
    s = Streamer(c.url, prompt, max_tokens=max_tokens, seed=seed, timeout_s=1200, token=c.agent_token)
    s.start()
    c.wait(lambda: len(s.tokens) > upto or s.finish_reason is not None, 1200, "the control's window", every=0.01)
    if len(s.tokens) <= upto:
        raise RuntimeError(f"the control ended at {len(s.tokens)} tokens, before token {upto}")
    raw = probe.run(reps)
    under_load = s.finish_reason is None and s.error is None
    s.join(1200)
    assert s.error is None and len(s.tokens) == max_tokens, (s.error, len(s.tokens))
    return s, raw, under_load


def layout(c: Cluster, rollout: str, training: str) -> None:
    """`rollout` serves alone, `training` trains (the previous request has ended)."""
    if c.cell(rollout)["state"] != "rollout":
        assert c.wait_flip(c.flip(rollout, "rollout")["id"], 120)["state"] == "done"
    if c.cell(training)["state"] != "training":
        assert c.wait_flip(c.flip(training, "training")["id"], 120)["state"] == "done"


def recompute_and_reference(cfg: dict, rid: str, prompt: list[int], seed: int, max_tokens: int,
                            warm: int) -> tuple[list[float], list[int]]:
    """The never-moved reference (a full cold run, which also warms the engine), then `warm`
    re-prefills of the same prompt timed to their first token."""
    from cells.engine.embedded import EmbeddedEngine
    from cells.engine.records import SamplingParams

    eng = EmbeddedEngine(parse_config(cfg).cells.engine)
    eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
    ref: list[int] = []
    while eng.has_work():
        ref += [e.record.token_id for e in eng.step()]
    times = []
    for i in range(warm):
        wid = f"{rid}-warm-{i}"
        eng.add_request(wid, prompt, SamplingParams(max_tokens=2, seed=seed))
        with Timer() as t:
            while not eng.step():
                pass
        times.append(t.s)
        while eng.has_work():
            eng.step()
    return times, ref


def med(xs) -> float:
    return statistics.median(xs)


def main() -> None:
    args = parse_args(__doc__, lambda ap: ap.add_argument(
        "--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated context lengths (smoke runs)"))
    set_threads(1)
    contexts = [int(x) for x in args.contexts.split(",")]
    moves = 5 if args.quick else 9
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-migration-"))
    print(f"work dir {tmp}", flush=True)
    cfg = make_cfg(tmp)
    mig_log = tmp / "migrations.jsonl"
    probe_port, probe = find_free_port(), Probe(tmp / "probe")
    spec = lambda rank: ["--p2p-probe", json.dumps({"rank": rank, "port": probe_port, "dir": str(probe.dir)})]
    env = {i: {"CELLFLIP_MIGRATION_LOG": str(mig_log)} for i in range(2)}
    c = Cluster(tmp, num_cells=2, cfg=cfg, cell_env=env, cell_args={0: spec(0), 1: spec(1)}, ready_timeout_s=600)
    rng = random.Random(0)
    points, runs = [], []
    t_start = time.monotonic()
    try:
        cells = ["cell-0", "cell-1"]
        for k, n in enumerate(contexts):
            src, dst = cells[k % 2], cells[(k + 1) % 2]
            layout(c, src, dst)  # the request lands on src
            prompt = [rng.randrange(8000) for _ in range(n)]
            r = move_requests(c, src, dst, prompt, seed=k, moves=moves, mig_log=mig_log)
            s, mv = r["stream"], r["moves"]
            last = max(next(j for j, w in enumerate(s.wall_times) if w > m["destination"]["marks"]["committed"])
                       for m in mv) + AFTER_COMMIT
            sizes = [[b for _, b in m["source"]["sends"]] for m in mv]
            ctl, raw, under_load = control_and_reference_link(c, probe, [rng.randrange(8000) for _ in range(n)],
                                                              seed=1000 + k, max_tokens=len(s.tokens) + PROBE_TOKENS,
                                                              upto=last,
                                                              reps=sizes)
            per = stalls(s.wall_times, ctl.wall_times, mv)
            links = [link_rate(m["source"]["sends"], m["destination"]["sends"]) for m in mv]
            raws = [link_rate([[a, b] for (a, _), b in zip(rep, sz)], [[e, b] for (_, e), b in zip(rep, sz)])
                    for rep, sz in zip(raw, sizes)]
            ms = lambda key, per=per: round(med(p[key] for p in per) * 1e3, 2)
            points.append({
                "context_tokens": n, "moves": moves,
                "stall_max_ms": round(max(p["moved_excess_s"] for p in per) * 1e3, 2),
                "stall_p50_ms": ms("moved_excess_s"), "stall_over_control_ms": ms("stall_s"),
                "stall_total_ms": ms("stall_total_s"),
                "downtime_ms": ms("downtime_s"), "moved_excess_ms": ms("moved_excess_s"),
                "control_excess_ms": ms("control_excess_s"), "window_tokens": med(p["window_tokens"] for p in per),
                "total_ms": ms("total_s"), "bytes": int(med(b for _, b in links)),
                "transfer_ms": round(med(t for t, _ in links) * 1e3, 2),
                "gbps": round(med(b / t / 1e9 for t, b in links), 3),
                "raw_transfer_ms": round(med(t for t, _ in raws) * 1e3, 2),
                "raw_p2p_gbps": round(med(b / t / 1e9 for t, b in raws), 3), "raw_under_load": under_load,
                "stall_all_ms": [round(p["moved_excess_s"] * 1e3, 1) for p in per],
                "stall_over_control_all_ms": [round(p["stall_s"] * 1e3, 1) for p in per],
                "worst_gap_phase": [p["worst_gap_phase"] for p in per]})
            runs.append((s, prompt, k))
            print(json.dumps(points[-1]), flush=True)
    finally:
        c.stop()
    exact = negative_ok = True
    for (s, prompt, k), p in zip(runs, points):
        times, ref = recompute_and_reference(cfg, s.request_id, prompt, k, len(s.tokens), WARM_RECOMPUTES)
        p["recompute_ms"] = round(med(times) * 1e3, 1)
        p["recompute_all_ms"] = [round(t * 1e3, 1) for t in times]
        fast = json.loads(json.dumps(cfg))
        fast["cells"]["engine"]["batch_invariant"] = False
        fast_times, _ = recompute_and_reference(fast, s.request_id, prompt, k, 2, WARM_RECOMPUTES)
        p["recompute_fast_ms"] = round(med(fast_times) * 1e3, 1)
        p["token_exact"] = ref == s.tokens
        exact &= p["token_exact"]
        # the negative control: the same comparison with one moved token altered must fail
        altered = list(s.tokens)
        altered[len(altered) // 2] += 1
        negative_ok &= ref != altered
        print(json.dumps({"context_tokens": p["context_tokens"], "recompute_ms": p["recompute_ms"],
                          "token_exact": p["token_exact"]}), flush=True)
    first, last = points[0], points[-1]
    result = {"points": points, "token_exact": exact, "token_exact_negative_ok": negative_ok, "moves": moves,
              "stall_flatness_ms": round(last["stall_max_ms"] - first["stall_max_ms"], 2),
              "gbps_over_raw_largest": round(last["gbps"] / last["raw_p2p_gbps"], 3)}
    p8 = next((p for p in points if p["context_tokens"] == 8192), None)
    result["recompute_over_stall_8k"] = round(p8["recompute_ms"] / max(p8["stall_max_ms"], 1.0), 1) if p8 else None
    result["recompute_fast_over_stall_8k"] = (round(p8["recompute_fast_ms"] / max(p8["stall_max_ms"], 1.0), 1)
                                              if p8 else None)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    finish(result, args, "migration")


if __name__ == "__main__":
    main()
