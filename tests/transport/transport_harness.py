"""Worker processes for the transport tests, and the pool that drives them.

A worker is `python transport_harness.py` reading one JSON line per role on stdin
({"role", "args"}) and printing one `RESULT {json}` line per role. Workers are plain
subprocesses (nothing is pickled to start them), every wait is bounded, and a test stops
only the workers its pool started.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OP_TIMEOUT_S = 3.0
"""Per-op transfer timeout in these tests: short enough to keep the suite fast, long enough
for a loaded 2-core machine to move a few hundred KB."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """Long-lived worker processes, one per name, each running roles sent on its stdin.

    Starting a process costs a torch import (seconds on a loaded machine), so a test module
    keeps its workers and sends them one role after another; a worker whose role kills it is
    restarted on its next `submit`. `close()` stops and reaps only these processes.
    """

    def __init__(self, port: int, logdir: Path, script: str | Path | None = None) -> None:
        self.port, self.logdir = port, logdir
        self.script = str(script or __file__)
        """The file the workers run: this one, or a test module whose `role_*` functions it
        serves with `serve(globals())`."""
        self.procs: dict[str, subprocess.Popen] = {}
        self.queues: dict[str, queue.Queue] = {}
        self.exitcodes: dict[str, int] = {}

    def submit(self, name: str, role: str, **args) -> subprocess.Popen:
        if name not in self.procs:
            self._start(name)
        p = self.procs[name]
        p.stdin.write(json.dumps({"role": role, "args": {"port": self.port, **args}}) + "\n")
        p.stdin.flush()
        return p

    def result(self, name: str, timeout_s: float = 60.0) -> dict:
        """The worker's next result, or {"exitcode": n} if its process ended instead."""
        try:
            item = self.queues[name].get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"worker {name}: no result in {timeout_s}s\n{self.stderr(name)}") from None
        if item is not None:
            return item
        p = self.procs.pop(name)
        rc = p.wait(timeout=30)
        return {"exitcode": rc, "stderr": self.stderr(name)}

    def stderr(self, name: str) -> str:
        path = self.logdir / f"{name}.err"
        return path.read_text()[-3000:] if path.exists() else ""

    def close(self) -> dict[str, int]:
        """Asks every worker to exit, kills any that do not; returns their exit codes."""
        for p in self.procs.values():
            try:
                p.stdin.write(json.dumps({"role": "exit", "args": {}}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for name, p in self.procs.items():
            try:
                self.exitcodes[name] = p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                self.exitcodes[name] = p.wait(timeout=10)
        self.procs.clear()
        return self.exitcodes

    def _start(self, name: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        err = open(self.logdir / f"{name}.err", "a")
        p = subprocess.Popen(
            [sys.executable, self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=err, text=True, env=env, cwd=str(REPO),
        )
        err.close()
        q: queue.Queue = queue.Queue()

        def read() -> None:
            for line in p.stdout:
                if line.startswith("RESULT "):
                    q.put(json.loads(line[len("RESULT "):]))
            q.put(None)  # EOF: the process ended

        threading.Thread(target=read, daemon=True).start()
        self.procs[name], self.queues[name] = p, q


def make_tensors(seed: int) -> dict:
    """A toy version: mixed dtypes, a 0-dim and an empty tensor, some spanning many buckets."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g),
        "layers.0.attn.qkv": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "layers.0.norm": torch.randn(64, generator=g).to(torch.float16),
        "step": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "lm_head.weight": torch.randn(50_000, generator=g),
    }


def _equal(got: dict, want: dict) -> bool:
    import torch

    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want
    )


# -- worker roles -----------------------------------------------------------------------------

def _store(a: dict):
    from cells.transport.store import StoreAddress, connect

    return connect(StoreAddress("127.0.0.1", a["port"]), timeout_s=20)


def _channel(store, name: str, rank: int, connect_timeout_s: float = 20.0):
    from cells.transport.p2p import PairChannel

    return PairChannel(store, name, rank, timeout_s=OP_TIMEOUT_S, connect_timeout_s=connect_timeout_s)


def role_p2p_roundtrip(a: dict) -> dict:
    import torch

    from cells.transport.p2p import measure_raw_p2p

    ch = _channel(_store(a), "rt", a["rank"])
    want = make_tensors(1)
    meta = {"request": "r-1", "tokens": [1, 2, 3], "nested": {"x": 1.5, "s": "é✓"}, "n": None}
    if a["rank"] == 0:
        ch.send_json(meta)
        ch.send_many([want[k] for k in want])
        echo = ch.recv_json()
        back = {k: ch.recv_tensor(torch.empty_like(v)) for k, v in want.items()}
        ok = echo == meta and _equal(back, want)
    else:
        got_meta = ch.recv_json()
        got = dict(zip(want, ch.recv_many([torch.empty_like(v) for v in want.values()])))
        ch.send_json(got_meta)
        for v in got.values():
            ch.send_tensor(v)
        ok = got_meta == meta and _equal(got, want)
    raw = measure_raw_p2p(ch, 1 << 20, repeats=1)
    chunked = measure_raw_p2p(ch, 1 << 20, chunk_bytes=64 << 10, repeats=1)
    ch.close()
    return {"ok": ok, "raw_gbps": raw, "chunked_gbps": chunked}


def role_p2p_dying_peer(a: dict) -> dict:
    ch = _channel(_store(a), "die/1", 1)
    ch.recv_json()
    os._exit(3)  # dies with the channel open, mid-conversation


def role_p2p_echo(a: dict) -> dict:
    ch = _channel(_store(a), a["channel"], 1)
    ch.send_json(ch.recv_json())
    ch.close()
    return {"ok": True}


def role_p2p_survivor(a: dict) -> dict:
    import torch

    from cells.transport.p2p import TransferError

    store = _store(a)
    ch = _channel(store, "die/1", 0)
    ch.send_json({"hello": 1})
    t0 = time.monotonic()
    try:
        ch.recv_tensor(torch.empty(1000))
        error = None
    except TransferError as e:
        error = str(e)
    elapsed = time.monotonic() - t0
    try:  # a broken channel refuses further ops at once
        ch.send_json({"again": 1})
        refused = False
    except TransferError:
        refused = True
    fresh = _channel(store, "die/2", 0)
    fresh.send_json({"fresh": [1, 2]})
    echo = fresh.recv_json()
    fresh.close()
    return {"error": error, "elapsed": elapsed, "refused": refused, "fresh_ok": echo == {"fresh": [1, 2]}}


def role_p2p_stall_peer(a: dict) -> dict:
    store = _store(a)
    chans = [_channel(store, "stall/1", 1), _channel(store, "stall/2", 1)]
    from cells.transport.store import wait_keys

    store.set("stall/ready", str(os.getpid()))
    # The test SIGSTOPs this process here; no byte flows until it is continued and released.
    released = wait_keys(store, ["stall/release"], 60)
    for ch in chans:
        ch.close()
    return {"released": bool(released)}


def role_p2p_stall_waiter(a: dict) -> dict:
    import torch

    from cells.transport.p2p import TransferError
    from cells.transport.store import wait_keys

    store = _store(a)
    c1, c2 = _channel(store, "stall/1", 0), _channel(store, "stall/2", 0)
    if not wait_keys(store, ["stall/go"], 30):
        return {"error": "no go"}
    out = {}
    for name, op in [
        ("recv", lambda: c1.recv_tensor(torch.empty(1 << 16))),
        # larger than the loopback socket buffers, so the send cannot complete locally
        ("send", lambda: c2.send_tensor(torch.ones(64 << 20, dtype=torch.uint8))),
    ]:
        t0 = time.monotonic()
        try:
            op()
            out[name] = {"error": None}
        except TransferError as e:
            out[name] = {"error": str(e)}
        out[name]["elapsed"] = time.monotonic() - t0
    c1.close()
    c2.close()
    return out


def role_bc_sender(a: dict) -> dict:
    from cells.transport.broadcast import WeightSender, send_version_p2p

    store = _store(a)
    hook = None
    if a.get("die_at_bucket") is not None:
        def hook(i):
            if i == a["die_at_bucket"]:
                os._exit(7)
    sender = WeightSender(
        store, bucket_bytes=a.get("bucket_bytes", 32 << 10), timeout_s=OP_TIMEOUT_S,
        join_timeout_s=a.get("join_timeout_s", 20.0), settle_timeout_s=OP_TIMEOUT_S + 3, bucket_hook=hook,
    )
    tensors = make_tensors(a["seed"])
    res = sender.send_version(a["version"], tensors, a["receivers"])
    caught_up = []
    for cell in a.get("catch_up", []):
        with _channel(store, f"catchup/{cell}/{a['version']}", 0) as ch:
            send_version_p2p(ch, a["version"], tensors, bucket_bytes=16 << 10)
            caught_up.append(cell)
    return {"delivered": res.delivered, "failed": res.failed, "num_attempts": res.num_attempts,
            "seconds": res.seconds, "caught_up": caught_up}


def role_bc_receiver(a: dict) -> dict:
    from cells.transport.broadcast import WeightReceiver, recv_version_p2p
    from cells.transport.p2p import TransferError

    store = _store(a)
    hook = None
    if a.get("corrupt_bucket") is not None:
        def hook(i, wire):
            if i == a["corrupt_bucket"]:
                wire[11] ^= 0x10  # one flipped bit, as a bad link or bad memory would do
    if a.get("die_at_bucket") is not None:
        def hook(i, wire):
            if i == a["die_at_bucket"]:
                os._exit(9)
    rx = WeightReceiver(store, a["cell"], timeout_s=OP_TIMEOUT_S,
                        join_timeout_s=a.get("join_timeout_s", 20.0), bucket_hook=hook)
    t0 = time.monotonic()
    complete = rx.receive_version(a["version"])
    out = {"complete": complete, "elapsed": time.monotonic() - t0, "error": rx.last_error}
    try:
        got = rx.received_tensors()
        out["raises"], out["equal"] = False, _equal(got, make_tensors(a["seed"]))
    except TransferError:
        out["raises"], out["equal"] = True, False
    if a.get("catch_up"):
        with _channel(store, f"catchup/{a['cell']}/{a['version']}", 1) as ch:
            version, got = recv_version_p2p(ch)
        out["p2p_version"], out["p2p_equal"] = version, _equal(got, make_tensors(a["seed"]))
    return out


def serve(roles: dict | None = None) -> None:
    """Runs `role_{name}` from `roles` (this module's by default) for each JSON line on stdin
    and prints its JSON result: no pickle between the test and its workers."""
    import torch

    torch.set_num_threads(1)
    roles = globals() if roles is None else roles
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["role"] == "exit":
            return
        try:
            result = roles[f"role_{msg['role']}"](msg["args"])
        except Exception as e:
            result = {"exception": repr(e), "traceback": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    serve()
