"""SGLang cells through the real cell agent, end to end: a real scheduler process on
127.0.0.1, and in this process real `CellAgent`s on threads, each driving an `SGLangEngine`
built on the recording fake (whose model is a pure function of weights, context, seed and
position, so a request moved to another cell continues token for token).

A flip to training moves the owning cell's request to the other cell (by re-prefill, or
through a shared KV store when both cells use one), hands the flipped cell's GPU memory to
training, and takes it back on the flip to rollout.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import subprocess
import sys
import threading

import fake_sglang
import pytest
import torch

from cells.agent import CellAgent
from cells.engine.records import SamplingParams
from cells.engine.sglang.engine import SGLangEngine
from cells.engine.sglang.migration import kv_store_identity
from cells.entry import cell_config
from cells.localcluster import ROOT, Cluster, Streamer, cluster_config
from scheduler.contract.config import CellflipConfig, parse_config
from scheduler.contract.config.engine import EmbeddedEngineConfig, SGLangEngineConfig

torch.set_num_threads(1)

TOKEN_DELAY_S = 0.02
"""Seconds per token on the fake: a request of MAX_TOKENS decodes for a few seconds."""
MAX_TOKENS = 150
MODEL = "fake-model"
CPU_BACKUP = {"enable_weights_cpu_backup": True}
"""Released weights keep a host copy, so a cell comes back from training serving its version
without a trainer to send it one."""
HICACHE = {**CPU_BACKUP, "enable_hierarchical_cache": True, "hicache_storage_backend": "file"}


class SGLangCells:
    """Cell agents on threads of this process, each with an SGLang engine on the fake."""

    def __init__(self, cluster: Cluster, prefix: str, n: int, server_args: dict,
                 store: fake_sglang.SharedStore | None = None) -> None:
        cfg = parse_config(cluster.cfg)
        eng_cfg = SGLangEngineConfig(model_path=MODEL, server_args=server_args)
        self.cluster = cluster
        self.stop_event = threading.Event()
        self.engines: dict[str, SGLangEngine] = {}
        self.threads: list[threading.Thread] = []
        for i in range(n):
            cell_id = f"{prefix}-{i}"
            mods, _ = fake_sglang.fake_modules(store=store, token_delay_s=TOKEN_DELAY_S, eos=-1)
            engine = SGLangEngine(eng_cfg, modules=mods)
            self.engines[cell_id] = engine
            agent = CellAgent(cfg, cell_id=cell_id, scheduler_url=cluster.url, engine=engine, token=cluster.tokens["cell"])
            assert not agent.training.keep_memory  # GPU memory goes back to the engine at every flip
            t = threading.Thread(target=agent.run, args=(self.stop_event,), name=f"agent-{cell_id}", daemon=True)
            self.threads.append(t)
            t.start()

    def fake(self, cell_id: str) -> fake_sglang.FakeEngine:
        return self.engines[cell_id].runtime.sglang

    def cells(self) -> list[dict]:
        """These cells as the scheduler shows them."""
        return [c for c in self.cluster.cells() if c["id"] in self.engines]

    def stop(self) -> None:
        """Stop the agents, close the engines, and wait until the scheduler has fenced these
        cells (the next test's placements must not pick them)."""
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in self.threads), "a cell agent did not stop"
        for engine in self.engines.values():
            engine.close()
        self.cluster.wait(lambda: all(c["state"] == "down" for c in self.cells()), 20, "stopped cells fenced")


_FLEETS = itertools.count()
"""Cell ids are unique across the module's tests (they share one scheduler)."""


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    """One scheduler process for this module's tests (each test brings its own cells)."""
    tmp = tmp_path_factory.mktemp("sglang-agent")
    engine = {"type": "sglang", "model_path": MODEL}
    # SGLang cells send no registration probe (as configs/gpu_cluster.yaml, trusted by their token)
    cluster = Cluster(tmp, num_cells=0, cfg=cluster_config(tmp, cells__engine=engine, scheduler__trust_unprobed_cells=True),
                      ready_timeout_s=30)
    yield cluster
    cluster.stop()


@pytest.fixture
def fleet(scheduler):
    """`start(server_args, store=None)`: two SGLang cells in rollout on the module's scheduler."""
    started: list[SGLangCells] = []

    def start(server_args: dict, store: fake_sglang.SharedStore | None = None) -> tuple[Cluster, SGLangCells]:
        cells = SGLangCells(scheduler, f"sgl{next(_FLEETS)}", 2, server_args, store)
        started.append(cells)
        scheduler.wait(lambda: [c["state"] for c in cells.cells()] == ["rollout"] * 2, 30, "two SGLang cells up")
        return scheduler, cells

    yield start
    for cells in started:
        cells.stop()


def reference(request_id: str, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    """The same request on one engine, never moved."""
    mods, _ = fake_sglang.fake_modules(eos=-1)
    eng = SGLangEngine(SGLangEngineConfig(model_path=MODEL), modules=mods)
    try:
        eng.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, seed=seed))
        out = []
        for _ in range(10 * max_tokens):
            out += [e.record.token_id for e in eng.step()]
            if not eng.has_work():
                return out
        raise AssertionError("the reference run did not finish")
    finally:
        eng.close()


def stream_and_flip(cluster: Cluster, cells: SGLangCells, prompt: list[int], seed: int) -> tuple[Streamer, str, dict]:
    """Stream a completion, flip its cell to training mid-decode; (stream, flipped cell, flip)."""
    s = Streamer(cluster.url, prompt, max_tokens=MAX_TOKENS, seed=seed, timeout_s=60, token=cluster.token)
    s.start()
    assert s.started.wait(30) and s.error is None, s.error
    cluster.wait(lambda: len(s.tokens) >= 10, 30, "tokens flowing")
    owners = [c["id"] for c in cells.cells() if c["inflight"]]
    assert len(owners) == 1, owners
    flip = cluster.flip(owners[0], "training")
    assert len(s.tokens) < MAX_TOKENS and s.finish_reason is None  # flipped mid-decode
    done = cluster.wait_flip(flip["id"], 30)
    s.join(60)
    assert not s.is_alive() and s.error is None, s.error
    assert done["state"] == "done", (done, cluster.logs())
    return s, owners[0], done


def check_stream(cluster: Cluster, s: Streamer, prompt: list[int], seed: int) -> None:
    """Every token, once, equal to the unmoved run, and in the session store."""
    assert s.finish_reason == "length" and len(s.tokens) == MAX_TOKENS, "a token was lost or doubled"
    assert s.tokens == reference(s.request_id, prompt, MAX_TOKENS, seed)
    assert cluster.sampled_tokens(s.session_id) == s.tokens


def submissions(fake: fake_sglang.FakeEngine, request_id: str) -> list[tuple]:
    """The fake's prefix-cache lookups for `request_id`'s submissions: (rid, salt, matched, where)."""
    return [h for h in fake.cache_hits if h[0].split("#")[0] == request_id]


def migrations_metric(cluster: Cluster, path: str) -> float:
    text = cluster.http.get("/metrics").text
    m = re.search(rf'cellflip_migrations_total\{{outcome="committed",path="{path}"\}} (\S+)', text)
    assert m is not None, f"no committed {path} migrations metric"
    return float(m.group(1))


@pytest.mark.timeout(90)
def test_flip_moves_a_request_by_reprefill_token_exact_and_hands_gpu_memory_over(fleet):
    cluster, cells = fleet(CPU_BACKUP)
    for c in cells.cells():
        caps = c["capabilities"]
        assert (caps["kv_export"], caps["weight_update"], caps["kv_store"], caps["update_ranks"]) == \
            (False, "in_place", None, 1), c  # tp 1, no scoring copy (publisher_copy)
        assert (c["max_running"], c["kv_blocks_total"], c["version"]) == (256, 0, 0), c

    prompt, seed = [11, 12, 13, 14, 15], 7
    moved = migrations_metric(cluster, "reprefill")
    s, victim, done = stream_and_flip(cluster, cells, prompt, seed)
    other = next(c for c in cells.engines if c != victim)
    assert (done["recomputed"], done["migrated"]) == (1, 0), done
    check_stream(cluster, s, prompt, seed)
    assert submissions(cells.fake(victim), s.request_id) and submissions(cells.fake(other), s.request_id)
    assert cells.engines[other].migrations_total == {"reprefill": 1}  # the start command named the path
    assert migrations_metric(cluster, "reprefill") == moved + 1

    # The flipped cell handed its GPU memory to training, once no request remained.
    vfake = cells.fake(victim)
    assert vfake.released == {"weights", "kv_cache"} and ("release_memory_occupation",) in vfake.log
    assert not vfake.gens and cells.engines[victim].state == "paused"
    assert cluster.cell(victim)["state"] == "training"

    # Back to rollout: the memory comes back and the cell serves again.
    back = cluster.wait_flip(cluster.flip(victim, "rollout")["id"], 30)
    assert back["state"] == "done", (back, cluster.logs())
    assert vfake.released == set() and ("resume_memory_occupation",) in vfake.log
    assert cells.engines[victim].state == "serving"
    away = cluster.wait_flip(cluster.flip(other, "training")["id"], 30)  # leaves the victim the only rollout cell
    assert away["state"] == "done", away
    prompt2, seed2 = [21, 22, 23], 3
    s2 = Streamer(cluster.url, prompt2, max_tokens=MAX_TOKENS, seed=seed2, timeout_s=60, token=cluster.token)
    s2.start()
    s2.join(60)
    assert not s2.is_alive() and s2.error is None, s2.error
    check_stream(cluster, s2, prompt2, seed2)
    assert submissions(vfake, s2.request_id) and not submissions(cells.fake(other), s2.request_id)


@pytest.mark.timeout(90)
def test_cells_sharing_a_kv_store_move_requests_through_it(fleet):
    store = fake_sglang.SharedStore()
    cluster, cells = fleet(HICACHE, store)
    identity = kv_store_identity(next(iter(cells.engines.values())).server_args)
    assert identity is not None and identity == kv_store_identity({**HICACHE, "model_path": MODEL, "tp_size": 1})
    assert [c["capabilities"]["kv_store"] for c in cells.cells()] == [identity, identity]

    prompt, seed = [31, 32, 33, 34], 5
    before = {path: migrations_metric(cluster, path) for path in ("kv_store", "reprefill")}
    s, victim, done = stream_and_flip(cluster, cells, prompt, seed)
    other = next(c for c in cells.engines if c != victim)
    assert (done.get("kv_store"), done["recomputed"], done["migrated"]) == (1, 0, 0), done
    check_stream(cluster, s, prompt, seed)
    assert migrations_metric(cluster, "kv_store") == before["kv_store"] + 1
    assert migrations_metric(cluster, "reprefill") == before["reprefill"]
    assert cells.engines[other].migrations_total == {"kv_store": 1}
    # Stopping the request on the source wrote its KV so far to the shared store, under the
    # version's salt (the destination's own entry is the whole finished request).
    partial = [toks for salt, toks in store.entries if salt == "cellflip-v0" and len(toks) < len(prompt) + MAX_TOKENS]
    assert len(partial) == 1 and list(partial[0]) == (prompt + s.tokens)[:len(partial[0])], store.entries
    assert cells.fake(victim).released == {"weights", "kv_cache"}


# -- `cellflip cell` -------------------------------------------------------------------

def _args(**kw):
    from argparse import Namespace

    return Namespace(**{"engine": None, "model_path": None, "tp": None, **kw})


def test_cell_flags_override_the_configured_engine():
    sglang = parse_config({"cells": {"engine": {"type": "sglang", "model_path": "a", "scoring": "cell_copy",
                                                "server_args": {"page_size": 16}}}})
    eng = cell_config(_args(tp=4), sglang).cells.engine
    assert (eng.model_path, eng.tp, eng.scoring, eng.server_args) == ("a", 4, "cell_copy", {"page_size": 16})
    eng = cell_config(_args(engine="sglang", model_path="/m", tp=2), CellflipConfig()).cells.engine
    assert isinstance(eng, SGLangEngineConfig) and (eng.model_path, eng.tp) == ("/m", 2)
    eng = cell_config(_args(engine="embedded", model_path="/ckpt"), sglang).cells.engine
    assert isinstance(eng, EmbeddedEngineConfig) and eng.model.path == "/ckpt"
    assert cell_config(_args(), sglang).cells.engine == sglang.cells.engine
    for args, needle in ((_args(engine="sglang"), "--model-path"), (_args(tp=2), "--tp"),
                         (_args(engine="sglang", model_path="m", tp=0), "tp")):
        with pytest.raises(SystemExit, match=needle):
            cell_config(args, CellflipConfig())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_cell_without_sglang_exits_with_the_adapters_message():
    out = subprocess.run([sys.executable, "-m", "cells.cli", "cell", "--engine", "sglang", "--model-path", "m",
                          "--scheduler", "http://127.0.0.1:9", "--cell-id", "c"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1
    assert "cellflip[gpu]" in out.stderr and "Traceback" not in out.stderr, out.stderr
