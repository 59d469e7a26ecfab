"""Destination side of the two-process hand-over test (run as `python -m tests.engine.gloo_peer ARGS_JSON`).

Metadata travels as JSON bytes in uint8 tensors, KV as tensors: no pickle on the wire.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def send_json(obj, dst: int) -> None:
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst)
    dist.send(data, dst)


def recv_json(src: int):
    n = torch.zeros(1, dtype=torch.int64)
    dist.recv(n, src)
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.recv(buf, src)
    return json.loads(bytes(buf.numpy()).decode())


def recv_kv(engine, rid: str, src: int) -> None:
    head = recv_json(src)
    data = torch.empty(head["shape"], dtype=torch.float32)
    dist.recv(data, src)
    engine.handover.import_kv(rid, head["start"], data)


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    from cells.engine.records import RequestSnapshot

    from .enginekit import make_engine, params, prompts, run_all

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=1, world_size=2,
                            timeout=timedelta(seconds=60))
    eng = make_engine(args["batch_invariant"])
    for j, p in enumerate(prompts(2, seed=77)):
        eng.add_request(f"d{j}", p, params(60 + j, max_tokens=25))
    eng.step()
    hello = recv_json(0)
    assert eng.handover.reserve(hello["rid"], hello["num_tokens"], headroom_blocks=4)
    while True:
        kind = recv_json(0)["kind"]
        if kind == "kv":
            recv_kv(eng, hello["rid"], 0)
        else:
            break
    snap = RequestSnapshot.from_dict(recv_json(0))
    eng.handover.import_request(snap)
    kv = [eng.pool.read(layer, snap.request_id, snap.num_computed) for layer in range(eng.spec.num_layers)]
    send_json({"ack": True}, 0)
    for k, v in kv:
        dist.send(k.contiguous(), 0)
        dist.send(v.contiguous(), 0)
    eng.handover.resume_request(snap.request_id)
    out = run_all(eng)
    tokens = [[e.index, e.record.token_id] for e in out[snap.request_id]]
    with open(args["out"], "w") as f:
        json.dump({"tokens": tokens}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
