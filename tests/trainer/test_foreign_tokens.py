"""The foreign-token check (cells/foreign_tokens.py) on a tiny model, no fleet: tokens sampled
under each job's own weights are its own; a token sampled under another job's weights and put
in a job's session is caught (the negative control), and so is a whole session; one no job's
weights reproduce is unmatched, not foreign."""

from __future__ import annotations

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.engine.records import SamplingParams
from cells.foreign_tokens import attribute
from scheduler.contract.config.engine import EmbeddedEngineConfig

MODEL = {"preset": "tiny", "vocab_size": 256, "hidden_size": 32, "num_layers": 1, "head_dim": 16,
         "intermediate_size": 64, "output_id_ranges": [[0, 256]]}
TILE = 4


def _engine(weights, version: int) -> EmbeddedEngine:
    cfg = EmbeddedEngineConfig(model=MODEL, batch_invariant=True, row_tile=TILE, num_blocks=64)
    return EmbeddedEngine(cfg, spec=resolve_spec(cfg.model), weights=weights, version=version)


def _sample(weights, version: int, sid: str, prompt: list[int], n: int = 12, seed: int = 0) -> dict:
    """One session sampled under `weights`: a trajectory as the store gives it."""
    eng = _engine(weights, version)
    eng.add_request(sid, prompt, SamplingParams(max_tokens=n, seed=seed))
    recs = []
    while eng.has_work():
        recs += [e.record for e in eng.step()]
    ids = prompt + [r.token_id for r in recs]
    return {"id": sid, "token_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(recs),
            "logprobs": [0.0] * len(prompt) + [r.logprob for r in recs], "segment_starts": [0]}


def _fixture():
    spec = resolve_spec(EmbeddedEngineConfig(model=MODEL).model)
    start = init_weights(spec, 0, 0.5)  # the shared warm start: each job's first version
    a2, b2 = init_weights(spec, 1, 0.5), init_weights(spec, 2, 0.5)
    weights = {"a": {1: start, 2: a2}, "b": {1_000_001: start, 1_000_002: b2}}
    trajs = [_sample(a2, 2, "a-0", [5, 6, 7]), _sample(a2, 2, "a-1", [9, 8], seed=3),
             _sample(b2, 1_000_002, "b-0", [5, 6, 7]), _sample(start, 1, "a-warm", [4, 4])]
    return spec, weights, trajs, {"a-0": "a", "a-1": "a", "b-0": "b", "a-warm": "a"}


def test_own_tokens_are_own_and_a_token_from_another_jobs_weights_is_foreign():
    spec, weights, trajs, job_of = _fixture()
    clean = attribute(trajs, job_of, weights, spec, row_tile=TILE)
    assert clean["checked"] == 4 * 12 and clean["foreign"] == 0 and clean["unmatched"] == 0
    assert clean["own"] == clean["checked"]
    assert clean["shared"] == 12  # sampled under the warm start both jobs publish: nobody's alone

    # negative control: one token of job a's session recorded as job b's weights sampled it
    b_tok = trajs[2]
    injected = dict(trajs[0], logprobs=list(trajs[0]["logprobs"]))
    pos = 3 + 4  # a sampled position present in both sessions (same prompt)
    injected["token_ids"] = list(trajs[0]["token_ids"][:pos]) + [b_tok["token_ids"][pos]]
    injected["loss_mask"] = trajs[0]["loss_mask"][:pos + 1]
    injected["logprobs"] = trajs[0]["logprobs"][:pos] + [_score_at(weights["b"][1_000_002], injected, pos)]
    out = attribute([injected, *trajs[1:]], job_of, weights, spec, row_tile=TILE)
    assert out["foreign"] == 1, out
    assert out["foreign_tokens"][0]["session"] == "a-0" and out["foreign_tokens"][0]["position"] == pos

    # and a whole session of job b's put under job a
    swapped = attribute(trajs, {**job_of, "b-0": "a"}, weights, spec, row_tile=TILE)
    assert swapped["foreign"] == 12 and {t["session"] for t in swapped["foreign_tokens"]} == {"b-0"}

    # a token no job's weights reproduce (as one decoded across a keep_kv activation) is unmatched,
    # however much nearer another job's weights come: nearness is no evidence of who sampled it
    own_lp = injected["logprobs"][pos]  # b's exactly; a's weights give a's score
    a_lp = _score_at(weights["a"][2], injected, pos)
    near_b = dict(injected, logprobs=injected["logprobs"][:pos] + [own_lp + (a_lp - own_lp) * 0.25])
    assert abs(a_lp - own_lp) * 0.25 > 1e-4  # off every version by far more than the tolerance
    out = attribute([near_b, *trajs[1:]], job_of, weights, spec, row_tile=TILE)
    assert (out["foreign"], out["unmatched"]) == (0, 1), out


def _score_at(weights, traj: dict, pos: int) -> float:
    """What `weights` give the token at `pos` of `traj` (as if they had sampled it there)."""
    eng = _engine(weights, 9)
    return float(eng.score(traj["token_ids"][:pos + 1], version=9)[pos - 1])
