import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.checkpoint import load_checkpoint, save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import ModelSpec, spec_from_hf_config
from cells.engine.records import EngineError, SamplingParams
from scheduler.contract.config import EmbeddedEngineConfig, ModelConfig

from .enginekit import make_engine, prompts, run_all


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)])
def test_hf_checkpoint_round_trip_gives_same_logits(tmp_path, qk_norm, tied):
    spec = ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128, vocab_size=300, tie_word_embeddings=tied, qk_norm=qk_norm,
                     rope_theta=10000.0, max_position=512)
    w = init_weights(spec, seed=3)
    save_checkpoint(tmp_path, spec, w)
    assert spec_from_hf_config(tmp_path) == spec
    assert all(torch.equal(w[k], v) for k, v in load_checkpoint(tmp_path, spec).items())
    eng_a = EmbeddedEngine(spec=spec, weights=w)
    eng_b = EmbeddedEngine(EmbeddedEngineConfig(model=ModelConfig(preset=None, path=str(tmp_path))))
    ids = prompts(1, seed=4)[0]
    ids = [t % 300 for t in ids]
    assert torch.equal(eng_a.score(ids), eng_b.score(ids))


def test_bad_checkpoint_dirs_give_clear_errors(tmp_path):
    with pytest.raises(EngineError, match="config.json"):
        spec_from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(EngineError, match="unsupported model_type"):
        spec_from_hf_config(tmp_path)


def test_load_weights_swaps_between_steps_and_tags_tokens():
    eng = make_engine(True)
    eng.add_request("r", prompts(1)[0], SamplingParams(max_tokens=10, seed=1))
    first = eng.step()
    new = {k: v + 0.01 for k, v in eng.weights().items()}
    eng.load_weights(1, new, keep_previous=True)
    rest = run_all(eng)["r"]
    assert first[0].record.version == 0 and all(e.record.version == 1 for e in rest)
    ids = prompts(1)[0]
    assert not torch.equal(eng.score(ids, version=0), eng.score(ids, version=1))
    eng.drop_version(0)
    with pytest.raises(EngineError, match="not held"):
        eng.score(ids, version=0)


def test_mismatched_weights_are_refused_and_nothing_changes():
    eng = make_engine(True)
    ids = prompts(1)[0]
    before = eng.score(ids)
    bad = dict(eng.weights())
    bad["model.norm.weight"] = torch.ones(7)
    with pytest.raises(EngineError, match="shape"):
        eng.load_weights(1, bad)
    missing = {k: v for k, v in eng.weights().items() if "layers.1." not in k}
    with pytest.raises(EngineError, match="missing"):
        eng.load_weights(1, missing)
    assert eng.version == 0 and torch.equal(eng.score(ids), before)
