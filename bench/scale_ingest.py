"""Token ingest per core (bench/scheduler_scale.py's third part).

The real app under uvicorn in a process of its own, as deployed, its store holding 10,000
registered rollout cells (each synced once, as a restarted scheduler's inventory), its control
loop running and its bearer tokens checked. `ACTIVE` of them each own `REQUESTS` running
requests (sessions with a `PROMPT`-token prompt stored). A load generator in this process (its
CPU is not the server's) posts their syncs through the real route
(`POST /internal/v1/cells/{id}/sync`, the cell token) over `CONNECTIONS` keep-alive
connections at once, as a fleet's cells sync concurrently (the syncs that arrive together share
one transaction: scheduler/control/groupcommit.py; `--ingest-connections 1` posts one at a
time). Each sync carries `REQUESTS` token batches of
`TOKENS` sampled tokens, every one with its log-prob and weight version, continuing where the
last left off, plus the cell's summary (its request ids, KV blocks in use). The batches travel
as real cells send them: the packed wire form (`TokenRecords.packed`, base64 of little-endian
columns; scheduler/contract/records.py). Every batch must be accepted (none in `rejected`),
else the run fails.

Measured: the server process's CPU time (user + system, from /proc) over the loaded window,
per sync: `ingest_server_cpu_ms_per_sync`; the same process's CPU time over an equally long
idle window before it (its control loop ticking over 10,000 cells with nothing arriving) is
reported apart (`idle_server_cpu_ms_per_s`) and is not subtracted. `cores_for_10k_cells_at_1hz`
= 10,000 syncs a second × the CPU per sync: the cores a scheduler needs when every cell of a
10,000-cell fleet syncs once a second with a full batch.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import threading
import time

from scheduler.contract.records import TokenRecords
from scheduler.store import Store
from scheduler.store.tokenpack import prompt_chunk

ACTIVE = 64
"""Cells whose syncs carry tokens (the load generator cycles over them)."""
REQUESTS = 32
TOKENS = 16
CONNECTIONS = 8
"""Connections posting at once, as a fleet's cells sync concurrently (1: one sync at a time)."""
PROMPT = 256
"""Prompt tokens stored per session before the run (the token store is not empty)."""
_REQ = ("INSERT INTO requests(id, session_id, base, prompt_start, num_generated, params, cell_id, epoch, "
        "state, reason, created_at, updated_at) VALUES (?,?,?,0,0,'{}',?,1,'running',NULL,?,?)")


def seed_requests(path: str, cells: list[str]) -> dict[str, list[str]]:
    """`REQUESTS` running requests on each of `cells`, each with a stored prompt; returns
    cell → its request ids."""
    store = Store(path)
    out: dict[str, list[str]] = {}
    now = time.time()
    rng = random.Random(0)
    with store.tx():
        for c in cells:
            ids = out[c] = [f"r-{c}-{k}" for k in range(REQUESTS)]
            sessions = [f"s-{c}-{k}" for k in range(REQUESTS)]
            store.executemany("INSERT INTO sessions(id, state, length, segment_starts, created_at) "
                              "VALUES (?, 'open', ?, '[0]', ?)", [(s, PROMPT, now) for s in sessions])
            store.sessions.buf.insert([prompt_chunk(s, 0, [rng.randrange(50_000) for _ in range(PROMPT)])
                                       for s in sessions])
            store.executemany(_REQ, [(r, s, PROMPT, c, now, now) for r, s in zip(ids, sessions)])
    store.close()
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Syncs:
    """The active cells' sync bodies, each continuing its requests where the last left off."""

    def __init__(self, owned: dict[str, list[str]]) -> None:
        self.owned = owned
        self.done = dict.fromkeys(owned, 0)
        self.rng = random.Random(1)

    def body(self, cell: str) -> bytes:
        n, rng = self.done[cell], self.rng
        self.done[cell] = n + TOKENS
        ids = self.owned[cell]
        tokens = [{"request_id": r, "epoch": 1, "start": n,
                   "records": TokenRecords.of([(rng.randrange(50_000), -rng.random() * 4, 0, False)
                                               for _ in range(TOKENS)]).packed().wire()}
                  for r in ids]
        incarnation = "inc-" + cell.removeprefix("cell-")
        summary = {"inflight": len(ids), "kv_blocks_used": (n // 16) % 1024, "kv_blocks_total": 1024,
                   "version": 0, "request_ids": ids, "role": "rollout"}
        return json.dumps({"incarnation": incarnation, "summary": summary, "tokens": tokens}).encode()


def load(port: int, headers: dict, syncs: Syncs, seconds: float, pid: int, conns: int = CONNECTIONS) -> dict:
    """Post syncs for `seconds` over `conns` keep-alive connections at once, each cycling over
    its own share of the active cells; every batch must land."""
    cells = list(syncs.owned)
    shares = [cells[k::conns] for k in range(conns)]
    hdrs = {**headers, "Content-Type": "application/json"}
    counts, errors = [0] * conns, []
    stop = time.perf_counter() + seconds

    def post(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120.0)
        try:
            n = 0
            while time.perf_counter() < stop and not errors:
                cell = shares[k][n % len(shares[k])]
                conn.request("POST", f"/internal/v1/cells/{cell}/sync", body=syncs.body(cell), headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200 or json.loads(data)["rejected"]:
                    errors.append(f"sync of {cell} answered {resp.status}: {data[:300]!r}")
                    return
                n += 1
            counts[k] = n
        except Exception as e:  # the run fails with it
            errors.append(repr(e))
        finally:
            conn.close()

    c0, t0 = cpu_s(pid), time.perf_counter()
    threads = [threading.Thread(target=post, args=(k,), daemon=True) for k in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 180)
    wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(errors[0] if errors else "a load connection did not finish")
    return {"syncs": sum(counts), "wall_s": wall, "cpu_s": cpu}
