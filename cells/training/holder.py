"""A cell's side of holding the committed training state, in either role: it announces what it
holds (`protocol.holds_key`: the commit record, which a restarted trainer resumes from), and
answers the jobs the coordinator and peer ranks post (cells/training/jobs.py):

    serve       send the held state to a joining rank of a step this cell is not in (join.py)
    checkpoint  write the held state below a checkpoint root (safetensors plus a JSON manifest,
                cells/training/state_files.py), copied first and written off the loop
    put         keep the committed version's weights in this cell's version host
                (cells/transport/versions_host.py, rendezvousing on the trainer's store under a
                namespace of this cell), dropping the versions no longer live
    broadcast   broadcast a held version to the receivers the scheduler named; cells that
                missed it catch up from the same host
    export      the committed version as a Hugging Face directory

So a version is published by a cell that computed it, and catch-ups are served by the cell
that holds it: the trainer only names the receivers.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from cells.training import jobs, state_files
from cells.training import protocol as P
from cells.transport.store import set_json

log = logging.getLogger("cellflip.training")


class Holder:
    def __init__(self, worker: Any) -> None:
        self.w = worker
        self.store = None
        self.n = 1
        """The next job number on the current store."""
        self.host = None
        """This cell's version host (created by the first `put`)."""
        self.host_key: tuple | None = None

    def connected(self, store) -> None:
        """A (new) connection to the coordinator's store: the job numbers continue from what
        was already answered there, and the held state is announced."""
        self.store = store
        self.n = max(1, self.n if self.n <= jobs.posted(store, self.w.cell_id) + 1 else 1)
        self.announce()

    def announce(self) -> None:
        store, w = self.store, self.w
        if store is None or w.cell_rank:  # rank 0 speaks for a cell of several ranks
            return
        try:
            if w.tag is None or w.committed is None:
                store.delete_key(P.holds_key(w.cell_id))
            else:
                c = w.committed
                set_json(store, P.holds_key(w.cell_id), {"tag": w.tag, "version": c["version"],
                                                         "checksum": c["checksum"], "commit": c})
        except Exception as e:  # the store is gone: announced again on the next connection
            log.debug("announce failed: %s", e)

    def poll(self, store) -> None:
        job = jobs.next_job(store, self.w.cell_id, self.n)
        if job is None:
            return
        self.n += 1
        if self.w.cell_size > 1 and not self._mine(job):
            return
        try:
            result = getattr(self, f"_job_{job['op']}")(store, job)
        except Exception as e:
            log.exception("cell %s: job %s failed", self.w.cell_id, job.get("op"))
            result = {"ok": False, "error": str(e)[:300]}
        if result is not None:  # a cell's rank i > 0 answers its rank 0, which answers for the cell
            jobs.answer(store, job["id"] if not self.w.cell_rank else f"{job['id']}/rank{self.w.cell_rank}", result)

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
            self.host = None

    def _mine(self, job: dict) -> bool:
        """On a cell of several ranks: a peer's `serve` of slice i goes to rank i; every rank
        writes its own shard of a `checkpoint`; the other jobs are rank 0's."""
        if job["op"] == "serve":
            return int(job.get("shard", 0)) == self.w.cell_rank
        return job["op"] == "checkpoint" or self.w.cell_rank == 0

    # -- jobs ------------------------------------------------------------------------------
    def _job_ping(self, store, job: dict) -> dict:
        return {"ok": True, "tag": self.w.tag}

    def _job_serve(self, store, job: dict) -> dict | None:
        if self.w.cell_size > 1:
            from cells.training.sharded import serve as serve_slice

            serve_slice(self.w, store, job)
            return {"ok": True} if self.w.cell_rank == 0 else None
        from cells.training.join import serve

        serve(self.w, store, job)
        return {"ok": True}

    def _job_checkpoint(self, store, job: dict) -> dict | None:
        w = self.w
        if w.tag != job["commit"]["tag"]:
            return {"ok": False, "error": f"holds {w.tag}, not {job['commit']['tag']}"}
        if w.cell_size > 1:
            return self._checkpoint_shard(store, job)
        meta, flat, idx = w.packed()  # a copy already (packed now, or the parked buffers, never written)
        state = {"state": {"meta": meta, "values": flat, "rows": idx}, "commit": job["commit"]}

        def write() -> None:
            try:
                state_files.save_state(job["path"], state)
                jobs.answer(store, job["id"], {"ok": True, "path": job["path"]})
            except Exception as e:
                log.exception("checkpoint to %s failed", job["path"])
                jobs.answer(store, job["id"], {"ok": False, "error": str(e)[:300]})

        threading.Thread(target=write, name="checkpoint", daemon=False).start()
        return None  # answered by the writer

    def _checkpoint_shard(self, store, job: dict) -> dict | None:
        """Each rank of the cell writes its slices; rank 0 then the index naming them
        (cells/training/shard_files.py). Off the loop, from a copy."""
        from cells.rl.shard_state import pack_shard
        from cells.training import shard_files

        w, sub = self.w, shard_files.sub_dir(job)
        with w._lock:
            meta, flat = pack_shard(w.learner)

        def write() -> None:
            try:
                shard_files.write_packed(job["path"], sub, meta, flat, job["commit"])
                if w.cell_rank:
                    jobs.answer(store, f"{job['id']}/rank{w.cell_rank}", {"ok": True})
                    return
                for i in range(1, w.cell_size):
                    r = jobs.wait(store, f"{job['id']}/rank{i}", 600.0)
                    if not r.get("ok"):
                        raise RuntimeError(f"cell rank {i}: {r.get('error')}")
                shard_files.write_index(job["path"], sub, w.cell_size, job["commit"])
                jobs.answer(store, job["id"], {"ok": True, "path": job["path"]})
            except Exception as e:
                log.exception("checkpoint shard to %s failed", job["path"])
                jobs.answer(store, f"{job['id']}/rank{w.cell_rank}" if w.cell_rank else job["id"],
                            {"ok": False, "error": str(e)[:300]})

        threading.Thread(target=write, name="checkpoint", daemon=False).start()
        return None

    def _version_host(self, job: dict):
        from cells.transport.versions_host import VersionHost

        key = (self.w.source, job.get("bucket_bytes"), job.get("update_backend", "gloo"))
        if self.host is None or self.host_key != key:
            self.close()
            kw = {"bucket_bytes": int(job["bucket_bytes"])} if job.get("bucket_bytes") else {}
            self.host = VersionHost(store=self.w.source, namespace=namespace(self.w.cell_id),
                                    update_backend=job.get("update_backend", "gloo"), **kw)
            self.host.start()
            self.host_key = key
        return self.host

    def _job_put(self, store, job: dict) -> dict:
        host, version = self._version_host(job), int(job["version"])
        for v in host.versions():
            if v not in job.get("live", []) and v != version:
                host.drop(v)
        weights = self.w.weights_for(version)
        if weights is None:
            return {"ok": False, "error": f"version {version} is not the state this cell holds"}
        host.put(version, weights)
        return {"ok": True, "namespace": namespace(self.w.cell_id)}

    def _job_broadcast(self, store, job: dict) -> dict:
        host = self.host
        if host is None:
            return {"ok": False, "error": "no version host"}

        def send() -> None:
            try:
                r = host.broadcast(int(job["version"]), list(job["receivers"]), job.get("receiver_ranks") or {})
                jobs.answer(store, job["id"], {"ok": True, "delivered": r.delivered, "failed": r.failed,
                                               "seconds": r.seconds, "root": "cell", "cell": self.w.cell_id,
                                               "pid": os.getpid()})
            except Exception as e:
                log.exception("broadcast of version %s failed", job["version"])
                jobs.answer(store, job["id"], {"ok": False, "error": str(e)[:300]})

        threading.Thread(target=send, name="publish", daemon=True).start()
        return None

    def _job_export(self, store, job: dict) -> dict:
        """The committed version this cell holds as a Hugging Face directory (`path` already
        checked by the caller against its export root), written in this thread."""
        import torch

        from cells.engine.embedded.checkpoint import save_checkpoint
        from cells.training.protocol import spec_from_signature

        version, w = int(job["version"]), self.w
        weights = w.weights_for(version)
        if weights is None or w.hyper is None:
            return {"ok": False, "error": f"version {version} is not the state this cell holds"}
        spec = spec_from_signature(w.hyper["model"])
        save_checkpoint(job["path"], spec, weights, getattr(torch, job.get("dtype", "float32")),
                        source=job.get("source"), version=version)
        return {"ok": True, "path": job["path"]}

    def _job_drop(self, store, job: dict) -> dict:
        if self.host is not None:
            for v in self.host.versions():
                if v not in job.get("live", []):
                    self.host.drop(v)
        return {"ok": True}


def namespace(cell_id: str) -> str:
    """Where a cell's version host rendezvouses on the trainer's store."""
    return f"versions/{cell_id}"
