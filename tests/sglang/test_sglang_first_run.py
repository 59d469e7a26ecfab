"""What would break on the first real SGLang run, against the fake made strict enough to show it:
aborts off SGLang's loop, two NCCL ranks on one GPU, whole-model tensor updates, prefix
aborts, releases before the drain, store identities that cannot hit, update groups that
wait forever for a member. Every engine call here runs on a thread named `engine`, as in
the cell agent, after the engine was built on the main thread (as `cellflip cell` does)."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import fake_sglang
import pytest
import torch
from safetensors.torch import save_file

from cells.engine.records import EngineError, SamplingParams
from cells.engine.sglang import backend as sb
from cells.engine.sglang.barrier import VERDICT_SLACK_S, joined_key, verdict_key
from cells.engine.sglang.engine import SGLangEngine
from cells.engine.sglang.migration import kv_store_identity
from cells.engine.sglang.weights import BucketSpec, UpdateGroup
from cells.transport.store import set_json
from scheduler.contract.config import ConfigError, parse_config
from scheduler.contract.config.engine import SGLangEngineConfig

W = BucketSpec(("w",), ("bfloat16",), ((2, 2),))
HICACHE = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}

_ENGINES: list[SGLangEngine] = []


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def make(model_path: str = "m", *, store=None, tp: int = 1, deterministic: bool = False, scoring="publisher_copy",
         token_delay_s: float = 0.0, **kw) -> tuple[SGLangEngine, fake_sglang.FakeEngine]:
    mods, _ = fake_sglang.fake_modules(store=store, token_delay_s=token_delay_s)
    cfg = SGLangEngineConfig(model_path=model_path, tp=tp, deterministic=deterministic, scoring=scoring)
    eng = SGLangEngine(cfg, modules=mods, **kw)
    _ENGINES.append(eng)
    return eng, eng.runtime.sglang


def on_engine_thread(fn, *args, **kwargs):
    """Run `fn` on a thread named like the agent's engine thread; return or re-raise."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name="engine")
    t.start()
    t.join(60)
    assert not t.is_alive(), "the engine thread did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def drain(engine, limit: int = 500) -> list:
    events = []
    for _ in range(limit):
        events += engine.step()
        if not engine.has_work():
            break
    return events


def steps(engine, n: int) -> list:
    events = []
    while len(events) < n:
        events += engine.step()
    return events


def names(log) -> list[str]:
    return [e[0] for e in log]


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"a": torch.zeros(8, 4), "b": torch.zeros(16, dtype=torch.bfloat16), "c": torch.zeros(3)},
              str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def full_version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8, 4, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16),
            "c": torch.randn(3, generator=g)}


# -- 1. every SGLang call inside the engine's loop --------------------------------------

def test_the_fake_refuses_an_abort_off_the_loop_and_a_control_call_inside_it():
    eng, fake = make()
    with pytest.raises(RuntimeError, match="no current event loop in thread 'engine'"):
        on_engine_thread(fake.tokenizer_manager.abort_request, rid="x")

    async def nested():
        fake.begin_weight_update()

    with pytest.raises(RuntimeError, match="already running"):
        fake._loop.run_until_complete(nested())


def test_aborts_and_updates_work_from_the_engine_thread(checkpoint):
    eng, fake = make(checkpoint)

    def run():
        for rid in ("a", "b", "c", "d"):
            eng.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=60))
        steps(eng, 8)
        for rid in ("a", "b", "c"):
            eng.abort(rid)
        eng.load_weights(1, full_version(1))  # every request left is restarted: abort, resubmit
        return drain(eng)

    tail = on_engine_thread(run)
    aborted = [e[1] for e in fake.log if e[0] == "abort"]
    assert [r.split("#")[0] for r in aborted] == ["a", "b", "c", "d"]
    assert {e.request_id for e in tail} == {"d"}
    assert tail[-1].record.version == 1 and eng.state == "serving"


# -- 2. no two NCCL ranks on one GPU ------------------------------------------------------

def test_cell_copy_with_nccl_updates_is_refused_at_config_load():
    engine = {"type": "sglang", "model_path": "m", "scoring": "cell_copy"}
    with pytest.raises(ConfigError, match="cell_copy.*nccl"):
        parse_config({"cells": {"engine": engine}, "versions": {"update_backend": "nccl"}})
    parse_config({"cells": {"engine": engine}, "versions": {"update_backend": "gloo"}})
    parse_config({"cells": {"engine": {**engine, "scoring": "publisher_copy"}}, "versions": {"update_backend": "nccl"}})


class Scorer:
    device = "cpu"

    def score(self, token_ids, *, temperature=1.0):
        return torch.zeros(len(token_ids) - 1)

    def load_weights(self, version, tensors):
        pass


def test_a_scoring_copy_never_joins_an_nccl_group():
    eng, fake = make(scoring="cell_copy", scorer=Scorer())
    fake.log.clear()
    with pytest.raises(EngineError, match="NCCL"):
        eng.receive_version(1, UpdateGroup("127.0.0.1", 1, 1, 3, "g", "nccl"), [W])
    assert fake.log == [] and eng.version == 0 and eng.state == "serving"


# -- 3. tensor installs in flattened buckets ----------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_a_version_from_tensors_travels_in_flattened_buckets_in_one_session(checkpoint, tp):
    eng, fake = make(checkpoint, tp=tp)
    eng.tensor_bucket_bytes = fake.max_tensor_payload_bytes = 128  # "a" is 128 bytes: alone
    v1 = full_version(1)
    fake.log.clear()
    on_engine_thread(eng.load_weights, 1, v1)
    calls = names(fake.log)
    updates = [i for i, n in enumerate(calls) if n == "update_weights_from_tensor"]
    assert len(updates) == 2 and calls.index("begin_weight_update") < updates[0]
    assert updates[-1] < calls.index("end_weight_update") and calls.count("begin_weight_update") == 1
    assert [flush for _, _, flush in fake.tensor_payloads] == [False, True]  # flushed once, after the last
    assert [n for n, _, _ in fake.tensor_payloads] == [128, 32 + 12]
    assert {d for _, d, _ in fake.tensor_payloads} == {str(eng.update.update_device)}
    assert all(torch.equal(fake.weights[k], v) for k, v in v1.items()) and eng.version == 1
    assert fake_sglang._PAYLOADS == {}  # every rank decoded its own payload, once


def test_the_fake_refuses_a_whole_model_call_and_an_oversized_bucket(checkpoint):
    eng, fake = make(checkpoint)
    fake.begin_weight_update()
    with pytest.raises(AssertionError, match="unsharded"):
        fake.update_weights_from_tensor(named_tensors=list(full_version(1).items()))
    fake.end_weight_update()
    fake.max_tensor_payload_bytes = 64
    with pytest.raises(EngineError, match="over 64 bytes"):
        eng.load_weights(1, full_version(1))  # the adapter's 512 MB buckets are over this fake's bound
    assert eng.state == "broken"


def test_a_version_deferred_during_training_installs_in_buckets(checkpoint):
    eng, fake = make(checkpoint)
    eng.tensor_bucket_bytes = 128

    def run():
        eng.enter_role("training")
        eng.install_prepared(2, eng.prepare_weights(full_version(2)))
        fake.tensor_payloads.clear()
        eng.enter_role("rollout")

    on_engine_thread(run)
    assert [flush for _, _, flush in fake.tensor_payloads] == [False, True] and eng.version == 2


# -- 4. deterministic inference where exactness is promised -------------------------------

def test_deterministic_inference_comes_from_the_config():
    eng, fake = make(deterministic=True)
    assert fake.server_args["enable_deterministic_inference"] is True and eng.capabilities.batch_invariant
    assert eng.model_signature["deterministic"] is True
    with pytest.raises(EngineError, match="deterministic"):
        make(deterministic=True, server_args={"enable_deterministic_inference": False})
    plain, fake2 = make()
    assert "enable_deterministic_inference" not in fake2.server_args and not plain.capabilities.batch_invariant


# -- 5. update-group liveness -----------------------------------------------------------

@pytest.fixture
def sender_store(free_port):
    """The trainer's rendezvous store, with nobody there to give a verdict."""
    return torch.distributed.TCPStore("127.0.0.1", free_port, is_master=True, wait_for_workers=False,
                                      timeout=timedelta(seconds=10))


def test_an_update_whose_sender_never_says_go_ends_within_the_bound(sender_store, free_port):
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=40))
    steps(eng, 2)
    group = UpdateGroup("127.0.0.1", free_port, 1, 2, "v1", "gloo", barrier_s=0.5)
    fake.log.clear()
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="weights unchanged"):
        on_engine_thread(eng.receive_version, 1, group, [W])
    assert time.monotonic() - t0 < 0.5 + VERDICT_SLACK_S + 3.0
    assert sender_store.check([joined_key("v1", 1)])  # it did say it joined
    assert "init_weights_update_group" not in names(fake.log)  # nothing was formed
    assert eng.version == 0 and eng.state == "serving" and names(fake.log)[-1] == "continue"
    assert len(drain(eng)) > 0


def test_an_abort_verdict_leaves_the_weights_alone(sender_store, free_port):
    eng, fake = make()
    set_json(sender_store, verdict_key("v1"), {"go": False, "reason": "['cell-9'] did not join"})
    with pytest.raises(EngineError, match="cell-9"):
        eng.receive_version(1, UpdateGroup("127.0.0.1", free_port, 1, 2, "v1", "gloo", barrier_s=5.0), [W])
    assert eng.version == 0 and eng.state == "serving" and eng.engine_restarts == 0


def test_a_failure_after_joining_restarts_the_engine(sender_store, free_port):
    eng, old = make(server_args={"enable_weights_cpu_backup": True})
    eng.add_request("a", [1], SamplingParams(max_tokens=40))
    first = steps(eng, 2)
    set_json(sender_store, verdict_key("v1"), {"go": True, "reason": ""})
    old.fail["update_weights_from_distributed"] = "NCCL error: remote process exited"
    with pytest.raises(EngineError, match="restarted"):
        on_engine_thread(eng.receive_version, 1, UpdateGroup("127.0.0.1", free_port, 1, 2, "v1", "nccl",
                                                             barrier_s=5.0), [W])
    new = eng.runtime.sglang
    assert new is not old and old.shut_down and eng.engine_restarts == 1
    assert eng.state == "broken" and eng.summary().version is None and "a" in eng.requests
    with pytest.raises(EngineError, match="no complete weight version"):
        eng.add_request("b", [1], SamplingParams())
    on_engine_thread(eng.receive_version, 1, UpdateGroup("127.0.0.1", 1, 1, 2, "v1b", "nccl"), [W])
    rest = drain(eng)  # the request goes on, on the new engine, under version 1
    assert [e.index for e in first + rest] == list(range(40)) and rest[-1].record.version == 1
    assert any(rid.startswith("a#") for rid, _, _ in new.produced)


def test_nccl_failures_are_made_to_raise_before_sglang_starts(monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    seen = {}

    class Probe(fake_sglang.FakeEngine):
        def __init__(self, **server_args):
            seen["mode"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            super().__init__(**server_args)

    mods, _ = fake_sglang.fake_modules()
    eng = SGLangEngine(SGLangEngineConfig(model_path="m"), modules=sb.SGLangModules(
        Probe, mods.io_struct, "fake", mods.tensor_bucket, mods.serialize))
    _ENGINES.append(eng)
    assert seen["mode"] == "2"


# -- 6. kv_store: identity, and hits that really happened -------------------------------

def test_store_identity_carries_model_tp_and_page_size():
    base = sb.server_kwargs("m", 1, 0.8, HICACHE)
    ident = kv_store_identity(base)
    assert ident.startswith("file:")
    for change in ({"tp_size": 2}, {"page_size": 64}, {"model_path": "other"}, {"served_model_name": "x"}):
        assert kv_store_identity({**base, **change}) != ident, change
    assert kv_store_identity(base, "shared") != kv_store_identity({**base, "tp_size": 2}, "shared")
    a, _ = make(server_args={**HICACHE, "page_size": 16})
    b, _ = make(server_args={**HICACHE, "page_size": 64})
    assert a.capabilities.kv_store != b.capabilities.kv_store  # the planner never moves by kv_store between them


@pytest.mark.parametrize("store_has_it", [True, False])
def test_kv_store_moves_count_what_sglang_found_cached(store_has_it):
    store = fake_sglang.SharedStore()
    src, _ = make(store=store, server_args=HICACHE)
    dst, _ = make(store=store, server_args=HICACHE)
    params = SamplingParams(max_tokens=30)
    src.add_request("r", [1, 2, 3, 4], params)
    ids = [1, 2, 3, 4] + [e.record.token_id for e in steps(src, 5)]
    src.abort("r")  # moved by the scheduler through the shared store
    src.step()  # SGLang ends the aborted request and writes its KV through to the store
    if not store_has_it:
        store.entries.clear()  # evicted before the destination asked
    dst.add_request("r", ids, params, prompt_len=4, path="kv_store")
    steps(dst, 1)
    if store_has_it:
        assert dst.kv_store_moves == {"hit": 1} and dst.kv_store_cached_tokens == len(ids)
    else:
        assert dst.kv_store_moves == {"miss": 1} and dst.kv_store_cached_tokens == 0
    assert dst.migrations_total == {"kv_store": 1}


# -- 7. aborts match by prefix in SGLang ----------------------------------------------

def test_aborting_one_request_never_stops_another_whose_id_it_prefixes():
    eng, fake = make()
    # Without a terminator these would be SGLang ids `a#0` and `a#0x#1`: aborting the first
    # would stop both.
    eng.add_request("a", [1], SamplingParams(max_tokens=30))
    eng.add_request("a#0x", [1], SamplingParams(max_tokens=30))
    steps(eng, 2)
    eng.abort("a")
    got = drain(eng)
    assert {e.request_id for e in got} == {"a#0x"} and got[-1].finish_reason == "length"


def test_submission_ids_are_prefix_free():
    ids = ["a", "a#1", "a#10", "a;", "a%23", "a#0x", "", "#", "%", "x;y#z"]
    rids = [sb.submission_rid(r, n) for r in ids for n in (0, 1, 10, 11, 100)]
    assert len(set(rids)) == len(rids)
    assert not [(p, q) for p in rids for q in rids if p != q and q.startswith(p)]


# -- 8. release only after the drain -----------------------------------------------------

def test_release_waits_for_aborted_streams_to_end():
    eng, fake = make(token_delay_s=0.05)  # SGLang's scheduler ends an aborted stream some time later

    def run():
        eng.add_request("a", [1], SamplingParams(max_tokens=50))
        steps(eng, 2)
        eng.abort("a")  # SGLang still holds the request until its stream ends
        assert fake.gens
        eng.release_memory(["kv_cache"])

    on_engine_thread(run)
    log = names(fake.log)
    assert log.index("abort") < log.index("release_memory_occupation") and not fake.crashed
    assert fake.released == {"kv_cache"}


def test_a_release_on_a_busy_engine_kills_sglangs_scheduler_in_the_fake():
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    steps(eng, 1)
    with pytest.raises(AssertionError, match="idle"):
        fake.release_memory_occupation(tags=["kv_cache"])
    assert fake.crashed
    with pytest.raises(RuntimeError, match="died"):
        fake.begin_weight_update()


def test_an_abort_echo_during_a_restart_does_not_end_the_request(checkpoint):
    """Running the abort inside SGLang's loop lets the old submission's stream move too: its
    abort echo may arrive before the resubmission. It belongs to the old submission."""
    eng, fake = make(checkpoint)
    abort = eng.runtime.abort

    async def turns(n: int):
        import asyncio
        for _ in range(n):
            await asyncio.sleep(0)

    def abort_then_echo(rid: str) -> None:
        abort(rid)
        eng.runtime.loop.run_until_complete(turns(5))  # SGLang's abort echo arrives meanwhile

    eng.runtime.abort = abort_then_echo
    eng.add_request("a", [1], SamplingParams(max_tokens=20))
    head = steps(eng, 3)
    on_engine_thread(eng.load_weights, 1, full_version(1))
    tail = drain(eng)
    events = head + tail
    assert [e.index for e in events] == list(range(20)) and events[-1].finish_reason == "length"
    assert tail[-1].record.version == 1 and not [e for e in events if e.finish_reason == "abort"]
