"""Staging buffers of the host-staged migration path (the move itself between two processes in
bf16: tests/engine/test_gpu_check.py, part b)."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpu_migrate():
    spec = importlib.util.spec_from_file_location("gpu_migrate", os.path.join(ROOT, "bench", "gpu_migrate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MODEL = {"preset": "tiny", "vocab_size": 1024, "hidden_size": 128, "num_layers": 2, "head_dim": 32,
         "intermediate_size": 256, "output_id_ranges": [[0, 900], [1000, 1024]]}


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
