import pytest

from cells.engine.records import EngineError, SamplingParams

from .enginekit import make_engine, params, prompts, run_all


def _generate(engine, ps, pars, ids=None):
    ids = ids or [f"r{i}" for i in range(len(ps))]
    for rid, p, sp in zip(ids, ps, pars):
        engine.add_request(rid, p, sp)
    return run_all(engine)


@pytest.mark.parametrize("greedy", [True, False])
def test_batch_invariant_tokens_do_not_depend_on_neighbours(greedy):
    ps = prompts(6, seed=1)
    pars = [params(i, greedy) for i in range(6)]
    together = _generate(make_engine(True), ps, pars)
    for i in (0, 3):  # the same request alone, and next to different neighbours
        alone = _generate(make_engine(True), [ps[i]], [pars[i]], [f"r{i}"])[f"r{i}"]
        assert [e.record.token_id for e in alone] == [e.record.token_id for e in together[f"r{i}"]]
        assert [e.record.logprob for e in alone] == [e.record.logprob for e in together[f"r{i}"]]
    others = _generate(make_engine(True), [prompts(1, seed=9)[0], ps[2]], [params(7), pars[2]], ["x", "r2"])["r2"]
    assert [e.record.token_id for e in others] == [e.record.token_id for e in together["r2"]]


def test_sampling_is_deterministic_and_seed_dependent():
    ps = prompts(2, seed=2)
    a = _generate(make_engine(False), ps, [params(0), params(1)])
    b = _generate(make_engine(False), ps, [params(0), params(1)])
    c = _generate(make_engine(False), ps, [params(5), params(6)])
    tok = lambda out: [[e.record.token_id for e in out[k]] for k in sorted(out)]
    assert tok(a) == tok(b)
    assert tok(a) != tok(c)


def test_tokens_carry_index_version_and_stay_in_output_ids():
    eng = make_engine(True)
    eng.add_request("r", prompts(1)[0], SamplingParams(max_tokens=12, seed=3))
    evs = run_all(eng)["r"]
    assert [e.index for e in evs] == list(range(12))
    assert all(e.record.version == 0 for e in evs)
    assert all(e.record.token_id < 900 or e.record.token_id >= 1000 for e in evs)
    assert all(e.record.logprob <= 0 for e in evs)
    assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])


def test_stop_token_ends_request():
    eng = make_engine(True)
    eng.add_request("g", prompts(1, seed=4)[0], SamplingParams(temperature=0.0, max_tokens=10))
    first = run_all(eng)["g"]
    stop = first[3].record.token_id
    eng.add_request("s", prompts(1, seed=4)[0], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,)))
    out = run_all(eng)["s"]
    assert out[-1].finish_reason == "stop" and out[-1].record.token_id == stop
    assert len(out) == next(i for i, e in enumerate(first) if e.record.token_id == stop) + 1


def test_top_k_top_p_truncation_is_recorded():
    eng = make_engine(True)
    eng.add_request("k", prompts(1)[0], SamplingParams(top_k=5, max_tokens=6, seed=1))
    eng.add_request("p", prompts(1)[0], SamplingParams(top_p=0.5, max_tokens=6, seed=1))
    eng.add_request("n", prompts(1)[0], SamplingParams(max_tokens=6, seed=1))
    out = run_all(eng)
    assert all(e.record.truncated for e in out["k"] + out["p"])
    assert not any(e.record.truncated for e in out["n"])


def test_out_of_blocks_preempts_and_queues_without_changing_tokens():
    ps = prompts(6, seed=5, lo=30, hi=50)
    pars = [params(i, max_tokens=24) for i in range(6)]
    roomy = _generate(make_engine(True, num_blocks=256), ps, pars)
    small = make_engine(True, num_blocks=24)
    preempted = []
    orig = small.batcher._preempt
    small.batcher._preempt = lambda r: (preempted.append(r.request_id), orig(r))
    tight = _generate(small, ps, pars)
    assert preempted, "the pool was meant to be too small for all six"

    small.pool.check_integrity()
    assert small.pool.num_used == 0
    for k in roomy:
        assert [e.record.token_id for e in roomy[k]] == [e.record.token_id for e in tight[k]]


def test_chunked_prefill_matches_single_shot():
    ps = prompts(2, seed=6, lo=70, hi=90)
    a = _generate(make_engine(True, prefill_chunk=16), ps, [params(0), params(1)])
    b = _generate(make_engine(True, prefill_chunk=512), ps, [params(0), params(1)])
    for k in a:
        assert [e.record.logprob for e in a[k]] == [e.record.logprob for e in b[k]]


@pytest.mark.parametrize("kw", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -1}, {"max_tokens": 0}, {"seed": -3}, {"stop_token_ids": ("a",)},
])
def test_invalid_sampling_params_are_rejected(kw):
    with pytest.raises(EngineError):
        SamplingParams(**kw)


def test_bad_requests_are_rejected_and_leave_engine_clean():
    eng = make_engine(True, num_blocks=16)
    with pytest.raises(EngineError, match="outside"):
        eng.add_request("a", [1, 2, 10**6], SamplingParams())
    with pytest.raises(EngineError, match="non-empty"):
        eng.add_request("a", [], SamplingParams())
    for bad in ([1, True, 3], [1, -1, 3], [1, 2.0, 3], [1, "2", 3]):  # each refused, fast path or not
        with pytest.raises(EngineError, match="outside"):
            eng.add_request("a", bad, SamplingParams())
    with pytest.raises(EngineError, match="KV blocks"):
        eng.add_request("a", list(range(100)), SamplingParams(max_tokens=200))
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError, match="duplicate"):
        eng.add_request("a", [1, 2, 3], SamplingParams())
    assert list(run_all(eng)) == ["a"]
    eng.pool.check_integrity()
