"""One side of a live KV migration between two cell processes, through the cells' own
`MigrationSender` / `MigrationReceiver` over a gloo pair channel (the scheduler replaced by a
stub that commits), each side a process that bench/gpu_check.py starts (`--migrate-role`).

The engines may sit on a GPU: the KV leaves the source as a pinned host copy of its blocks
(`export_kv`), crosses gloo, lands in a host staging buffer and is copied into the
destination's device pool (`import_kv`). Both sides keep decoding other requests while the
copy rounds run. Each side writes `{"tokens": [[index, token id], ...], "outcome": ...}` for
the moved request to `out`. `run_pair` (the parent) starts both and checks the move
token-exact against an unmoved twin.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH_NAME = "kv: pinned host staging over gloo"


def _engine(args: dict):
    from cells.engine.embedded import EmbeddedEngine
    from scheduler.contract.config.engine import EmbeddedEngineConfig

    return EmbeddedEngine(EmbeddedEngineConfig(**args["engine"]))


def _params(args: dict, i: int):
    from cells.engine.records import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=args["max_tokens"], seed=args["seed"] + i)


def _load(eng, args: dict, tag: str) -> None:
    """Other requests in the batch, so the moved one decodes among neighbours on both sides."""
    import torch

    g = torch.Generator().manual_seed(sum(map(ord, tag)))
    for j in range(args["load"]):
        eng.add_request(f"{tag}{j}", torch.randint(0, 900, (24 + 7 * j,), generator=g).tolist(), _params(args, 50 + j))


class _Client:
    """The scheduler's two migration endpoints, committing every move."""

    def abort_migration(self, mid, req) -> None:
        pass

    def commit(self, mid, req) -> int:
        return req.epoch + 1


def _drive(eng, side, rid: str, until_done: bool, pace_s: float = 0.0) -> tuple[list, object]:
    """Step the engine under its lock while `side` runs on a thread; returns the moved
    request's (index, token) pairs seen here and the side's outcome. `pace_s`: a pause after
    each step while the move runs, so the request is still decoding when the stop comes (a
    tiny model would otherwise finish its tokens within the copy rounds)."""
    lock, box, got = threading.Lock(), {}, []

    def on(fn):
        with lock:
            from cells.engine.base import kv_handover

            return fn(kv_handover(eng))

    side.on_engine = on
    if hasattr(side, "flushed"):
        side.flushed = lambda: len(got)
        side.peek = on
    t = threading.Thread(target=lambda: box.__setitem__("out", side.run()), daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (t.is_alive() or (until_done and eng.has_work())):
        if until_done is False and "reserved" not in side.marks and t.is_alive():
            time.sleep(0.005)  # the source decodes on once the destination has joined and reserved
            continue
        with lock:
            events = eng.step() if eng.has_work() else []
        got.extend((ev.index, ev.record.token_id) for ev in events if ev.request_id == rid)
        if not events:
            time.sleep(0.001)
        elif pace_s and t.is_alive():
            time.sleep(pace_s)
    t.join(5)
    return got, box.get("out")


def source(args: dict) -> dict:
    from cells.migration import MigrationSender
    from cells.transport.store import StoreHost
    from scheduler.contract.config.scheduler import MigrationConfig
    from scheduler.contract.protocol import MigrateOutCmd

    eng = _engine(args)
    eng.add_request("r", args["prompt"], _params(args, 0))
    _load(eng, args, "s")
    host = StoreHost("127.0.0.1", args["port"], timeout_s=60)
    got = []
    for _ in range(args["steps_before"]):
        got.extend((ev.index, ev.record.token_id) for ev in eng.step() if ev.request_id == "r")
    cfg = MigrationConfig(stop_copy_blocks=1, max_copy_rounds=3, transfer_timeout_s=60)
    cmd = MigrateOutCmd(1, "r", 0, "m1", "dst", "127.0.0.1:0", 0)
    side = MigrationSender(cmd, cell_id="src", incarnation="i", store=host.store, client=_Client(), cfg=cfg,
                           on_engine=None, flushed=lambda: 0)
    more, out = _drive(eng, side, "r", until_done=False, pace_s=args.get("pace_s", 0.0))
    host.close()
    return {"tokens": got + more, "outcome": out.result if out else "none", "reason": out.reason if out else "",
            "bytes": out.bytes if out else 0, "device": str(eng.device), "dtype": str(eng.dtype)}


def destination(args: dict) -> dict:
    from cells.migration import MigrationReceiver
    from scheduler.contract.config.scheduler import MigrationConfig
    from scheduler.contract.protocol import MigrateInCmd

    eng = _engine(args)
    _load(eng, args, "d")
    eng.step()
    cfg = MigrationConfig(stop_copy_blocks=1, max_copy_rounds=3, transfer_timeout_s=60)
    cmd = MigrateInCmd(1, "r", "m1", "src", "127.0.0.1:0", args["port"], 400, 0)
    side = MigrationReceiver(cmd, cell_id="dst", incarnation="j", client=_Client(), cfg=cfg, on_engine=None,
                             on_commit=lambda *a: None)
    got, out = _drive(eng, side, "r", until_done=True)
    return {"tokens": got, "outcome": out.result if out else "none", "reason": out.reason if out else "",
            "bytes": out.bytes if out else 0, "device": str(eng.device), "dtype": str(eng.dtype)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def twin(args: dict) -> list[list[int]]:
    """The moved request decoded without moving, among the source's neighbours."""
    eng = _engine(args)
    eng.add_request("r", args["prompt"], _params(args, 0))
    _load(eng, args, "s")
    got = []
    while eng.has_work():
        got.extend([ev.index, ev.record.token_id] for ev in eng.step() if ev.request_id == "r")
    return got


def token_exact(got: list, ref: list) -> bool:
    """Every index once, in order, with the twin's token."""
    return [list(x) for x in got] == [list(x) for x in ref]


def spawn(args: dict, workdir: Path) -> subprocess.Popen:
    """A process running one role (`src`, `dst`, `send_version`) with `args`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(workdir), "--migrate-role",
           json.dumps(args)]
    return subprocess.Popen(cmd, env=env)


def send_version(args: dict) -> None:
    """The sender of bench/gpu_parts.py's part (d): version 1 of the same engine's weights,
    the tensors of each name list in turn over one channel."""
    import gpu_parts

    from cells.transport.buckets import ChecksumError
    from cells.transport.catchup import send_version_p2p
    from cells.transport.p2p import PairChannel
    from cells.transport.store import StoreAddress, connect

    eng = _engine(args)
    store = connect(StoreAddress("127.0.0.1", args["port"]), timeout_s=60)
    with PairChannel(store, args["name"], 0, timeout_s=120, connect_timeout_s=120) as ch:
        for names in args["names"]:
            new = gpu_parts.new_version({k: eng.weights()[k] for k in names})
            try:
                send_version_p2p(ch, 1, new, bucket_bytes=args["bucket_bytes"])
            except ChecksumError as e:  # the receiver refused a bucket: its side reports it
                print(f"sender: {e}", file=sys.stderr)


def run_pair(args: dict, workdir: Path, timeout_s: float = 240) -> dict:
    """Both sides as processes; the merged token stream against the unmoved twin."""
    args = {**args, "port": free_port()}
    procs, outs = {}, {}
    for role in ("src", "dst"):
        outs[role] = workdir / f"migrate_{role}.json"
        procs[role] = spawn({**args, "role": role, "out": str(outs[role])}, workdir)
    try:
        codes = {r: p.wait(timeout=timeout_s) for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(codes.values()):
        return {"ok": False, "error": f"exit codes {codes}"}
    sides = {r: json.loads(outs[r].read_text()) for r in outs}
    merged = sorted(sides["src"]["tokens"] + sides["dst"]["tokens"])
    ref = twin(args)
    moved_at = len(sides["src"]["tokens"])
    altered = [list(x) for x in merged]
    if altered:
        altered[-1][1] = (altered[-1][1] + 1) % 900
    return {"ok": sides["src"]["outcome"] == "committed" and token_exact(merged, ref),
            "path": PATH_NAME, "outcome": {r: s["outcome"] for r, s in sides.items()},
            "kv_bytes": sides["src"]["bytes"], "tokens_before_move": moved_at,
            "tokens_after_move": len(sides["dst"]["tokens"]), "tokens": len(ref),
            "negative_control_caught": not token_exact(altered, ref),
            "device": sides["dst"]["device"], "dtype": sides["dst"]["dtype"]}


def main(arg_json: str) -> None:
    """One side, as `python bench/gpu_check.py --out DIR --migrate-role ARGS_JSON` runs it."""
    args = json.loads(arg_json)
    import torch

    torch.set_num_threads(1)
    if args["role"] == "send_version":
        send_version(args)
        return
    out = source(args) if args["role"] == "src" else destination(args)
    Path(args["out"]).write_text(json.dumps(out))
