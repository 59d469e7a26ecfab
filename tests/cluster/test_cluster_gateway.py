"""The chat gateway on the real control plane: the official OpenAI client talks to the
scheduler, cells decode, and the durable session store holds exactly the sampled tokens."""

import pytest

from .harness import Cluster

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

QWEN_VOCAB_MODEL = {"preset": "tiny", "hidden_size": 64, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2,
                    "head_dim": 16, "intermediate_size": 128}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, num_cells=2, cells__engine={"type": "embedded", "model": QWEN_VOCAB_MODEL,
                                                       "num_blocks": 256, "block_size": 16, "batch_invariant": True})
    yield c
    c.stop()


def _sampled(cluster, sid):
    s = cluster.session(sid)
    return [t for t, m in zip(s["token_ids"], s["loss_mask"]) if m == 1], s


@pytest.mark.parametrize("stream", [False, True])
def test_multi_turn_chat_records_exactly_the_sampled_tokens(cluster, stream):
    sid = f"chat-{int(stream)}"
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=cluster.token, default_headers={"X-Session-Id": sid})
    messages = [{"role": "user", "content": "What is 17 + 25? Use the calculator."}]
    completions = []
    for turn in range(3):
        if stream:
            ids, text = [], ""
            for chunk in client.chat.completions.create(model="cellflip", messages=messages, max_tokens=10,
                                                        seed=turn, stream=True):
                extra = chunk.choices[0].model_extra or {} if chunk.choices else {}
                ids += extra.get("token_ids") or []
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        else:
            r = client.chat.completions.create(model="cellflip", messages=messages, max_tokens=10, seed=turn)
            ids, text = r.choices[0].model_extra["token_ids"], r.choices[0].message.content or ""
        assert 1 <= len(ids) <= 10
        completions.append(ids)
        sampled, sess = _sampled(cluster, sid)
        # TITO: the store holds every completion verbatim, and the buffer only ever grew
        assert sampled == [t for c in completions for t in c]
        assert sess["segment_starts"] == [0]
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and turn {turn}?"}]
    metrics = cluster.http.get("/metrics").text
    drift = [ln for ln in metrics.splitlines() if ln.startswith("cellflip_retokenization_drift_total")
             or ln.startswith("retokenization_drift_total")]
    assert drift and all(float(ln.split()[-1]) == 0 for ln in drift)
    # turns 2 and 3 went back to their cell with only their new tokens, and it held the prefix
    assert 'cellflip_request_starts_total{kind="delta"} 2.0' in metrics, metrics
    assert "cellflip_prefix_missing_total 0.0" in metrics
