"""bench/train.py's checks of the model in and out, each on bare training ranks of its own and
a coordinator that holds no state (the `toy` preset):

- pretrained_start: a Hugging Face directory written here; the ranks start from it (their
  joined checksum before the first update is its weights'), and the update moves them.
- export_roundtrip: versions v-1 and v exported by the cell holding each; in a separate
  process (so this one receives no tensor), v is fetched from the publishing cell's version
  host as a rollout cell gets it and served by an embedded engine, and the export of v served
  by a fresh engine: bitwise the same log-probs on 4 prompts; the export of v-1 not.
- resume_exact: an uninterrupted run checkpoints after every update; a second run's ranks
  and coordinator are killed between the commit of u2 and its checkpoint; restarted (new
  ranks, a new coordinator resuming at the checkpoint of u1), it redoes u2 and u3. Its state
  at u3 -- parameters, moments, EWMA, reference, step counts, learning-rate position,
  generator, data cursor -- equals the uninterrupted run's bitwise (and the state at u2 does
  not: `resume_negative_ok`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import PRESETS
from cells.training import jobs, state_files
from cells.training.resume import find_committed
from cells.training.wire import weights_checksum
from cells.transport.store import StoreHost

SPEC = PRESETS["toy"]


def _kill(procs) -> None:
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def pretrained_start(start_ranks, coordinator, batch) -> bool:
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-hf-"))
    theirs = init_weights(SPEC, 7, 0.05)
    src = save_checkpoint(tmp / "their-model", SPEC, theirs)
    host = StoreHost("127.0.0.1", 0)
    procs = start_ranks(tmp, host.address, 1, first=20)
    try:
        coord = coordinator(host.address, SPEC, start={"kind": "path", "path": str(src)})
        m = coord.update(batch(SPEC, 8, 0), ["cell-20"], next_version=lambda: coord.version + 1)
    finally:
        _kill(procs)
        host.close()
    return int(m["joined_checksum"]) == weights_checksum(theirs) and int(m["checksum"]) != weights_checksum(theirs)


def export_roundtrip(start_ranks, coordinator, batch) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-export-"))
    host = StoreHost("127.0.0.1", 0)
    procs = start_ranks(tmp, host.address, 1, first=30)
    try:
        coord = coordinator(host.address, SPEC)
        paths = {}
        for s in range(2):
            coord.update(batch(SPEC, 8, s), ["cell-30"], next_version=lambda: coord.version + 1)
            paths[coord.version] = str(tmp / f"v{coord.version}")
            r = jobs.wait(coord.store, jobs.post(coord.store, "cell-30", {"op": "export", "version": coord.version,
                                                                         "path": paths[coord.version]}), 120)
            if not r.get("ok"):
                raise RuntimeError(f"export failed: {r}")
        v = coord.version
        put = jobs.wait(coord.store, jobs.post(coord.store, "cell-30", {"op": "put", "version": v, "live": [v]}), 120)
        a = host.address
        r = subprocess.run([sys.executable, __file__, "--verify", f"{a.host}:{a.port}", put["namespace"], str(v),
                            paths[v], paths[v - 1]], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"export verification failed: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        _kill(procs)
        host.close()


def _verify(address: str, namespace: str, version: int, export: str, before: str) -> dict:
    """In its own process: v as a rollout cell receives it (a catch-up from the publishing
    cell), served; the exports of v and v-1 served by fresh engines."""
    from cells.engine.embedded import EmbeddedEngine
    from cells.transport.receive import fetch_version
    from cells.transport.store import StoreAddress
    from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

    torch.set_num_threads(1)
    h, p = address.rsplit(":", 1)
    weights = fetch_version(StoreAddress(h, int(p)), "verifier", version, timeout_s=120, namespace=namespace)
    served = EmbeddedEngine(spec=SPEC, weights=weights)
    ids = list(SPEC.output_ids())
    prompts = [[ids[(7 * i + 3 * j) % len(ids)] for j in range(12 + 5 * i)] for i in range(4)]

    def engine(path: str):
        return EmbeddedEngine(EmbeddedEngineConfig(model=ModelConfig(preset=None, path=path)))

    exported, older = engine(export), engine(before)
    same = all(torch.equal(served.score(q), exported.score(q)) for q in prompts)
    differs = not all(torch.equal(served.score(q), older.score(q)) for q in prompts)
    return {"export_roundtrip_bitwise": same, "export_negative_ok": differs}


def resume_exact(start_ranks, coordinator, batch) -> dict:
    batches = [batch(SPEC, 8, s) for s in range(3)]
    packed = []
    for run in ("uninterrupted", "interrupted"):
        interrupted = run == "interrupted"
        tmp = Path(tempfile.mkdtemp(prefix="cellflip-train-resume-"))
        host = StoreHost("127.0.0.1", 0)
        ckpt, cells = tmp / "ckpt", ["cell-40", "cell-41"]
        procs = start_ranks(tmp, host.address, 2, first=40)
        try:
            coord = coordinator(host.address, SPEC)
            while coord.version < 3:
                c = coord
                c.update(batches[c.version], cells, next_version=lambda c=c: c.version + 1, cursor=10 * (c.version + 1))
                if interrupted and coord.version == 2:  # killed after the commit, before its checkpoint
                    interrupted = False
                    _kill(procs)
                    procs = start_ranks(tmp, host.address, 2, first=42)
                    cells = ["cell-42", "cell-43"]
                    coord = coordinator(host.address, SPEC)
                    coord.adopt(*find_committed(coord.store, cells, ckpt, wait_s=2))
                    continue
                coord.checkpoint_done(coord.checkpoint(str(ckpt)), str(ckpt), 120)
                if run == "uninterrupted" and coord.version == 2:
                    before = state_files.load_packed(ckpt)
            packed.append(state_files.load_packed(ckpt))
        finally:
            _kill(procs)
            host.close()
    (ma, fa, ia), (mb, fb, ib) = packed
    exact = ma == mb and torch.equal(fa, fb) and torch.equal(ia, ib) and ma["version"] == 3 and ma["cursor"] == 30
    # negative control: the comparison tells the state one update earlier apart
    m2, f2, i2 = before
    negative = not (m2 == mb and f2.shape == fb.shape and torch.equal(f2, fb) and torch.equal(i2, ib))
    return {"resume_exact": exact, "resume_negative_ok": negative}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verify"]:
        print(json.dumps(_verify(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])))
