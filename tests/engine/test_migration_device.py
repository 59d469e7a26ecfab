"""The host-staged migration path between two cell processes on CPU, in bf16: the cells' own
sender and receiver over gloo, the KV pool's dtype named on the wire, the move token-exact
against an unmoved twin (and an altered token caught)."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_migrate():
    spec = importlib.util.spec_from_file_location("gpu_migrate", os.path.join(ROOT, "bench", "gpu_migrate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODEL = {"preset": "tiny", "vocab_size": 1024, "hidden_size": 128, "num_layers": 2, "head_dim": 32,
         "intermediate_size": 256, "output_id_ranges": [[0, 900], [1000, 1024]]}


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_live_move_between_two_processes_is_token_exact(tmp_path, dtype):
    mod = _gpu_migrate()
    args = {"engine": {"model": MODEL, "batch_invariant": True, "num_blocks": 128, "block_size": 8,
                       "device": "cpu", "dtype": dtype},
            "prompt": list(range(3, 70)), "max_tokens": 24, "seed": 5, "steps_before": 4, "load": 2}
    res = mod.run_pair(args, tmp_path, timeout_s=120)
    assert res.get("error") is None, res
    assert res["outcome"] == {"src": "committed", "dst": "committed"}, res
    assert res["tokens_before_move"] > 0 and res["tokens_after_move"] > 0 and res["kv_bytes"] > 0
    assert res["ok"] and res["negative_control_caught"], res
    assert res["dtype"] == f"torch.{dtype}"


def test_staging_buffers_serve_bf16_rounds_as_views_of_float32_storage():
    import torch

    from cells.migration import StagingBuffers

    st = StagingBuffers(prealloc_numel=100, keep=2, pinned=False)
    a, buf = st.take([3, 5], torch.bfloat16)
    assert a.dtype == torch.bfloat16 and a.shape == (3, 5) and buf.numel() == 100
    a.fill_(1.5)
    assert buf.view(torch.uint8)[:30].view(torch.bfloat16).eq(1.5).all()
    b, bbuf = st.take([7], torch.bfloat16)  # a fresh one: 14 bytes in 4 floats
    assert bbuf.numel() == 4 and b.numel() == 7
