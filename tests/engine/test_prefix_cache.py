"""KV reuse across the turns of a session: a finished request's KV stays cached under its
session; a later turn whose prompt extends it skips that prefill and decodes identically."""


from cells.engine.records import SamplingParams

from .enginekit import make_engine, prompts, run_all


def _turns(engine, use_cache: bool):
    p = prompts(1, seed=40, lo=50, hi=60)[0]
    key = "sess" if use_cache else None
    engine.add_request("t0", p, SamplingParams(max_tokens=12, seed=1), cache_key=key)
    first = [e.record for e in run_all(engine)["t0"]]
    # next turn: prompt + completion + a tool/user message
    p2 = p + [r.token_id for r in first] + prompts(1, seed=41, lo=8, hi=9)[0]
    engine.add_request("t1", p2, SamplingParams(max_tokens=12, seed=2), cache_key=key)
    second = [e.record for e in run_all(engine)["t1"]]
    return first, second


def test_second_turn_reuses_the_cached_prefix_and_matches_a_cold_run_bitwise():
    warm = make_engine(True)
    first_w, second_w = _turns(warm, use_cache=True)
    cold = make_engine(True)
    first_c, second_c = _turns(cold, use_cache=False)
    assert warm.num_cached_tokens > 50 and cold.num_cached_tokens == 0
    assert [(r.token_id, r.logprob) for r in second_w] == [(r.token_id, r.logprob) for r in second_c]
    warm.pool.check_integrity()
    assert warm.summary().kv_blocks_cached > 0


def test_cache_is_evicted_instead_of_preempting_and_never_reused_across_versions():
    eng = make_engine(True, num_blocks=24)
    eng.add_request("a", prompts(1, seed=42, lo=60, hi=61)[0], SamplingParams(max_tokens=4), cache_key="s1")
    run_all(eng)
    assert "s1" in eng.prefix_cache
    # a request that needs most of the pool evicts the cached prefix, nothing is preempted
    eng.add_request("b", prompts(1, seed=43, lo=150, hi=151)[0], SamplingParams(max_tokens=4))
    run_all(eng)
    assert "s1" not in eng.prefix_cache
    eng.pool.check_integrity()
    # a new version invalidates a cached prefix
    p = prompts(1, seed=44, lo=30, hi=31)[0]
    eng.add_request("c", p, SamplingParams(max_tokens=3), cache_key="s2")
    toks = [e.record.token_id for e in run_all(eng)["c"]]
    eng.load_weights(1, {k: v + 0.01 for k, v in eng.weights().items()})
    before = eng.num_cached_tokens
    eng.add_request("d", p + toks, SamplingParams(max_tokens=3), cache_key="s2")
    run_all(eng)
    assert eng.num_cached_tokens == before
    eng.pool.check_integrity()


def test_a_turn_that_ran_across_a_version_change_is_never_reused_as_the_new_versions_kv():
    """Running requests continue over their KV when the version changes (`continue`): that KV
    is partly the old version's, so the session's cached prefix must not pass for the new
    version's. The next turn re-prefills and its log-probs are the new version's exact ones;
    the control (no change mid-turn) reuses the cache."""
    eng = make_engine(True)
    p = prompts(1, seed=45, lo=40, hi=41)[0]
    eng.add_request("e", p, SamplingParams(max_tokens=8, seed=3), cache_key="s3")
    early = [e.record for _ in range(4) for e in eng.step()]  # prefill and tokens under version 0
    eng.load_weights(1, {k: v + 0.01 for k, v in eng.weights().items()}, keep_previous=True)
    toks = [e.record for e in run_all(eng)["e"]]
    assert {r.version for r in early} == {0} and {r.version for r in toks} == {1} and len(toks) >= 3
    before = eng.num_cached_tokens
    nxt = p + [r.token_id for r in early + toks] + [7, 8]
    eng.add_request("f", nxt, SamplingParams(max_tokens=4, seed=4), cache_key="s3")
    out = [e.record for e in run_all(eng)["f"]]
    assert eng.num_cached_tokens == before  # not reused
    exact = eng.score(nxt + [r.token_id for r in out], version=1)
    assert [r.logprob for r in out] == exact[len(nxt) - 1:].tolist()
    # the control: a turn entirely under version 1 is cached and reused
    eng.add_request("g", nxt + [r.token_id for r in out] + [9], SamplingParams(max_tokens=2, seed=5), cache_key="s3")
    run_all(eng)
    assert eng.num_cached_tokens > before
