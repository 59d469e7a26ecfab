"""Versioned weight broadcast, trainer → 1, 2 and 3 rollout cells, while the cells keep decoding.

    python bench/broadcast.py [--quick] [--json] [--bucket-bytes N] [--repeats N]

This process is the trainer: a `VersionHost` holding the `small` preset's real weights
(`init_weights`, 412 MB of float32). Three worker processes are rollout cells: an
`EmbeddedEngine` (same preset, version 0) decoding four requests back to back on one thread
(a finished request is replaced at once), and a `CellVersions` that receives each version on
its own thread and installs it between two engine steps (`activate_staged`, under the same
lock as `step`), as the cell agent's engine loop does. The workers run this file with
`--worker`; the bench drives them with JSON lines on their stdin and stdout (nothing
pickled); every tensor byte travels over
torch.distributed (gloo, 127.0.0.1). For point k, cells 0..k-1 decode and take part, the
others stand idle. A point is `repeats` rounds (2 with --quick, 3 otherwise) of raw,
versioned, raw; each versioned broadcast is a new version (3, 4, 5, ...: versions 1 and 2
are untimed warm-up rounds with all three cells, so that both of a cell's staging buffers, the
version served and the one received, are warm), a perturbed copy of the weights. Buckets are
`versions.bucket_bytes` (8 MiB, the config default) unless --bucket-bytes says otherwise.

- model_bytes: bytes of one version (every tensor of the model).
- points[].seconds: best over the point's rounds of the trainer-side time from sending the
  `load_version` commands until `VersionHost.broadcast` returned with every receiver
  delivered, i.e. every receiver checked every bucket's CRC32, staged it, and reported
  (join, plan, manifest, buckets, reports: the whole protocol; installation is not in it).
- points[].gbps: model_bytes / seconds / 1e9.
- points[].raw_bcast_gbps: the same byte count as one contiguous uint8 tensor, broadcast by
  a plain gloo group of the same processes (trainer rank 0 + the k cells) in the same run,
  timed the same way: from the control message until every receiver confirmed through a
  store key. Each receiver joins a fresh group on the host's store and receives into a warm
  buffer (allocated once, reused by every raw round; the versioned receiver lands in warm
  buffers too, `CellVersions.buffers`) on a thread at the version loader's OS priority
  (`CellVersions.receive_nice`, inherited by the transport's threads) while its decode loop
  keeps running. A raw run before and one after each versioned run; model_bytes / the fastest
  single raw run. The same estimator on both sides (the fastest single run), because other
  load on the machine only ever adds time.
- efficiency: min over points of gbps / raw_bcast_gbps.
- points[].seconds_all, points[].raw_seconds_all: every versioned and every raw run of the
  point; points[].efficiency_median: the median raw run's time over the median versioned
  run's; efficiency_median: its min over points (the figure the target judges: the median of
  the bench's own runs, not the fastest).
- decode_tokens_during_broadcast: tokens the receivers decoded in engine steps that ended
  inside a versioned broadcast's window, summed over receivers and broadcasts (> 0: the
  cells decoded during the transfer).
- decode_pause_s: engine-loop time spent installing versions (`CellVersions.pause_s`: decoding
  stops between two steps for `load_weights`), summed over receivers and all versioned
  broadcasts of all points.
- pause_fraction: decode_pause_s / the sum of the seconds of those same broadcasts.
- decode_rate_ratio: the three cells' decode rate (tokens per second, summed over cells)
  inside the 3-receiver point's versioned broadcasts, over their rate in windows of the same
  lengths with no transfer at all, measured right after that point in the same run (the
  cells decode the same way throughout).
Correctness, checked once after the last point: every cell serves the last version and a
CRC32 over all its tensors equals the trainer's; otherwise the bench exits non-zero.
Targets (bench/targets.yaml): efficiency_median, decode_rate_ratio, pause_fraction. On 2 shared
cores all three are bounded by CPU, not by the protocol: the trainer and three decoding cells
share the cores with the transfer, so every cycle the transfer spends (the kernel's TCP
copies, each receiver's CRC32 pass over the version, `prepare()` on the loader thread) is
taken from decoding; the receiving side runs below the decode loop's priority.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import zlib

from common import finish, parse_args, set_threads

PRESET = "small"
NUM_CELLS = 3
REQUESTS_PER_CELL = 4
PROMPT_TOKENS, NEW_TOKENS = 32, 64
TIMEOUT_S = 60.0
"""Bound of every wait in the bench (op timeouts, control replies)."""
JOIN_TIMEOUT_S = 30.0
"""How long a broadcast waits for its receivers to show up."""
BUCKET_BYTES = 8 << 20
"""The configured default (`versions.bucket_bytes` in scheduler/contract/config/scheduler.py)."""


def _engine_cfg():
    from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

    return EmbeddedEngineConfig(model=ModelConfig(preset=PRESET), num_blocks=256, block_size=16,
                                max_running=REQUESTS_PER_CELL, prefill_chunk=256, batch_invariant=False)


def _crc_all(tensors: dict) -> int:
    from cells.transport.buckets import byte_view

    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(byte_view(tensors[name]).numpy(), crc)
    return crc


# -- the rollout cell -------------------------------------------------------------------------

class _Cell:
    """One worker: the decode loop, the version loader, the raw-broadcast receiver."""

    def __init__(self, idx: int, conn, address: dict) -> None:
        from cells.engine.embedded import EmbeddedEngine
        from cells.transport.store import StoreAddress
        from cells.versions import CellVersions

        self.idx, self.conn, self.cell_id = idx, conn, f"cell-{idx}"
        self.address = StoreAddress(address["host"], int(address["port"]))
        self.engine = EmbeddedEngine(_engine_cfg())
        self.events: list[dict] = []
        # as the cell agent does: weights are prepared on the loader thread, installed by a swap
        self.versions = CellVersions(self.cell_id, emit=lambda e: self.events.append(e.to_dict()), wake=lambda: None, timeout_s=TIMEOUT_S,
                                     prepare=self.engine.prepare_weights)
        self.lock = threading.Lock()
        self.num_waiting = 0
        self.waiting_lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.decoding = threading.Event()
        self.stop = threading.Event()
        self.steps: list[tuple[float, int]] = []  # (monotonic end of the step, tokens it decoded)
        self.num_added = 0
        self.error: str | None = None
        self.raw_buf = None  # the raw receiver's warm buffer, reused by every raw broadcast
        self.thread = threading.Thread(target=self._decode_loop, name="engine", daemon=True)

    def send(self, msg: dict) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def access(self):
        """The engine lock for the control thread; the decode loop yields it between steps."""
        cell = self

        class _Access:
            def __enter__(self):
                with cell.waiting_lock:
                    cell.num_waiting += 1
                cell.lock.acquire()

            def __exit__(self, *exc):
                cell.lock.release()
                with cell.waiting_lock:
                    cell.num_waiting -= 1

        return _Access()

    def _decode_loop(self) -> None:
        from cells.engine.records import SamplingParams

        try:
            while not self.stop.is_set():
                while self.num_waiting and not self.stop.is_set():
                    time.sleep(0.0002)  # hand the lock over (Python locks are not fair)
                if not self.decoding.is_set():
                    with self.lock:
                        if self.versions.has_staged():
                            self.versions.activate_staged(self.engine)
                    self.decoding.wait(0.01)
                    continue
                with self.lock:
                    if self.versions.has_staged():  # a verified version: install it between steps
                        self.versions.activate_staged(self.engine)
                    while self.engine.num_inflight() < REQUESTS_PER_CELL:
                        n = self.num_added
                        self.num_added += 1
                        prompt = [(17 * n + 31 * i + 7 * self.idx) % 8000 + 1 for i in range(PROMPT_TOKENS)]
                        self.engine.add_request(f"{self.cell_id}/r{n}", prompt,
                                                SamplingParams(max_tokens=NEW_TOKENS, seed=n))
                    got = len(self.engine.step())
                self.steps.append((time.monotonic(), got))
        except Exception as e:  # reported on the next control reply
            self.error = f"decode loop: {e!r}"

    def _raw_receive(self, msg: dict) -> None:
        """Joins the plain group `prefix` and receives one broadcast of `nbytes` from rank 0."""
        import torch
        import torch.distributed as dist

        from cells.transport.p2p import discard, join_group, wait_work
        from cells.transport.store import connect, set_json
        from cells.versions import lower_priority

        lower_priority(self.versions.receive_nice)  # like the version loader: the same priority
        store = connect(self.address, timeout_s=TIMEOUT_S)
        result: dict = {"ok": False}
        try:
            backend = join_group(store, msg["prefix"], msg["rank"], msg["size"], timeout_s=TIMEOUT_S,
                                 connect_timeout_s=JOIN_TIMEOUT_S, device=torch.device("cpu"))
            if self.raw_buf is None or self.raw_buf.numel() != msg["nbytes"]:
                self.raw_buf = torch.empty(msg["nbytes"], dtype=torch.uint8)
            buf = self.raw_buf
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            try:
                wait_work(backend.broadcast([buf], opts), TIMEOUT_S, "raw broadcast")
                ok = int(buf[0]) == msg["fill"] and int(buf[-1]) == msg["fill"]
                result = {"ok": ok, "error": "" if ok else "wrong bytes"}
            finally:
                discard(backend, [buf], broken=not result["ok"])
        except Exception as e:
            result = {"ok": False, "error": repr(e)}
        set_json(store, f"{msg['prefix']}done/{msg['rank']}", result)

    def handle(self, msg: dict) -> bool:
        from scheduler.contract.protocol import LoadVersionCmd

        cmd = msg["cmd"]
        if cmd == "decode":
            (self.decoding.set if msg["on"] else self.decoding.clear)()
            self.send({"ok": True})
        elif cmd == "load":
            self.versions.load(LoadVersionCmd(cmd_id=msg["version"], version=msg["version"],
                                              source=msg["source"], mode="broadcast"),
                               held=self.engine.versions_held, serving=self.engine.version)
        elif cmd == "raw":
            threading.Thread(target=self._raw_receive, args=(msg,), name="raw-bcast", daemon=True).start()
        elif cmd == "installed":  # wait until the version serves, drop the older ones, report
            deadline = time.monotonic() + TIMEOUT_S
            while self.engine.version != msg["version"] and time.monotonic() < deadline and not self.error:
                time.sleep(0.005)
            with self.access():
                for v in self.engine.versions_held:
                    if v != self.engine.version:
                        self.engine.drop_version(v)
            failed = [e for e in self.events if e.get("version") == msg["version"] and not e.get("ok", True)]
            self.send({"version": self.engine.version, "pause_s": self.versions.pause_s,
                       "error": self.error or (failed[0].get("reason") if failed else None)})
        elif cmd == "tokens":
            n = sum(k for t, k in list(self.steps) if any(a <= t <= b for a, b in msg["windows"]))
            self.send({"tokens": n, "steps": len(self.steps)})
        elif cmd == "checksum":
            with self.access():
                self.send({"version": self.engine.version, "crc": _crc_all(self.engine.weights())})
        elif cmd == "stop":
            self.stop.set()
            self.decoding.set()
            self.thread.join(timeout=TIMEOUT_S)
            self.versions.close()
            self.send({"ok": True})
            return False
        return True


def worker(idx: int, conn, address: dict) -> None:
    import torch

    torch.set_num_threads(1)
    cell = _Cell(idx, conn, address)
    cell.thread.start()
    cell.send({"ready": True})
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the bench went away
            return
        if not cell.handle(msg):
            return


# -- the trainer ------------------------------------------------------------------------------

class _StdioConn:
    """A worker's end of its link: JSON lines on stdin (commands) and stdout (replies)."""

    def send(self, msg: dict) -> None:
        print("MSG " + json.dumps(msg), flush=True)  # callers hold _Cell.send_lock

    def recv(self) -> dict:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return json.loads(line)


class _Link:
    """The bench's end: a worker process running this file with `--worker`, JSON lines both
    ways (other output on its stdout is ignored)."""

    def __init__(self, idx: int, address: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(idx), json.dumps(address)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.inbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name=f"link-{idx}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("MSG "):
                self.inbox.put(json.loads(line[len("MSG "):]))
        self.inbox.put(None)  # the worker's stdout closed: it exited

    def send(self, msg: dict) -> None:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _reply(conn: _Link, what: str) -> dict:
    try:
        msg = conn.inbox.get(timeout=TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"no reply to {what!r} within {TIMEOUT_S}s") from None
    if msg is None:
        raise RuntimeError(f"worker exited (code {conn.proc.poll()}) before replying to {what!r}")
    return msg


def _ask(conns, msg: dict) -> list[dict]:
    for c in conns:
        c.send(msg)
    return [_reply(c, msg["cmd"]) for c in conns]


def _raw(address, conns, buf, tag: str) -> float:
    """One plain broadcast of `buf` from this process to `conns`' cells; seconds until every
    receiver confirmed."""
    import torch
    import torch.distributed as dist

    from cells.transport.p2p import discard, join_group, wait_work
    from cells.transport.store import connect, get_json, wait_keys

    store = connect(address, timeout_s=TIMEOUT_S)
    prefix, size = f"bench/raw/{tag}/", len(conns) + 1
    fill = int(buf[0])
    t0 = time.monotonic()
    for r, c in enumerate(conns, 1):
        c.send({"cmd": "raw", "prefix": prefix, "rank": r, "size": size, "nbytes": buf.numel(), "fill": fill})
    backend = join_group(store, prefix, 0, size, timeout_s=TIMEOUT_S, connect_timeout_s=JOIN_TIMEOUT_S,
                         device=torch.device("cpu"))
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    wait_work(backend.broadcast([buf], opts), TIMEOUT_S, "raw broadcast")
    keys = [f"{prefix}done/{r}" for r in range(1, size)]
    present = wait_keys(store, keys, TIMEOUT_S)
    seconds = time.monotonic() - t0
    discard(backend, [buf], broken=False)
    bad = [(k, get_json(store, k)) for k in present]
    bad = [b for b in bad if not b[1]["ok"]] + [(k, "no confirmation") for k in keys if k not in present]
    if bad:
        raise RuntimeError(f"raw broadcast {tag} failed: {bad}")
    return seconds


def _versioned(host, conns, cells: list[str], version: int) -> tuple[float, tuple[float, float]]:
    source = {"host": host.address.host, "port": host.address.port, "namespace": host.namespace}
    t0 = time.monotonic()
    for c in conns:
        c.send({"cmd": "load", "version": version, "source": source})
    result = host.broadcast(version, cells)
    t1 = time.monotonic()
    if sorted(result.delivered) != sorted(cells):
        raise RuntimeError(f"version {version}: not delivered to {result.failed}")
    return t1 - t0, (t0, t1)


def main() -> None:
    def extra(ap):
        ap.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
        ap.add_argument("--repeats", type=int, default=None, help="raw/versioned/raw rounds per point")

    args = parse_args(__doc__.splitlines()[0], extra)
    set_threads(1)
    import torch

    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import resolve_spec
    from cells.transport.versions_host import VersionHost

    repeats = args.repeats or (2 if args.quick else 3)
    base = init_weights(resolve_spec(_engine_cfg().model), _engine_cfg().model.seed)
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())
    host = VersionHost(bucket_bytes=args.bucket_bytes, timeout_s=TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S)
    host.start()
    address = host.address.to_dict()
    conns: list[_Link] = []
    cells = [f"cell-{i}" for i in range(NUM_CELLS)]
    version = 0

    def new_version() -> int:
        nonlocal version
        version += 1
        host.put(version, {k: t * (1.0 + 1e-3 * version) for k, t in base.items()})
        for v in host.versions():
            if v < version - 1:
                host.drop(v)
        return version

    def install(k: int, v: int) -> list[float]:
        """Waits until cells 0..k-1 serve `v`; returns their pause_s totals."""
        out = []
        for i, r in enumerate(_ask(conns[:k], {"cmd": "installed", "version": v})):
            if r["version"] != v or r["error"]:
                raise RuntimeError(f"{cells[i]}: serves {r['version']}, not {v} ({r['error']})")
            out.append(r["pause_s"])
        return out

    try:
        conns.extend(_Link(i, address) for i in range(NUM_CELLS))
        for i, c in enumerate(conns):
            if not _reply(c, "start").get("ready"):
                raise RuntimeError(f"{cells[i]} did not start")
        raw_buf = torch.full((model_bytes,), 7, dtype=torch.uint8)
        # Warm-up, untimed: every code path once with all cells (connections, allocator).
        _ask(conns, {"cmd": "decode", "on": True})
        _raw(host.address, conns, raw_buf, "warmup")
        for _ in range(2):  # two versions: the one served and the one received, both warm
            v = new_version()
            _versioned(host, conns, cells, v)
            pause = install(NUM_CELLS, v)
        points, windows, windows3, total_pause, total_seconds = [], [], [], 0.0, 0.0
        for k in range(1, NUM_CELLS + 1):
            _ask(conns, {"cmd": "decode", "on": False})
            _ask(conns[:k], {"cmd": "decode", "on": True})
            raws, vers = [], []
            for rep in range(repeats):
                raws.append(_raw(host.address, conns[:k], raw_buf, f"{k}/{rep}/a"))
                v = new_version()
                seconds, window = _versioned(host, conns[:k], cells[:k], v)
                after = install(k, v)
                total_pause += sum(a - b for a, b in zip(after, pause))
                pause = after + pause[k:]
                vers.append(seconds)
                windows.append(window)
                if k == NUM_CELLS:
                    windows3.append(window)
                raws.append(_raw(host.address, conns[:k], raw_buf, f"{k}/{rep}/b"))
            seconds = min(vers)
            raw_s = min(raws)  # one estimator on both sides: the fastest single run
            total_seconds += sum(vers)
            points.append({"receivers": k, "seconds": round(seconds, 4),
                           "gbps": round(model_bytes / seconds / 1e9, 4),
                           "raw_bcast_gbps": round(model_bytes / raw_s / 1e9, 4),
                           "seconds_all": [round(s, 4) for s in vers],
                           "raw_seconds_all": [round(s, 4) for s in raws],
                           "efficiency_median": round(statistics.median(raws) / statistics.median(vers), 4)})
            print(f"# {k} receivers: versioned {[round(s, 3) for s in vers]} s, raw {[round(s, 3) for s in raws]} s",
                  flush=True)
        # Correctness: the 3-receiver point ended with every cell serving the last version.
        want = _crc_all(host.get(version))
        for i, r in enumerate(_ask(conns, {"cmd": "checksum"})):
            if r["version"] != version or r["crc"] != want:
                raise RuntimeError(f"{cells[i]}: version {r['version']} crc {r['crc']:#x}, "
                                   f"trainer has version {version} crc {want:#x}")
        quiet = []
        for a, b in windows3:  # the same lengths with no transfer: every cell still decoding
            t = time.monotonic()
            time.sleep(b - a)
            quiet.append((t, time.monotonic()))
        tokens = sum(r["tokens"] for r in _ask(conns, {"cmd": "tokens", "windows": windows}))
        during = sum(r["tokens"] for r in _ask(conns, {"cmd": "tokens", "windows": windows3}))
        calm = sum(r["tokens"] for r in _ask(conns, {"cmd": "tokens", "windows": quiet}))
        span = sum(b - a for a, b in windows3), sum(b - a for a, b in quiet)
        rate_ratio = (during / span[0]) / (calm / span[1]) if calm else None
        _ask(conns, {"cmd": "stop"})
    finally:
        for c in conns:
            c.proc.stdin.close()  # EOF: a worker not yet stopped leaves its loop
        for c in conns:
            c.stop(TIMEOUT_S)
        host.close(grace_s=1.0)
    result = {
        "model_bytes": model_bytes,
        "points": points,
        "efficiency": round(min(p["gbps"] / p["raw_bcast_gbps"] for p in points), 4),
        "efficiency_median": min(p["efficiency_median"] for p in points),
        "decode_tokens_during_broadcast": tokens,
        "decode_pause_s": round(total_pause, 4),
        "pause_fraction": round(total_pause / total_seconds, 4),
        "decode_rate_ratio": round(rate_ratio, 4) if rate_ratio is not None else None,
    }
    finish(result, args, "broadcast")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), _StdioConn(), json.loads(sys.argv[3]))
    else:
        main()
