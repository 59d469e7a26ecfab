import pytest
import torch

from cells.engine.embedded.model import token_logprobs

from .enginekit import make_engine, params, prompts, run_all


def _decode_then_score(batch_invariant: bool, batch: int):
    eng = make_engine(batch_invariant)
    ps = prompts(batch, seed=10 + batch)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params(i, max_tokens=12))
    out = run_all(eng)
    sampled, scored = [], []
    for i, p in enumerate(ps):
        evs = out[f"r{i}"]
        toks = [e.record.token_id for e in evs]
        sampled.append(torch.tensor([e.record.logprob for e in evs]))
        scored.append(eng.score(p + toks)[len(p) - 1 :])
    return torch.cat(sampled), torch.cat(scored)


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_scoring_equals_sampler_bitwise_in_batch_invariant_mode(batch):
    sampled, scored = _decode_then_score(True, batch)
    assert torch.equal(sampled.float(), scored.float()), (sampled - scored).abs().max()


def test_fast_mode_gap_is_small_but_measured():
    sampled, scored = _decode_then_score(False, 3)
    assert (sampled.float() - scored.float()).abs().max() < 1e-3


def test_scoring_is_differentiable_for_the_trainer():
    eng = make_engine(True)
    prep = eng._prepared(None)
    w = {k: v.clone().requires_grad_(True) for k, v in prep.weights.items()}
    from cells.engine.embedded.model import prepare

    p2 = prepare(eng.spec, w)
    lp = token_logprobs(p2, torch.tensor(prompts(1)[0]), 1.0, eng.tile)
    lp[torch.isfinite(lp)].sum().backward()
    assert w["model.layers.0.mlp.down_proj.weight"].grad.abs().sum() > 0


def test_out_of_vocab_target_scores_minus_inf_and_score_does_not_touch_cache():
    eng = make_engine(True)
    used = eng.pool.num_used
    lp = eng.score([5, 950, 7])  # 950 is outside the output ids [0,900) ∪ [1000,1024)
    assert lp[0] == float("-inf") and torch.isfinite(lp[1])
    assert eng.pool.num_used == used
