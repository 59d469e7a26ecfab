"""Engine prototypes for training on cells: the gradient sum of one optimizer step, two ranks.

    python bench/train_engines.py [--quick] [--json]

Two processes (this file with `--child`: arguments and result as JSON, nothing pickled) sum a gradient over three engines, `repeats` times each (best of):
- `cells_gloo`: cellflip's stateless gloo group (`join_group` on a store, what a training step
  forms), one all-reduce of the bytes a step of the `tiny` preset reduces: the dense
  non-vocabulary parameters plus the union of the vocabulary rows the ranks touched (`rows`).
- `cells_gloo_dense`: the same group, the whole gradient dense (the embedding table too):
  what any engine that reduces parameters' `.grad` as they are (DDP, torchft's DDP) sends.
- `torchft`: torchft's `Manager` (a lighthouse in this process, one manager per replica,
  min_replica_size 2: both replicas in every quorum) over its `ProcessGroupGloo`: per step `start_quorum`, `allreduce` (SUM)
  of the same row-union buffer, `should_commit`.
- `fsdp2`: whether `fully_shard` runs over gloo on CPU at all (a default process group and a
  CPU device mesh): its gradient reduce-scatter needs `reduce_scatter`, which gloo lacks.
Needs torchft importable (`pip install torchft`); where it is not, that engine says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback

import torch
from common import ROOT, finish, parse_args, set_threads

DENSE_OTHER = 4_000_000  # tiny: non-vocabulary parameters (4 layers of d=256)
VOCAB, HIDDEN, ROWS = 151_936, 256, 2_000


def _ours(rank: int, port: int, repeats: int, dense: bool) -> tuple:
    from cells.transport.p2p import join_group
    from cells.transport.store import StoreAddress, connect

    store = connect(StoreAddress("127.0.0.1", port))
    pg = join_group(store, f"bench/{dense}/", rank, 2, timeout_s=60, connect_timeout_s=60, device=torch.device("cpu"))
    n = DENSE_OTHER + (VOCAB if dense else ROWS) * HIDDEN
    t = torch.ones(n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        pg.allreduce([t]).wait()
        best = min(best, time.perf_counter() - t0)
    return rank, best, n * 4


def _torchft(rank: int, port: int, lighthouse: str, repeats: int) -> tuple:
    try:
        from datetime import timedelta

        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port + 1 + rank), "RANK": "0",
                           "WORLD_SIZE": "1", "TORCHFT_LIGHTHOUSE": lighthouse})
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port + 1 + rank, is_master=True, wait_for_workers=False)  # noqa: F841
        state = {"w": torch.zeros(4)}
        m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=2,
                    load_state_dict=lambda s: state.update(s), state_dict=lambda: state,
                    replica_id=f"r{rank}", timeout=timedelta(seconds=60))
        t = torch.ones(DENSE_OTHER + ROWS * HIDDEN)
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            m.start_quorum()
            m.allreduce(t, reduce_op=torch.distributed.ReduceOp.SUM).wait()
            m.should_commit()
            best = min(best, time.perf_counter() - t0)
        got = (rank, best, m.num_participants())
        m.shutdown()
        return got
    except Exception as e:
        return rank, None, f"{type(e).__name__}: {e}"[:300]


def _fsdp2(rank: int, port: int) -> tuple:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        mesh = init_device_mesh("cpu", (2,))
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        fully_shard(model, mesh=mesh)
        model(torch.randn(8, 64)).sum().backward()
        return rank, True, "forward/backward ran"
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return rank, False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


ENGINES = {"ours": _ours, "torchft": _torchft, "fsdp2": _fsdp2}


def _run(engine: str, args_for) -> list:
    """Two ranks of `engine`, each a process running this file with `--child`; their results."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    ps = [subprocess.Popen([sys.executable, __file__, "--child", engine, json.dumps(args_for(r))],
                           stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    out = []
    for r, p in enumerate(ps):
        try:
            stdout, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        out.append(json.loads(lines[-1][len("RESULT "):]) if lines else [r, None, f"exit {p.returncode}, no result"])
    return sorted(out, key=lambda x: x[0])


def _child() -> None:
    """One rank: `--child ENGINE JSON_KWARGS`; prints `RESULT [rank, value, note]`."""
    set_threads(1)
    print("RESULT " + json.dumps(list(ENGINES[sys.argv[2]](**json.loads(sys.argv[3])))), flush=True)


def main() -> None:
    args = parse_args(__doc__)
    set_threads(1)
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    repeats = 3 if args.quick else 5
    from cells.localcluster import find_free_port
    from cells.transport.store import StoreHost

    host = StoreHost("127.0.0.1", 0)
    port = host.address.port
    res: dict = {"bytes_rows": (DENSE_OTHER + ROWS * HIDDEN) * 4, "bytes_dense": (DENSE_OTHER + VOCAB * HIDDEN) * 4}
    res["cells_gloo_s"] = max(r[1] for r in _run("ours", lambda r: {"rank": r, "port": port, "repeats": repeats, "dense": False}))
    res["cells_gloo_dense_s"] = max(r[1] for r in _run("ours", lambda r: {"rank": r, "port": port, "repeats": repeats, "dense": True}))
    try:
        from torchft._torchft import LighthouseServer

        lh = LighthouseServer(bind="[::]:0", min_replicas=2)
        base = find_free_port()
        got = _run("torchft", lambda r: {"rank": r, "port": base + 10 * r, "lighthouse": lh.address(), "repeats": repeats})
        res["torchft_s"] = max(r[1] for r in got) if all(r[1] is not None for r in got) else None
        res["torchft_note"] = [r[2] for r in got]
        lh.shutdown()
    except ImportError as e:
        res["torchft_s"], res["torchft_note"] = None, f"not importable: {e}"
    fport = find_free_port()
    res["fsdp2"] = [r[2] for r in _run("fsdp2", lambda r: {"rank": r, "port": fport})]
    finish(res, args, "train_engines")


if __name__ == "__main__":
    _child() if sys.argv[1:2] == ["--child"] else main()
