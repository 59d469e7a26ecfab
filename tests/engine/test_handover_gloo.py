"""Hand-over between two processes: KV tensors over gloo send/recv on 127.0.0.1."""

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from .enginekit import make_engine, params, prompts, run_all
from .gloo_peer import recv_json, send_json

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def send_kv(engine, rid, start, end):
    data = engine.handover.export_kv(rid, start, end).contiguous()
    send_json({"kind": "kv"}, 1)
    send_json({"start": start, "shape": list(data.shape)}, 1)
    dist.send(data, 1)


@pytest.mark.parametrize("batch_invariant,after_steps", [(True, 3), (True, 9), (False, 5)])
def test_two_process_hand_over(tmp_path, free_port, batch_invariant, after_steps):
    ps = prompts(3, seed=30)
    pars = [params(i, max_tokens=18) for i in range(3)]
    ref_eng = make_engine(batch_invariant)
    for i in range(3):
        ref_eng.add_request(f"r{i}", ps[i], pars[i])
    ref = {k: [e.record.token_id for e in v] for k, v in run_all(ref_eng).items()}

    out = tmp_path / "dst.json"
    args = json.dumps({"port": free_port, "batch_invariant": batch_invariant, "out": str(out)})
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "tests.engine.gloo_peer", args], cwd=ROOT, env=env)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port}", rank=0, world_size=2,
                                timeout=timedelta(seconds=60))
        src = make_engine(batch_invariant)
        for i in range(3):
            src.add_request(f"r{i}", ps[i], pars[i])
        got = {}
        for _ in range(after_steps):
            for ev in src.step():
                got.setdefault(ev.request_id, []).append((ev.index, ev.record.token_id))
        rid = "r1"
        send_json({"rid": rid, "num_tokens": src.handover.snapshot(rid).num_tokens}, 1)
        sent = src.handover.num_complete_blocks(rid)
        send_kv(src, rid, 0, sent)  # copy round while decoding continues
        for ev in src.step():
            got.setdefault(ev.request_id, []).append((ev.index, ev.record.token_id))
        src.handover.pause_request(rid)
        end = src.handover.num_kv_blocks(rid)
        if end > sent:
            send_kv(src, rid, sent, end)
        send_json({"kind": "done"}, 1)
        snap = src.handover.snapshot(rid)
        send_json(snap.to_dict(), 1)
        assert recv_json(1)["ack"]
        for layer in range(src.spec.num_layers):
            k_src, v_src = src.pool.read(layer, rid, snap.num_computed)
            k_dst, v_dst = torch.empty_like(k_src), torch.empty_like(v_src)
            dist.recv(k_dst, 1)
            dist.recv(v_dst, 1)
            assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst), "imported KV is not bitwise equal"
        src.handover.release(rid)
        for k, evs in run_all(src).items():
            got.setdefault(k, []).extend((e.index, e.record.token_id) for e in evs)
        assert child.wait(timeout=120) == 0
        got[rid] = got.get(rid, []) + [tuple(x) for x in json.loads(out.read_text())["tokens"]]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    for k in ref:
        assert [i for i, _ in got[k]] == list(range(len(ref[k]))), "token lost or doubled"
        if batch_invariant:
            assert [t for _, t in got[k]] == ref[k]
