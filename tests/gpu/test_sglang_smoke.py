"""SGLang cells on one real GPU: what the fake cannot show (docs/GPU.md section 10 says how to
run it and what each part proves).

Needs CUDA and sglang (the `gpu` extra); skipped otherwise. No network: the model is a
random-weight Qwen3 checkpoint written to a temporary directory, SGLang starts without a
tokenizer. As in `cellflip cell`, the engine is built on the main thread and every call
after that runs on one thread named `engine`. Parts, in order, on one engine started with
deterministic inference:
  A  four requests: log-probs <= 0 and aligned with the tokens, each tagged with version 0;
  B  one request aborted mid-stream; another moved by re-prefill, token-exact against an
     unmoved twin that ran alone;
  C  version 1 over a gloo update group (through the join barrier) while two requests run:
     later tokens are tagged 1; an update whose trainer never says go ends within the bound;
  D  a catch-up install from host memory: peak GPU memory of this process and of the device,
     and /dev/shm, while the flattened buckets go in;
  E  release to training and back, installing the version that arrived meanwhile.
Then F (two engines, one after the other, sharing a HiCache file store): a request moved
through the store reports `cached_tokens` > 0 and continues token for token.
Measurements are printed (run with -s) and, with CELLFLIP_SMOKE_REPORT=path, written as JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from cells.engine.embedded.checkpoint import save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import ModelSpec
from cells.engine.records import EngineError, SamplingParams
from cells.engine.sglang.barrier import VERDICT_SLACK_S, sender_verdict
from cells.engine.sglang.weights import (
    TensorMeta,
    UpdateGroup,
    broadcast_bucket,
    flatten_bucket,
    join_update_group,
    plan_buckets,
)
from scheduler.contract.config.engine import SGLangEngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
                       reason="needs a CUDA device and sglang (pip install 'cellflip[gpu]')"),
]

SPEC = ModelSpec(hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1024,
                 vocab_size=8192, max_position=4096, tie_word_embeddings=False)
"""A small Qwen3: ~16 MB of embeddings and output layer in bf16, fast to start."""
SERVER_ARGS = {"disable_cuda_graph": True, "mem_fraction_static": 0.3, "context_length": 4096, "random_seed": 0}
"""No CUDA graphs (a faster start); a static pool of 30% of the GPU (~40 GB on an H200: what
part E hands to training and takes back)."""
CALL_TIMEOUT_S = 120.0
REPORT: dict = {}


class EngineThread:
    """One thread named like the cell agent's engine thread; every engine call runs on it."""

    def __init__(self) -> None:
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            fn, box, done = self._calls.get()
            if fn is None:
                return
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised on the caller's thread
                box["error"] = e
            done.set()

    def __call__(self, fn, timeout_s: float = CALL_TIMEOUT_S):
        box: dict = {}
        done = threading.Event()
        self._calls.put((fn, box, done))
        assert done.wait(timeout_s), f"engine call did not finish in {timeout_s}s"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stop(self) -> None:
        self._calls.put((None, None, None))


def write_checkpoint(path) -> dict[str, torch.Tensor]:
    weights = {k: v.to(torch.bfloat16) for k, v in init_weights(SPEC, seed=0).items()}
    save_checkpoint(path, SPEC, weights, dtype=torch.bfloat16)
    return weights


def version(seed: int) -> dict[str, torch.Tensor]:
    """A complete random version, in host memory, in the checkpoint's names and dtype."""
    return {k: v.to(torch.bfloat16) for k, v in init_weights(SPEC, seed=seed, std=0.05).items()}


def start_engine(model_path: str, server_args: dict | None = None, **kw):
    from cells.engine.sglang.engine import SGLangEngine

    cfg = SGLangEngineConfig(model_path=model_path, deterministic=True, scoring="publisher_copy")
    return SGLangEngine(cfg, server_args={**SERVER_ARGS, **(server_args or {})}, **kw)


def run_until(engine, done, limit_s: float = 60.0) -> list:
    """Step until `done(events so far)` (or no work is left); the events."""
    events: list = []
    deadline = time.monotonic() + limit_s
    while not done(events) and engine.has_work():
        assert time.monotonic() < deadline, "requests did not progress"
        events += engine.step()
    return events


def by_request(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        out.setdefault(e.request_id, []).append(e)
    return out


def report(part: str, **numbers) -> None:
    REPORT[part] = numbers
    print(f"[sglang smoke] {part}: {json.dumps(numbers)}")
    path = os.environ.get("CELLFLIP_SMOKE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(REPORT, f, indent=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-random")
    write_checkpoint(path)
    return str(path)


@pytest.fixture(scope="module")
def runner():
    r = EngineThread()
    yield r
    r.stop()


class TestOneEngine:
    """Parts A–E, in order, on one engine (the class's fixture closes it before part F)."""

    @pytest.fixture(scope="class")
    def engine(self, checkpoint, runner):
        torch.zeros(1, device="cuda")  # this process's CUDA context exists before any measurement
        t0 = time.monotonic()
        eng = start_engine(checkpoint)  # on the main thread, as `cellflip cell` builds it
        report("start", seconds=round(time.monotonic() - t0, 1))
        assert eng.capabilities.batch_invariant
        yield eng
        runner(eng.close)

    @pytest.mark.timeout(120)
    def test_a_four_requests_with_logprobs_and_versions(self, engine, runner):
        prompts = {f"a{i}": [10 + i, 20 + i, 30 + i] for i in range(4)}

        def run():
            for rid, prompt in prompts.items():
                engine.add_request(rid, prompt, SamplingParams(max_tokens=32, seed=i_of(rid)))
            return run_until(engine, lambda ev: False)

        got = by_request(runner(run))
        assert set(got) == set(prompts)
        for events in got.values():
            assert [e.index for e in events] == list(range(32)) and events[-1].finish_reason == "length"
            assert all(e.record.logprob <= 0.0 and 0 <= e.record.token_id < SPEC.vocab_size for e in events)
            assert {e.record.version for e in events} == {0}
        assert engine.version_tag_mismatches == 0 and not engine.ended_without_token

    @pytest.mark.timeout(120)
    def test_b_abort_and_a_reprefill_move_token_exact(self, engine, runner):
        prompt, params = [5, 6, 7, 8, 9], SamplingParams(max_tokens=48, seed=11)

        def twin():
            engine.add_request("m", prompt, params)
            return [e.record.token_id for e in run_until(engine, lambda ev: False)]

        def moved():
            engine.add_request("m", prompt, params)
            engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=400, seed=1))
            engine.add_request("y", [4, 5], SamplingParams(max_tokens=400, seed=2))
            head = run_until(engine, lambda ev: sum(e.request_id == "m" for e in ev) >= 12)
            assert any(e.request_id == "x" for e in head)
            engine.abort("x")  # mid-stream
            ids = prompt + [e.record.token_id for e in head if e.request_id == "m"]
            engine.abort("m")  # moved away: the scheduler re-prefills it from the session's tokens
            engine.add_request("m", ids, params, prompt_len=len(prompt), path="reprefill")
            tail = run_until(engine, lambda ev: any(e.request_id == "m" and e.finish_reason for e in ev))
            engine.abort("y")
            return ids[len(prompt):], head, tail

        want = runner(twin)
        moved_head, head, tail = runner(moved)
        assert not [e for e in tail if e.request_id == "x"], "tokens of an aborted request arrived"
        got = moved_head + [e.record.token_id for e in tail if e.request_id == "m"]
        assert got == want, "the re-prefilled request did not continue token for token"
        assert engine.migrations_total["reprefill"] == 1 and not engine.has_work()

    @pytest.mark.timeout(180)
    def test_c_version_update_over_gloo_while_requests_run(self, engine, runner, free_port):
        v1 = version(1)
        sender = GlooSender(free_port, "smoke-v1", v1)

        def run():
            for rid in ("c0", "c1"):
                engine.add_request(rid, [7, 7, 7], SamplingParams(max_tokens=64, seed=3))
            before = run_until(engine, lambda ev: len(ev) >= 8)
            t0 = time.monotonic()
            engine.receive_version(1, sender.group, sender.buckets)
            pause = time.monotonic() - t0
            return before, run_until(engine, lambda ev: False), pause

        before, after, pause = runner(run)
        sender.join()
        assert {e.record.version for e in before} == {0}
        for rid, events in by_request(before + after).items():  # tokens that were on their way
            assert [e.index for e in events] == list(range(64)), rid  # still carry version 0
            versions = [e.record.version for e in events]
            assert versions == sorted(versions) and versions[-1] == 1 and set(versions) == {0, 1}, rid
        assert engine.version == 1 and engine.state == "serving" and engine.version_tag_mismatches == 0
        report("update_over_gloo", pause_s=round(pause, 3), buckets=len(sender.buckets))
        self._trainer_never_joins(engine, runner)

    @staticmethod
    def _trainer_never_joins(engine, runner) -> None:
        port = _free_port()
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                           timeout=timedelta(seconds=30))
        group = UpdateGroup("127.0.0.1", port, 1, 2, "smoke-v2-dead", "gloo", barrier_s=3.0)
        buckets = plan_buckets([TensorMeta.of(n, t) for n, t in version(2).items()], 8 << 20)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="weights unchanged"):
            runner(lambda: engine.receive_version(2, group, buckets))
        elapsed = time.monotonic() - t0
        assert elapsed < 3.0 + VERDICT_SLACK_S + 10.0, elapsed
        assert engine.version == 1 and engine.state == "serving" and engine.engine_restarts == 0
        report("trainer_never_joins", seconds=round(elapsed, 1))
        del store

    @pytest.mark.timeout(180)
    def test_d_catch_up_install_memory(self, engine, runner):
        v2 = version(2)
        engine.tensor_bucket_bytes = 4 << 20
        largest = max(t.numel() * t.element_size() for t in v2.values())
        sampler = MemorySampler()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sampler.start()
        runner(lambda: engine.load_weights(2, v2))
        sampler.stop()
        own_peak = torch.cuda.max_memory_allocated() - base
        report("catch_up_install", own_peak_bytes=own_peak, device_drop_bytes=sampler.device_drop,
               shm_growth_bytes=sampler.shm_growth, model_bytes=sum(t.numel() * 2 for t in v2.values()),
               bucket_bytes=engine.tensor_bucket_bytes)
        assert own_peak <= max(largest, engine.tensor_bucket_bytes) + (1 << 20)
        assert sampler.shm_growth < (1 << 20), "tensors went through shared memory"
        assert sampler.device_drop < 4 * max(largest, engine.tensor_bucket_bytes) + (256 << 20)

        def serve():
            engine.add_request("d", [3, 1, 4], SamplingParams(max_tokens=8, seed=4))
            return run_until(engine, lambda ev: False)

        assert {e.record.version for e in runner(serve)} == {2}

    @pytest.mark.timeout(180)
    def test_e_release_to_training_and_back(self, engine, runner):
        v3 = version(3)

        def run():
            free_before = torch.cuda.mem_get_info()[0]
            engine.enter_role("training")
            free_training = torch.cuda.mem_get_info()[0]
            engine.install_prepared(3, engine.prepare_weights(v3))  # arrives while training
            engine.enter_role("rollout")
            engine.add_request("e", [2, 7, 1, 8], SamplingParams(max_tokens=8, seed=5))
            return free_before, free_training, run_until(engine, lambda ev: False)

        free_before, free_training, events = runner(run)
        report("release", freed_bytes=free_training - free_before)
        assert free_training - free_before > 1 << 30, "releasing weights and KV cache freed under 1 GiB"
        assert len(events) == 8 and {e.record.version for e in events} == {3} and engine.state == "serving"


def i_of(rid: str) -> int:
    return int(rid[1:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooSender:
    """The trainer of one version: rank 0 of a gloo update group, behind the join barrier."""

    def __init__(self, port: int, name: str, tensors: dict[str, torch.Tensor], barrier_s: float = 30.0) -> None:
        self.store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=60))
        self.group = UpdateGroup("127.0.0.1", port, 1, 2, name, "gloo", barrier_s=barrier_s)
        self.buckets = plan_buckets([TensorMeta.of(n, t) for n, t in tensors.items()], 8 << 20)
        self._tensors, self.error = tensors, None
        self._thread = threading.Thread(target=self._send, name="trainer", daemon=True)
        self._thread.start()

    def _send(self) -> None:
        try:
            missing = sender_verdict(self.store, self.group.group_name, {"cell": 1}, self.group.barrier_s)
            assert not missing, missing
            pg = join_update_group(replace(self.group, rank_offset=0), 0, 60.0, store=self.store)
            for b in self.buckets:
                broadcast_bucket(pg, flatten_bucket([self._tensors[n] for n in b.names]), 60.0)
        except BaseException as e:  # checked by join()
            self.error = e

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive() and self.error is None, self.error


class MemorySampler:
    """Device-wide free GPU memory and /dev/shm use, sampled on a thread."""

    def __init__(self) -> None:
        self.device_drop = 0
        self.shm_growth = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._free0 = torch.cuda.mem_get_info()[0]
        self._shm0 = shutil.disk_usage("/dev/shm").used
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.device_drop = max(self.device_drop, self._free0 - torch.cuda.mem_get_info()[0])
            self.shm_growth = max(self.shm_growth, shutil.disk_usage("/dev/shm").used - self._shm0)
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.timeout(300)
def test_f_two_engines_share_a_hicache_file_store(checkpoint, runner, tmp_path):
    """A moves a request out (its KV written through to the store) and shuts down; B, on the
    same store, model, tp and page size, resumes it through the store."""
    hicache = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file", "page_size": 16,
               "hicache_write_policy": "write_through", "hicache_storage_prefetch_policy": "wait_complete",
               "hicache_size": 2, "hicache_storage_backend_extra_config": json.dumps(
                   {"file_storage_path": str(tmp_path / "hicache"), "prefetch_threshold": 64})}
    prompt, params = list(range(100, 420)), SamplingParams(max_tokens=48, seed=21)
    a = start_engine(checkpoint, hicache)

    def on_a():
        a.add_request("f", prompt, params)
        want = [e.record.token_id for e in run_until(a, lambda ev: False)]
        a.add_request("f", prompt, params)
        ids = prompt + [e.record.token_id for e in run_until(a, lambda ev: len(ev) >= 24)]
        a.abort("f")  # moved out: its KV is written through to the store
        time.sleep(3.0)  # the write-through to the store finishes before A goes away
        return want, ids, a.capabilities.kv_store

    want, ids, store = runner(on_a)
    runner(a.close)
    b = start_engine(checkpoint, hicache)
    try:
        def on_b():
            b.add_request("f", ids, params, prompt_len=len(prompt), path="kv_store")
            return run_until(b, lambda ev: False)

        tail = runner(on_b)
        report("hicache_move", cached_tokens=b.kv_store_cached_tokens, moved_tokens=len(ids))
        assert store == b.capabilities.kv_store is not None  # the planner's condition for the kv_store path
        assert b.kv_store_moves["hit"] == 1 and b.kv_store_cached_tokens > 0
        assert ids[len(prompt):] + [e.record.token_id for e in tail] == want
    finally:
        runner(b.close)
