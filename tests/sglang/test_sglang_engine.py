"""The SGLang adapter's logic against the recording fake (no GPU, no SGLang install)."""

from __future__ import annotations

import importlib.util
import socket
import threading

import fake_sglang
import pytest
import torch
from safetensors.torch import save_file

from cells.engine.records import EngineError, SamplingParams
from cells.engine.sglang import backend as sb
from cells.engine.sglang.engine import SGLangEngine
from cells.engine.sglang.weights import (
    BucketSpec,
    TensorMeta,
    UpdateGroup,
    broadcast_bucket,
    bucket_crc32,
    flatten_bucket,
    join_update_group,
    plan_buckets,
)
from scheduler.contract.config.engine import SGLangEngineConfig
from scheduler.contract.protocol import Summary

W = BucketSpec(("w",), ("bfloat16",), ((2, 2),))


def group(name: str = "g", port: int = 1, world: int = 2, backend: str = "nccl") -> UpdateGroup:
    return UpdateGroup("127.0.0.1", port, 1, world, name, backend)


_ENGINES: list[SGLangEngine] = []


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def make(model_path: str = "m", scoring: str = "publisher_copy", store=None, rec=None, **kw):
    mods, rec = fake_sglang.fake_modules(rec, store)
    cfg = SGLangEngineConfig(model_path=model_path, scoring=scoring)
    eng = SGLangEngine(cfg, modules=mods, **kw)
    _ENGINES.append(eng)
    return eng, eng.runtime.sglang


def drain(engine, limit: int = 500) -> list:
    events = []
    for _ in range(limit):
        events += engine.step()
        if not engine.has_work():
            break
    return events


def by_request(events) -> dict[str, list]:
    out: dict[str, list] = {}
    for e in events:
        out.setdefault(e.request_id, []).append(e)
    return out


def names(log) -> list[str]:
    return [e[0] if e[0] not in ("pause", "label") else f"{e[0]}:{e[1]}" for e in log]


# -- construction ----------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_names_the_gpu_extra():
    with pytest.raises(sb.SGLangUnavailable) as err:
        SGLangEngine(SGLangEngineConfig(model_path="m", scoring="publisher_copy"))
    assert "cellflip[gpu]" in str(err.value) and sb.PINNED_SGLANG_VERSION in str(err.value)
    assert isinstance(err.value, ImportError) and isinstance(err.value, EngineError)


def test_capabilities_follow_the_config():
    eng, _ = make()
    assert (eng.capabilities.kv_export, eng.capabilities.scoring, eng.capabilities.weight_update) == (False, False, "in_place")
    assert not eng.capabilities.batch_invariant
    with pytest.raises(EngineError, match="cell_copy"):  # no checkpoint for the default scoring copy
        make(scoring="cell_copy")
    eng, _ = make(scoring="publisher_copy", scorer=object())
    assert eng.num_update_ranks == 1 and not eng.capabilities.scoring
    eng, fake = make(scoring="cell_copy", scorer=object(), server_args={"enable_deterministic_inference": True})
    assert eng.capabilities.scoring and eng.capabilities.batch_invariant and eng.num_update_ranks == 2
    assert fake.server_args["skip_tokenizer_init"] and fake.server_args["enable_memory_saver"]
    assert fake.label == "0"  # SGLang's version label is ours from the start


def test_original_logprob_mode_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(EngineError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        make()


# -- generation ------------------------------------------------------------------------

@pytest.mark.parametrize("incremental", [False, True])
def test_token_in_token_out_with_logprobs(incremental):
    eng, fake = make(server_args={"incremental_streaming_output": incremental})
    eng.add_request("a", [11, 12, 13], SamplingParams(max_tokens=6, seed=4, top_k=5))
    eng.add_request("b", [21], SamplingParams(max_tokens=40, temperature=0.0))
    first = fake.next_token([21], sb.sampling_seed(0, "c"))[0]
    eng.add_request("c", [21], SamplingParams(max_tokens=40, stop_token_ids=(first,)))
    got = by_request(drain(eng))
    assert [e.index for e in got["a"]] == list(range(6)) and got["a"][-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in got["a"][:-1])
    assert all(e.record.truncated for e in got["a"]) and not any(e.record.truncated for e in got["b"])
    ctx = [11, 12, 13]
    for e in got["a"]:  # exactly the fake's tokens and log-probs, in order
        tok, lp = fake.next_token(ctx, sb.sampling_seed(4, "a"))
        assert (e.record.token_id, e.record.logprob, e.record.version) == (tok, pytest.approx(lp), 0)
        ctx.append(tok)
    assert len(got["c"]) == 1 and got["c"][0].finish_reason == "stop"
    assert not eng.has_work() and eng.streams.reqs == {}


def test_sampling_params_translate_to_sglang():
    sp = sb.to_sglang_sampling(SamplingParams(top_k=0, top_p=0.5, stop_token_ids=(3,), seed=7), "r", 9)
    assert sp == {"max_new_tokens": 9, "temperature": 1.0, "top_p": 0.5, "top_k": -1, "stop_token_ids": [3],
                  "sampling_seed": sb.sampling_seed(7, "r")}
    assert sb.sampling_seed(7, "r") == sb.sampling_seed(7, "r") != sb.sampling_seed(7, "s")
    assert 0 <= sb.sampling_seed(2**40, "x") < 2**31


def test_bad_requests_are_refused():
    eng, _ = make()
    for bad in ([], [1, -2], [1, True]):
        with pytest.raises(EngineError):
            eng.add_request("x", bad, SamplingParams())
    eng.add_request("x", [1], SamplingParams(max_tokens=50))
    with pytest.raises(EngineError, match="duplicate"):
        eng.add_request("x", [1], SamplingParams())


def test_abort_drops_undelivered_tokens_and_aborts_in_sglang():
    eng, fake = make()
    eng.add_request("a", [1, 2], SamplingParams(max_tokens=50))
    eng.add_request("b", [3], SamplingParams(max_tokens=5))
    eng.step()
    fake._loop.run_until_complete(fake_sleep(5))  # tokens arrive but are not delivered yet
    assert any(r.request_id == "a" for r, _ in eng.streams.pending)
    eng.abort("a")
    eng.abort("nope")
    events = drain(eng)
    assert all(e.request_id == "b" for e in events)
    assert ("abort", eng_rid(fake, "a")) in fake.log
    eng.release_memory(["kv_cache"])  # SGLang has ended the aborted stream: it is idle


async def fake_sleep(n: int):
    import asyncio
    for _ in range(n):
        await asyncio.sleep(0)


def eng_rid(fake, request_id: str) -> str:
    return next(e[1] for e in fake.log if e[0] == "abort" and e[1].startswith(request_id + "#"))


def test_sglang_error_ends_the_request():
    eng, fake = make()

    async def boom(**kw):
        raise ValueError("prompt too long")

    fake.async_generate = boom
    eng.add_request("a", [1], SamplingParams())
    assert drain(eng) == [] and not eng.has_work()
    assert eng.ended_without_token == [("a", "SGLang error: prompt too long")]


def test_version_tags_are_checked_against_sglang_spans():
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=6))
    eng.step()
    fake.label = "7"  # SGLang changes version under the request without the adapter knowing
    drain(eng)
    assert eng.version_tag_mismatches > 0


# -- version updates -------------------------------------------------------------------

def test_update_sequence_pause_update_continue_and_restart():
    eng, fake = make()
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=30, seed=1))
    before = drain_n(eng, 4)
    fake.log.clear()
    buckets = [BucketSpec(("x",), ("float32",), ((2,),)), BucketSpec(("y",), ("float32",), ((3,),))]
    eng.receive_version(5, group("g1"), buckets)
    flushes = [b for b in fake.log if b[0] == "update_weights_from_distributed"]
    assert len(flushes) == 2
    assert names(fake.log) == ["pause:retract", "init_weights_update_group", "begin_weight_update",
                               "update_weights_from_distributed", "update_weights_from_distributed",
                               "end_weight_update", "destroy_weights_update_group", "label:5", "abort", "continue"]
    assert eng.version == 5 and fake.label == "5" and not fake.session_open
    after = drain(eng)
    events = before + after
    assert [e.index for e in events] == list(range(30))  # no token lost or doubled
    produced = [(tok, int(label)) for rid, tok, label in fake.produced if rid.startswith("a#")]
    assert [(e.record.token_id, e.record.version) for e in events] == produced  # each tagged as sampled
    assert {e.record.version for e in before} == {0} and after[-1].record.version == 5
    resub = [g for g in fake.cache_hits if g[0].startswith("a#")]
    assert [salt for _, salt, _, _ in resub] == ["cellflip-v0", "cellflip-v5"]
    assert eng.version_tag_mismatches == 0


def drain_n(eng, n: int) -> list:
    events = []
    while len(events) < n:
        events += eng.step()
    return events


def test_last_bucket_flushes_the_cache():
    eng, fake = make()
    calls = []
    orig = type(fake).update_weights_from_distributed.__wrapped__

    def spy(self, **kw):
        calls.append(kw["flush_cache"])
        return orig(self, **kw)

    fake.update_weights_from_distributed = spy.__get__(fake)
    eng.receive_version(1, group(), [W, BucketSpec(("v",), ("float32",), ((1,),)), BucketSpec(("u",), ("int8",), ((4,),))])
    assert calls == [False, False, True]


def test_failure_after_a_bucket_landed_serves_nothing():
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=40))
    drain_n(eng, 2)
    fake.fail["update_weights_from_distributed"] = "NCCL error"
    fake.log.clear()
    with pytest.raises(EngineError, match="serves nothing"):
        eng.receive_version(1, group(), [W])
    assert eng.state == "broken" and ("continue",) not in fake.log and not fake.session_open
    assert eng.migration_endpoint.version is None
    eng.step()
    assert eng.step() == []  # paused: nothing new is decoded
    with pytest.raises(EngineError, match="no complete weight version"):
        eng.add_request("b", [1], SamplingParams())
    with pytest.raises(EngineError):
        eng.score([1, 2])
    fake.fail = {"init_weights_update_group": "peer gone"}  # untouched, but still no version
    with pytest.raises(EngineError, match="incomplete"):
        eng.receive_version(1, group("g2"), [W])
    assert eng.state == "broken" and ("continue",) not in fake.log
    fake.fail.clear()
    eng.receive_version(1, group("g3"), [W])  # a complete version: serving again, request continues
    assert eng.state == "serving" and fake.log[-1] == ("continue",)
    assert len(drain(eng)) > 0


def test_failure_before_any_bucket_keeps_the_old_version():
    eng, fake = make()
    fake.fail["init_weights_update_group"] = "rendezvous timed out"
    with pytest.raises(EngineError, match="weights unchanged, version 0"):
        eng.receive_version(1, group(), [W])
    assert eng.state == "serving" and eng.version == 0 and fake.log[-1] == ("continue",)
    eng.add_request("a", [1], SamplingParams(max_tokens=2))
    assert len(drain(eng)) == 2


def test_paused_cell_stays_paused_across_an_update():
    eng, fake = make()
    eng.pause_all()
    assert ("pause", "in_place") in fake.log
    eng.receive_version(1, group(), [W])
    assert eng.state == "paused" and ("continue",) not in fake.log
    eng.resume_all()
    assert eng.state == "serving" and fake.log[-1] == ("continue",)


def test_pause_freezes_decoding():
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    drain_n(eng, 2)
    eng.pause_all()
    eng.step()  # what was already on its way
    assert eng.step() == [] and eng.step() == []
    eng.resume_all()
    assert drain_n(eng, 1)


@pytest.fixture
def checkpoint(tmp_path):
    save_file({"w": torch.zeros(2, 2, dtype=torch.bfloat16), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_updates_are_checked_against_the_checkpoint_before_anything_changes(checkpoint):
    eng, fake = make(model_path=checkpoint)
    assert set(eng.manifest) == {"w", "b"}
    fake.log.clear()
    for bad, msg in ((BucketSpec(("q",), ("float32",), ((1,),)), "unknown tensor"),
                     (BucketSpec(("w",), ("bfloat16",), ((2, 3),)), "shape mismatch"),
                     (BucketSpec(("w", "w"), ("bfloat16", "bfloat16"), ((2, 2), (2, 2))), "twice")):
        with pytest.raises(EngineError, match=msg):
            eng.receive_version(1, group(), [bad])
    with pytest.raises(EngineError, match="already serving"):
        eng.receive_version(0, group(), [W])
    with pytest.raises(EngineError, match="do not fit"):
        eng.receive_version(1, UpdateGroup("h", 1, 0, 2, "g"), [W])
    with pytest.raises(EngineError, match="shape mismatch"):
        eng.load_weights(1, {"w": torch.zeros(3)})
    assert fake.log == []  # SGLang was never touched


def test_load_weights_from_tensors(checkpoint):
    eng, fake = make(model_path=checkpoint)
    eng.add_request("a", [1], SamplingParams(max_tokens=20))
    drain_n(eng, 2)
    fake.log.clear()
    eng.load_weights(3, {"w": torch.ones(2, 2, dtype=torch.bfloat16)})
    assert names(fake.log)[:4] == ["pause:retract", "begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    assert torch.equal(fake.weights["w"], torch.ones(2, 2, dtype=torch.bfloat16)) and eng.version == 3
    assert drain(eng)[-1].record.version == 3


def test_prefix_cache_is_salted_per_version():
    eng, fake = make()
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    drain(eng)
    eng.add_request("b", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    drain(eng)
    eng.receive_version(1, group(), [W])
    fake.cache.add(("cellflip-v0", (5, 6, 7, 8, 9)))  # old-version KV that survived (a store)
    eng.add_request("c", [5, 6, 7, 8], SamplingParams(max_tokens=2))
    drain(eng)
    hits = {rid.split("#")[0]: n for rid, _, n, _ in fake.cache_hits}
    assert hits["b"] == 4 and hits["c"] == 0


# -- memory handover -------------------------------------------------------------------

def test_memory_handover_to_training_and_back(checkpoint):
    eng, fake = make(model_path=checkpoint)
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    eng.step()
    with pytest.raises(EngineError, match="migrate them out"):
        eng.release_memory()
    eng.abort("a")
    eng.release_memory()
    assert fake.released == {"weights", "kv_cache"} and eng.metadata()["released"] == ["kv_cache", "weights"]
    with pytest.raises(EngineError, match="no complete weight version"):
        eng.add_request("b", [1], SamplingParams())
    with pytest.raises(EngineError, match="resume_memory"):
        eng.receive_version(1, group(), [W])
    eng.resume_memory(["weights"])
    with pytest.raises(EngineError, match="full version"):  # weights came back empty
        eng.receive_version(1, group(), [W])
    eng.receive_version(1, group(), [W, BucketSpec(("b",), ("float32",), ((3,),))])
    with pytest.raises(EngineError, match="released"):
        eng.add_request("b", [1], SamplingParams())
    eng.resume_memory(["kv_cache"])
    eng.add_request("b", [1], SamplingParams(max_tokens=2))
    assert len(drain(eng)) == 2
    with pytest.raises(EngineError, match="not released"):
        eng.resume_memory(["kv_cache"])
    with pytest.raises(EngineError, match="tags"):
        eng.release_memory(["gpu"])


def test_weights_with_cpu_backup_stay_valid():
    eng, _ = make(server_args={"enable_weights_cpu_backup": True})
    eng.release_memory(["weights"])
    eng.resume_memory(["weights"])
    eng.add_request("a", [1], SamplingParams(max_tokens=1))
    assert len(drain(eng)) == 1


# -- migration -------------------------------------------------------------------------

def _reference(prompt, params, request_id="r"):
    eng, _ = make()
    eng.add_request(request_id, prompt, params)
    return [e.record.token_id for e in drain(eng)]


def test_a_request_moved_through_a_shared_store_loads_its_prefix_from_it():
    store = fake_sglang.SharedStore()
    hicache = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}
    src, _ = make(store=store, server_args=hicache)
    dst, dst_fake = make(store=store, server_args=hicache)
    assert src.metadata()["migration_paths"] == ["kv_store", "reprefill"]
    params = SamplingParams(max_tokens=30)
    src.add_request("r", [1, 2, 3, 4], params)
    ids = [1, 2, 3, 4] + [e.record.token_id for e in drain_n(src, 5)]
    src.abort("r")  # the source stops it (the scheduler moved it: `path` kv_store)
    src.step()  # SGLang ends the aborted request and commits its KV (write-through to the store)
    dst.add_request("r", ids, params, prompt_len=4, path="kv_store")
    dst.step()
    rid, salt, matched, where = dst_fake.cache_hits[-1]
    assert where == "store" and matched == len(ids)


def test_a_named_kv_store_needs_hicache_with_a_storage_backend():
    with pytest.raises(EngineError, match="kv_store"):
        make(kv_store="shared")


# -- scoring ---------------------------------------------------------------------------

class Scorer:
    def __init__(self):
        self.device = "cpu"
        self.loaded: list[tuple[int, dict]] = []

    def score(self, token_ids, *, temperature=1.0):
        return torch.full((len(token_ids) - 1,), -temperature)

    def load_weights(self, version, tensors):
        self.loaded.append((version, {k: v.clone() for k, v in tensors.items()}))


def test_scoring_choice():
    eng, _ = make()
    with pytest.raises(EngineError, match="publishing cell"):
        eng.score([1, 2, 3])
    scorer = Scorer()
    eng, _ = make(scoring="cell_copy", scorer=scorer)
    assert eng.score([1, 2, 3], temperature=0.5).tolist() == [-0.5, -0.5]
    eng.load_weights(1, {"w": torch.ones(2)})
    assert scorer.loaded[0][0] == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("corrupt", [False, True])
def test_broadcast_over_gloo_reaches_sglang_and_the_scoring_copy(corrupt):
    """Sender (rank 0), SGLang's receiver as modelled by the fake (rank 1) and the scoring
    copy (rank 2) in one real gloo group, with the flattened-bucket wire format."""
    scorer = Scorer()
    eng, fake = make(scoring="cell_copy", scorer=scorer)
    g = UpdateGroup("127.0.0.1", _free_port(), 1, 3, "v1", "gloo")
    gen = torch.Generator().manual_seed(1)
    tensors = {"a": torch.randn(4, 3, generator=gen).to(torch.bfloat16), "b": torch.randn(5, generator=gen),
               "c": torch.randint(0, 100, (6,), dtype=torch.int8)}
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    buckets = []
    for b in plan_buckets(metas, bucket_bytes=32):
        crc = bucket_crc32(flatten_bucket([tensors[n] for n in b.names]))
        buckets.append(BucketSpec(b.names, b.dtypes, b.shapes, crc ^ 1 if corrupt and not buckets else crc))
    assert len(buckets) >= 2

    def send():
        pg = join_update_group(g, 0, 30.0)
        for b in buckets:
            broadcast_bucket(pg, flatten_bucket([tensors[n] for n in b.names]), 30.0)

    sender = threading.Thread(target=send)
    sender.start()
    if corrupt:
        with pytest.raises(EngineError, match="checksum"):
            eng.receive_version(1, g, buckets)
        assert eng.state == "broken"
    else:
        eng.receive_version(1, g, buckets)
        assert all(torch.equal(fake.weights[n], t) for n, t in tensors.items())
        version, got = scorer.loaded[-1]
        assert version == 1 and all(torch.equal(got[n], t) for n, t in tensors.items())
    sender.join(30)
    assert not sender.is_alive()


def test_chunk_parsing_reads_every_streaming_shape():
    lp = [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 7, None)]

    def chunk(ids, lps, total):
        return {"output_ids": ids, "meta_info": {"completion_tokens": total, "output_token_logprobs": lps}}

    assert sb.new_tokens(chunk([5, 6, 7], lp, 3), 1) == [(6, -0.2), (7, -0.3)]  # cumulative
    assert sb.new_tokens(chunk([6, 7], lp[1:], 3), 1) == [(6, -0.2), (7, -0.3)]  # coalesced deltas
    assert sb.new_tokens(chunk([7], lp, 3), 3) == []  # incremental abort echo: last token again
    assert sb.new_tokens(chunk([], [], 0), 0) == []
    with pytest.raises(EngineError, match="out of step"):
        sb.new_tokens(chunk([7], lp[2:], 3), 0)
    with pytest.raises(EngineError, match="log-prob entry"):
        sb.new_tokens(chunk([5, 9], lp[:2], 2), 0)
    assert sb.finish_reason({"finish_reason": {"type": "length", "length": 3}}) == "length"
    assert sb.finish_reason({"finish_reason": {"type": "abort", "status_code": 400}}) == "abort"
    assert sb.finish_reason({"finish_reason": None}) is None


def test_a_finish_after_the_last_token_closes_the_request():
    eng, fake = make()
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    drain_n(eng, 1)
    fake._loop.run_until_complete(fake_sleep(3))  # more tokens pending
    req = eng.streams.reqs["a"]
    eng.streams.on_chunk(req, {"output_ids": list(req.seen_ids), "meta_info": {
        "completion_tokens": len(req.seen_ids), "output_token_logprobs": [], "finish_reason": {"type": "stop"}}})
    events = eng.step()
    assert events[-1].finish_reason == "stop" and "a" not in eng.streams.reqs and eng.ended_without_token == []


def test_default_scoring_copy_is_the_embedded_model_fed_by_the_broadcast(tmp_path):
    """cell_copy without a scorer: the embedded Qwen3 model from the cell's checkpoint, filled
    by the same gloo broadcast as SGLang (modelled by the fake), scoring like the embedded
    engine with those weights."""
    from cells.engine.embedded import EmbeddedEngine
    from cells.engine.embedded.checkpoint import save_checkpoint
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS

    spec = PRESETS["tiny"]
    save_checkpoint(tmp_path, spec, init_weights(spec, seed=0), dtype=torch.bfloat16)
    eng, fake = make(model_path=str(tmp_path), scoring="cell_copy")
    assert eng.capabilities.scoring and eng.num_update_ranks == 2 and set(eng.manifest)
    new = {k: v.to(torch.bfloat16) for k, v in init_weights(spec, seed=1).items() if k in eng.manifest}
    g = UpdateGroup("127.0.0.1", _free_port(), 1, 3, "v1", "gloo")
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in new.items()], bucket_bytes=1 << 16)

    def send():
        pg = join_update_group(g, 0, 30.0)
        for b in buckets:
            broadcast_bucket(pg, flatten_bucket([new[n] for n in b.names]), 30.0)

    sender = threading.Thread(target=send)
    sender.start()
    eng.receive_version(1, g, buckets)
    sender.join(30)
    ref = EmbeddedEngine(eng._scorer.cfg, weights={k: v.float() for k, v in new.items()}, version=1)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(eng.score(ids), ref.score(ids))
    assert all(torch.equal(fake.weights[n], t) for n, t in new.items())


def test_summary_for_the_cell_agent():
    eng, _ = make(max_running=4, server_args={"page_size": 16})
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    assert eng.summary() == Summary(inflight=1, kv_blocks_used=0, kv_blocks_total=0, version=0,
                                    versions_held=[], request_ids=["a"], parked=[], max_running=4,
                                    block_size=16)
    assert list(eng.requests) == ["a"]
    eng, _ = make(scoring="cell_copy", scorer=Scorer())
    assert eng.summary().versions_held == [0] and eng.summary().max_running == 256  # the config's


# -- what the cell agent calls: moved requests, versions, roles (engine.py, memory.py) --------

def test_a_moved_request_continues_where_it_left_off():
    params = SamplingParams(max_tokens=20, seed=5)
    want = _reference([7, 8, 9], params)
    eng, _ = make()
    eng.add_request("r", [7, 8, 9] + want[:6], params, prompt_len=3, path="reprefill")
    tail = drain(eng)
    assert [e.index for e in tail] == list(range(6, 20)) and [e.record.token_id for e in tail] == want[6:]
    assert eng.migrations_total == {"reprefill": 1}
    with pytest.raises(EngineError, match="max_tokens"):
        eng.add_request("s", [7, 8, 9] + want, params, prompt_len=3)
    with pytest.raises(EngineError, match="prompt_len"):
        eng.add_request("s", [7], params, prompt_len=2)


def test_recompute_all_has_nothing_left_to_do():
    eng, _ = make()
    assert eng.recompute_all() == 0  # every update already re-submits what is in flight


def test_role_flips_hand_gpu_memory_over_and_install_what_arrived_meanwhile(checkpoint):
    eng, fake = make(model_path=checkpoint)
    eng.add_request("a", [1], SamplingParams(max_tokens=50))
    drain_n(eng, 1)
    with pytest.raises(EngineError, match="requests remain"):
        eng.enter_role("training")
    assert fake.released == set()
    eng.abort("a")
    eng.enter_role("training")
    assert fake.released == {"weights", "kv_cache"} and eng.state == "paused"
    assert eng.summary().version is None  # released without a CPU backup: the weights come back empty
    with pytest.raises(EngineError, match="no complete weight version"):
        eng.enter_role("rollout")
    assert fake.released == {"weights", "kv_cache"}  # refused: the memory stays with training
    full = {"w": torch.ones(2, 2, dtype=torch.bfloat16), "b": torch.ones(3)}
    with pytest.raises(EngineError, match="full version"):
        eng.install_prepared(1, eng.prepare_weights({"w": full["w"]}))
    fake.log.clear()
    eng.install_prepared(1, eng.prepare_weights(full))
    assert eng.version == 1 and eng.summary().version == 1 and fake.log == []  # kept until the flip back
    eng.enter_role("rollout")
    order = names(fake.log)
    assert order.index("resume_memory_occupation") < order.index("update_weights_from_tensor") \
        < max(i for i, n in enumerate(order) if n == "resume_memory_occupation") < order.index("continue")
    assert fake.released == set() and eng.state == "serving" and torch.equal(fake.weights["b"], full["b"])
    eng.enter_role("rollout")  # idempotent
    eng.add_request("b", [1], SamplingParams(max_tokens=3))
    assert [e.record.version for e in drain(eng)] == [1, 1, 1]
    with pytest.raises(EngineError, match="unknown role"):
        eng.enter_role("draining")


def test_a_cpu_weight_backup_serves_the_same_version_after_a_flip():
    eng, fake = make(server_args={"enable_weights_cpu_backup": True})
    eng.enter_role("training")
    eng.enter_role("training")  # idempotent: nothing released twice
    assert sum(e == ("release_memory_occupation",) for e in fake.log) == 1
    assert eng.summary().version == 0
    eng.enter_role("rollout")
    assert fake.released == set() and eng.state == "serving"
    eng.add_request("a", [1], SamplingParams(max_tokens=2))
    assert len(drain(eng)) == 2


def test_publisher_copy_holds_nothing_for_scoring():
    eng, _ = make()
    assert eng.versions_held == [] and eng.scorer(0) is None
    with pytest.raises(EngineError, match="publishing cell"):
        eng.install_prepared(1, {"w": torch.ones(2)}, activate=False)
    with pytest.raises(EngineError, match="served"):
        eng.drop_version(0)
    eng.drop_version(3)  # not held: nothing to free


def test_a_single_version_scoring_copy_never_scores_with_another_versions_weights():
    scorer = Scorer()
    eng, _ = make(scoring="cell_copy", scorer=scorer)
    old = eng.scorer(0)
    assert eng.versions_held == [0] and old([1, 2, 3], 0.5).tolist() == [-0.5, -0.5]
    eng.install_prepared(1, {"w": torch.ones(2)})
    assert eng.versions_held == [1] and eng.scorer(0) is None and scorer.loaded[-1][0] == 1
    with pytest.raises(EngineError, match="left the scoring copy"):
        old([1, 2, 3])
    with pytest.raises(EngineError, match="one version"):
        eng.hold_weights(2, {"w": torch.ones(2)})


def test_the_default_scoring_copy_keeps_old_versions_until_dropped(tmp_path):
    from cells.engine.embedded.checkpoint import save_checkpoint
    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import PRESETS

    spec = PRESETS["tiny"]
    save_checkpoint(tmp_path, spec, init_weights(spec, seed=0), dtype=torch.bfloat16)
    eng, fake = make(model_path=str(tmp_path), scoring="cell_copy")
    v1 = {k: v.to(torch.bfloat16) for k, v in init_weights(spec, seed=1).items() if k in eng.manifest}
    with pytest.raises(EngineError, match="shape mismatch"):
        eng.prepare_weights({"model.norm.weight": torch.ones(3)})
    ids = [3, 1, 4, 1, 5]
    before = eng.scorer(0)(ids, 1.0)
    eng.install_prepared(1, eng.prepare_weights(v1))
    assert eng.version == 1 and ("update_weights_from_tensor",) in fake.log
    assert eng.versions_held == [0, 1] and eng.summary().versions_held == [0, 1]
    assert torch.equal(eng.scorer(0)(ids, 1.0), before) and not torch.equal(eng.scorer(1)(ids, 1.0), before)
    eng.install_prepared(2, v1, activate=False)  # held for scoring only: SGLang is not touched
    assert eng.versions_held == [0, 1, 2] and eng.version == 1
    eng.drop_version(0)
    eng.drop_version(2)
    assert eng.versions_held == [1] and eng.scorer(0) is None
    eng.enter_role("training")  # weights released without a backup: version 3 waits for the flip back
    eng.install_prepared(3, eng.prepare_weights({**v1, "model.norm.weight": torch.zeros_like(v1["model.norm.weight"])}))
    eng.drop_version(1)  # the copy still serves 1 until 3 is installed: kept
    assert eng.version == 3 and eng.versions_held == [1]
    eng.enter_role("rollout")
    assert eng.versions_held == [1, 3] and eng.summary().version == 3
