"""How fast does a PairChannel move bytes between two processes, in one contiguous send
versus the same bytes as many chunk-sized sends (how KV blocks travel)?

    python bench/p2p.py [--quick] [--json] [--bytes N] [--chunk-bytes N]

Two worker processes on 127.0.0.1 (gloo), rendezvous through a store this process hosts.
Bandwidth in GB/s (1e9 bytes per second), best of `--repeats` after one warm-up. The last
stdout line is one JSON object: {"bytes", "raw_p2p_gbps", "chunked_gbps"}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import add_target_args, finish  # noqa: E402


def worker(port: int, rank: int, nbytes: int, chunk_bytes: int, repeats: int) -> None:
    import torch

    from cells.transport.p2p import PairChannel, measure_raw_p2p
    from cells.transport.store import StoreAddress, connect

    torch.set_num_threads(1)
    store = connect(StoreAddress("127.0.0.1", port), timeout_s=60)
    with PairChannel(store, "bench/p2p", rank, timeout_s=120, connect_timeout_s=60) as ch:
        raw = measure_raw_p2p(ch, nbytes, repeats=repeats)
        chunked = measure_raw_p2p(ch, nbytes, chunk_bytes=chunk_bytes, repeats=repeats)
    if rank == 0:
        print(json.dumps({"raw": raw, "chunked": chunked}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 MiB instead of 256 MiB")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--bytes", type=int, default=None)
    ap.add_argument("--chunk-bytes", type=int, default=64 << 10,
                    help="one KV block of the embedded model is ~64 KiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=2, type=int, metavar=("PORT", "RANK"), help=argparse.SUPPRESS)
    add_target_args(ap)
    args = ap.parse_args()
    nbytes = args.bytes or ((8 << 20) if args.quick else (256 << 20))
    if args.worker:
        worker(*args.worker, nbytes, args.chunk_bytes, args.repeats)
        return

    from cells.transport.store import StoreHost

    host = StoreHost()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--bytes", str(nbytes), "--chunk-bytes", str(args.chunk_bytes),
           "--repeats", str(args.repeats), "--worker", str(host.address.port)]
    procs = [subprocess.Popen([*cmd, str(r)], stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    try:
        out = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(p.returncode for p in procs):
        sys.exit(f"worker failed: exit codes {[p.returncode for p in procs]}")
    r = json.loads(out[0].strip().splitlines()[-1])
    if not args.json:
        print(f"{nbytes / 2**20:.0f} MiB rank 0 -> rank 1 over gloo on 127.0.0.1")
        print(f"  one contiguous send : {r['raw']:.2f} GB/s")
        print(f"  {args.chunk_bytes // 1024} KiB chunks      : {r['chunked']:.2f} GB/s")
    finish({"bytes": nbytes, "raw_p2p_gbps": round(r["raw"], 3), "chunked_gbps": round(r["chunked"], 3)}, args, "p2p")


if __name__ == "__main__":
    main()
