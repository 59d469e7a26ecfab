"""A flood of maximum-size and malformed requests against a local fleet, while a control session
streams: does one bad request hurt the fleet?

A scheduler and three cells (the small test model) on this machine. A control client streams
long completions, one after another, with its own agent token. For the flood's duration,
FLOODERS client processes, each with an agent token of its own (so the control's budget is not
theirs), send back to back: chat turns
whose one user message fills the body limit (rendered and tokenised, then refused: the prompt
does not fit the model), bodies of exactly the limit that are not JSON, invalid UTF-8 (raw
surrogate bytes), nesting past the parser's depth, bodies over the limit (413), a /v1/generate
of a million token ids, and calls with a wrong token (401) or out of scope (403). A prober
GETs /healthz every PROBE_S. The flooding processes run niced (FLOODER_NICE): in a fleet they
are agent sandboxes on machines of their own, and what is measured is what handling their
requests costs the fleet.

Also reported, to say where a gap comes from: the scheduler's 100 ms event-loop beats during the
flood and how many ran more than 50 / 100 ms late (`cellflip_event_loop_lag_seconds`).

Reported (`--json`, last line): `cells_fenced` (cells fenced during the flood, from the
scheduler's `cellflip_cells_fenced_total`), `healthz_p99_ms`, the control stream's
`control_gap_max_ms` and `control_gap_typical_ms` (median) and `control_gap_ok` (largest gap
<= 2 x typical + 100 ms), `flood_requests` by status, and `flood_5xx`. Their goals are in
bench/targets.yaml (`targets`, `all_met`; exit 1 on a miss).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from common import ROOT, finish, parse_args

from cells.localcluster import SMALL_MODEL, Cluster, Streamer

FLOODERS = 4
FLOODER_NICE = 10
PROBE_S = 0.1
BODY_LIMIT = 8 << 20
"""The scheduler's `max_body_bytes` (the default)."""
CONTROL_TOKENS = 8000
"""Tokens of one control completion (the small model's context is 8,192)."""


def _cfg(tmp: Path) -> dict:
    return {
        "scheduler": {"db_path": str(tmp / "db.sqlite"), "lease_s": 10.0, "heartbeat_s": 0.25,
                      "min_rollout_cells": 1, "max_body_bytes": BODY_LIMIT},
        "cells": {"count": 3, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 512,
                                         "block_size": 16, "batch_invariant": True}},
    }


def _attacks(rng: random.Random) -> list[tuple[str, str, dict]]:
    """(name, path, httpx kwargs) of one round of the flood; bodies built once."""
    big_text = "".join(rng.choice("abcdefghij klmnop") for _ in range(BODY_LIMIT - 200))
    chat = json.dumps({"messages": [{"role": "user", "content": big_text}], "max_tokens": 4}).encode()
    assert len(chat) <= BODY_LIMIT
    ids = json.dumps({"prompt_ids": [rng.randrange(1000) for _ in range(1_000_000)], "max_tokens": 4}).encode()
    ids = ids if len(ids) <= BODY_LIMIT else json.dumps({"prompt_ids": [7] * 1_000_000, "max_tokens": 4}).encode()
    js = {"content-type": "application/json"}
    return [
        ("max_chat", "/v1/chat/completions", {"content": chat, "headers": js}),
        ("not_json", "/v1/chat/completions", {"content": b"{" * (BODY_LIMIT - 10), "headers": js}),
        ("raw_surrogate", "/v1/generate", {"content": b'{"prompt_ids": [1], "x": "\xed\xa0\x80"}', "headers": js}),
        ("deep", "/v1/generate", {"content": b"[" * 100_000 + b"]" * 100_000, "headers": js}),
        ("over_limit", "/v1/chat/completions", {"content": b" " * (BODY_LIMIT + 1), "headers": js}),
        ("million_ids", "/v1/generate", {"content": ids, "headers": js}),
        ("wrong_token", "/v1/flips", {"json": {"count": 3, "to": "training"},
                                      "headers": {"Authorization": "Bearer nope"}}),
        ("out_of_scope", "/v1/flips", {"json": {"count": 3, "to": "training"}}),
    ]


def _loop_lag(c: Cluster) -> dict[str, float]:
    """The scheduler's event-loop lag histogram: cumulative beat counts by upper bound."""
    out = {}
    for line in c.http.get("/metrics").text.splitlines():
        if line.startswith("cellflip_event_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
    return out


def _fenced(c: Cluster) -> float:
    text = c.http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("cellflip_cells_fenced_total"))


def flood(seconds: float, flooders: int = FLOODERS) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-flood-"))
    c = Cluster(tmp, num_cells=3, cfg=_cfg(tmp), ready_timeout_s=300)
    try:
        tokens = [c.http.post("/v1/tokens", json={"scope": "agent", "name": f"flooder-{i}"}).json()["token"]
                  for i in range(flooders)]
        fenced0, lag0 = _fenced(c), _loop_lag(c)
        stop = threading.Event()
        controls: list[Streamer] = []

        def control_loop() -> None:
            """The control session: one long completion after another (each within the context)."""
            k = 0
            while not stop.is_set():
                s = Streamer(c.url, [5, 6, 7, 8], max_tokens=CONTROL_TOKENS, seed=k, timeout_s=seconds + 300,
                             token=c.agent_token)
                controls.append(s)
                s.start()
                while s.is_alive() and not stop.is_set():
                    s.join(0.2)
                k += 1

        ctl_thread = threading.Thread(target=control_loop, daemon=True)
        ctl_thread.start()
        c.wait(lambda: controls and len(controls[0].tokens) >= 8, 120, "the control stream decoding")
        statuses: dict[str, dict[int, int]] = {}
        lock = threading.Lock()

        def flooder(token: str, k: int) -> None:
            """One flooding client, a process of its own (as an agent sandbox is): its sends do
            not compete with the control client for this process's interpreter. It runs at
            FLOODER_NICE: an agent sandbox runs on a machine of its own, so what the flood may
            cost the fleet is the scheduler's and cells' handling of it, not the CPU the
            attacker spends building and sending it (here both share 2 cores)."""
            p = subprocess.Popen(["nice", "-n", str(FLOODER_NICE), sys.executable, __file__, "--flood-one", c.url,
                                  token, str(seconds), str(k)],
                                 stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            out, _ = p.communicate(timeout=seconds + 300)
            counts = json.loads(out.strip().splitlines()[-1])
            with lock:
                for name, per in counts.items():
                    for code, n in per.items():
                        statuses.setdefault(name, {}).setdefault(int(code), 0)
                        statuses[name][int(code)] += n

        health: list[float] = []

        def prober() -> None:
            with httpx.Client(base_url=c.url, timeout=30.0) as http:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    http.get("/healthz")
                    health.append((time.perf_counter() - t0) * 1e3)
                    stop.wait(PROBE_S)

        threads = [threading.Thread(target=flooder, args=(t, k), daemon=True) for k, t in enumerate(tokens)]
        threads.append(threading.Thread(target=prober, daemon=True))
        t_start = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(seconds)
        stop.set()
        t_end = time.monotonic()
        for t in threads:
            t.join(120)
        gaps, n_tokens, worst = [], 0, []
        for k, s in enumerate(controls):  # gaps within each completion, during the flood
            times = [t for t in s.times if t_start <= t <= t_end]
            n_tokens += len(times)
            arrivals = sorted(set(times))  # tokens of one event arrive together: gaps between events
            gaps += [b - a for a, b in zip(arrivals, arrivals[1:])]
            first = {t: i for i, t in reversed(list(enumerate(s.times)))}
            worst += [(b - a, k, first[b], b - t_start) for a, b in zip(arrivals, arrivals[1:])]
        worst = sorted(worst, reverse=True)[:3]
        errors = [s.error for s in controls if s.error]
        typical = statistics.median(gaps) if gaps else float("inf")
        biggest = max(gaps) if gaps else float("inf")
        fenced = _fenced(c) - fenced0
        lag1 = _loop_lag(c)
        beats = {le: lag1.get(le, 0) - lag0.get(le, 0) for le in lag1}
        total = beats.get("+Inf", 0)
        health.sort()
        p99 = health[min(len(health) - 1, int(0.99 * len(health)))] if health else float("inf")
        n5xx = sum(n for per in statuses.values() for code, n in per.items() if code >= 500)
        result = {
            "seconds": seconds, "flooders": flooders,
            "cells_fenced": int(fenced), "healthz_p99_ms": round(p99, 1), "healthz_max_ms": round(health[-1], 1),
            "healthz_probes": len(health),
            "control_tokens": n_tokens, "control_gap_typical_ms": round(typical * 1e3, 1),
            "control_gap_max_ms": round(biggest * 1e3, 1),
            "control_gap_p99_ms": round(sorted(gaps)[int(0.99 * (len(gaps) - 1))] * 1e3, 1) if gaps else None,
            "control_gap_ok": biggest <= 2 * typical + 0.1, "control_errors": errors,
            "control_gap_worst": [{"ms": round(g * 1e3, 1), "completion": k, "token": i, "at_s": round(t, 2)}
                                  for g, k, i, t in worst],
            "flood_requests": {k: {str(code): n for code, n in sorted(v.items())} for k, v in sorted(statuses.items())},
            "flood_5xx": n5xx,
            "scheduler_loop_beats": int(total),
            "scheduler_loop_lag_over_50ms": int(total - beats.get("0.05", 0)),
            "scheduler_loop_lag_over_100ms": int(total - beats.get("0.1", 0)),
        }
        return result
    finally:
        c.stop()


def flood_one(url: str, token: str, seconds: float, k: int) -> None:
    """A flooding client's process: the attacks back to back for `seconds`; prints its status
    counts as one JSON line."""
    attacks = _attacks(random.Random(k))
    auth = {"Authorization": f"Bearer {token}"}
    counts: dict[str, dict[int, int]] = {}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=60.0) as http:
        i = k
        while time.monotonic() < deadline:
            name, path, kw = attacks[i % len(attacks)]
            i += 1
            try:
                code = http.post(path, **{**kw, "headers": {**auth, **kw.get("headers", {})}}).status_code
            except httpx.HTTPError:
                code = -1  # the server closed the connection (a 413 mid-upload)
            counts.setdefault(name, {}).setdefault(code, 0)
            counts[name][code] += 1
    print(json.dumps(counts), flush=True)


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--flood-one":
        flood_one(sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
        return
    args = parse_args(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--flooders", type=int, default=FLOODERS, help="flooding clients (0: the control stream alone)"))
    result = flood(20.0 if args.quick else 60.0, args.flooders)
    finish(result, args, "flood")


if __name__ == "__main__":
    main()
