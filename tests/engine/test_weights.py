import json

import pytest
import torch

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.checkpoint import load_checkpoint, save_checkpoint
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import ModelSpec, spec_from_hf_config
from cells.engine.records import EngineError, SamplingParams
from scheduler.contract.config.engine import EmbeddedEngineConfig, ModelConfig

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


def _toy(seed: int = 5):
    from cells.engine.embedded.model_spec import PRESETS
    spec = PRESETS["toy"]  # restricted output ids
    return spec, init_weights(spec, seed=seed)


def test_an_export_is_sharded_marked_and_served_bitwise_like_its_weights(tmp_path):
    """A sharded export (index, config with the restricted output ids under `cellflip`, the
    source's tokenizer files) loads back tensor for tensor, and an engine serving it gives
    bitwise the log-probs of one serving the weights; another version's export does not."""
    spec, w = _toy()
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer_config.json").write_text('{"model_max_length": 8192}')
    out = save_checkpoint(tmp_path / "v3", spec, w, max_shard_bytes=8 << 20, source=src, version=3)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(w)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["cellflip"] == {"output_id_ranges": [list(r) for r in spec.output_id_ranges], "version": 3}
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 8192}'
    assert spec_from_hf_config(out) == spec
    back = load_checkpoint(out, spec)
    assert set(back) == set(w) and all(torch.equal(w[k], back[k]) for k in w)
    ids = prompts(1, seed=4)[0]
    served = EmbeddedEngine(spec=spec, weights=w).score(ids)
    exported = EmbeddedEngine(EmbeddedEngineConfig(model=ModelConfig(preset=None, path=str(out)))).score(ids)
    assert torch.equal(served, exported)
    other = save_checkpoint(tmp_path / "v2", spec, init_weights(spec, seed=6))
    assert not torch.equal(served, EmbeddedEngine(EmbeddedEngineConfig(
        model=ModelConfig(preset=None, path=str(other)))).score(ids))  # negative control
    with pytest.raises(EngineError, match="never overwrites"):
        save_checkpoint(out, spec, w)


def test_a_bf16_export_loads_tensor_by_tensor_into_the_asked_dtype(tmp_path):
    spec, w = _toy()
    out = save_checkpoint(tmp_path / "bf16", spec, w, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    as_bf16 = load_checkpoint(out, spec, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in as_bf16.values())
    assert all(torch.equal(as_bf16[k], w[k].to(torch.bfloat16)) for k in w)
    as_fp32 = load_checkpoint(out, spec)
    assert all(torch.equal(as_fp32[k], w[k].to(torch.bfloat16).float()) for k in w)


def test_a_broken_sharded_checkpoint_is_a_clear_error(tmp_path):
    spec, w = _toy()
    out = save_checkpoint(tmp_path / "x", spec, w, max_shard_bytes=8 << 20)
    first = sorted(out.glob("*.safetensors"))[0]
    first.rename(out / "elsewhere.bin")
    with pytest.raises(EngineError, match="names shards that are not in"):
        load_checkpoint(out, spec)
    (out / "elsewhere.bin").rename(first)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EngineError, match="model.norm.weight"):
        load_checkpoint(out, spec)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_an_export_loads_in_transformers_with_the_same_log_probs(tmp_path, qk_norm):
    """Where `transformers` is installed: the exported directory loads as a Qwen3 (or Llama)
    model whose log-probs match the engine's (float32, up to kernel order); another seed's
    export does not."""
    transformers = pytest.importorskip("transformers")
    spec = ModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                     vocab_size=300, tie_word_embeddings=False, qk_norm=qk_norm, rope_theta=10000.0, max_position=512)
    w = init_weights(spec, seed=3)
    ids = [t % 300 for t in prompts(1, seed=4)[0]][:40]
    ours = EmbeddedEngine(spec=spec, weights=w).score(ids)

    def theirs(weights, name):
        out = save_checkpoint(tmp_path / name, spec, weights)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    assert torch.allclose(theirs(w, "same"), ours, atol=1e-4)
    assert not torch.allclose(theirs(init_weights(spec, seed=4), "other"), ours, atol=1e-4)  # negative control
