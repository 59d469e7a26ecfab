"""The training state on the wire: pack → unpack rebuilds it bitwise (parameters, moments,
reference, EWMA copy, counters), and the vocabulary tables travel row-sparse."""

from __future__ import annotations

import pytest
import torch

from cells.training import protocol as P
from cells.training.wire import pack, packed_checksum, state_equal, unpack, with_reference
from tests.training.cluster import learner, trajectories

torch.set_num_threads(1)


def test_unpack_of_pack_is_bitwise_and_sparse_on_the_vocabulary_rows():
    a = learner(lr_warmup_steps=3)
    a.set_reference({k: v.detach() + 0.01 for k, v in a.params.items()})
    a.start_rl()
    a.rl_step(trajectories(a, seed=1))
    a.rl_step(trajectories(a, seed=2))
    meta, flat, idx = pack(a)
    b = P.build_learner(P.hyper(a), meta)
    assert not state_equal(a, b)
    unpack(b, meta, flat, idx)
    assert state_equal(a, b) and packed_checksum(*pack(b)) == packed_checksum(meta, flat, idx)
    # a joiner builds its learner from the parameters that arrived and writes only what differs
    fresh = P.build_learner(P.hyper(a), meta, flat)
    unpack(fresh, meta, flat, idx, held="fresh")
    assert state_equal(a, fresh)
    assert (b.version, b.step, b.rl_start_step, b.ewma.weight) == (a.version, a.step, a.rl_start_step, a.ewma.weight)
    rows = {(e["kind"], e["name"]): e.get("rows") for e in meta["entries"]}
    table = "model.embed_tokens.weight"
    n = a.params[table].shape[0]
    # a few rows moved: moments and EWMA travel on those only; the reference differs everywhere
    assert 0 < rows[("exp_avg", table)] < n // 10 and 0 < rows[("ewma", table)] < n // 10
    assert rows[("reference", table)] == n
    # the same next update from both
    batch = trajectories(a, seed=3)
    a.rl_step(batch)
    b.rl_step(batch)
    fresh.rl_step(batch)
    assert state_equal(a, b) and state_equal(a, fresh)


def test_after_a_warm_up_the_ewma_copy_stays_off_the_wire():
    # the warm-up's steps fold into the EWMA copy; RL starts it from the warmed-up weights
    a = learner()
    for seed in range(2):
        t = trajectories(a, seed=seed)[0]
        a.sft_step([(t["token_ids"], t["loss_mask"])])
    table = "model.embed_tokens.weight"
    moved = int((a.reference[table] != a.params[table]).any(dim=1).sum())
    assert 0 < moved < a.params[table].shape[0]
    assert int((a.ewma.params[table] != a.params[table]).any(dim=1).sum()) <= moved  # untouched rows stay equal
    a.start_rl()
    assert all(torch.equal(a.ewma.params[k], a.params[k].detach()) for k in a.params)
    rows = {(e["kind"], e["name"]): e.get("rows") for e in pack(a)[0]["entries"]}
    assert rows[("ewma", table)] == 0


def _trained(seed: int = 1):
    a = learner()
    a.start_rl()
    a.rl_step(trajectories(a, seed=seed))
    return a


def test_a_state_without_its_reference_extends_to_the_whole_state_bitwise():
    a = _trained()
    meta, flat, idx = pack(a, reference=False)
    full, values, rows = with_reference(a, meta, flat, idx)
    whole = pack(a)
    assert values[0] is flat and rows[0] is idx  # the result is not copied
    assert {k: v for k, v in full.items() if k != "pieces"} == whole[0]
    assert torch.equal(torch.cat(values), whole[1]) and torch.equal(torch.cat(rows), whole[2])
    assert packed_checksum(full, values, rows) == packed_checksum(full, torch.cat(values), torch.cat(rows))
    with pytest.raises(ValueError, match="already holds"):
        with_reference(a, *whole)


def test_a_warm_learner_is_overwritten_in_place_whatever_it_held():
    a = _trained()
    meta, flat, idx = pack(a)
    sk = P.build_skeleton(P.skeleton(a))
    b = P.build_skeleton(P.skeleton(a))
    stale = _trained(seed=2)  # a learner holding another state entirely: every tensor differs
    unpack(b, *pack(stale), held="warm")
    for t in (sk, b):
        ptrs = {k: t.optimizer.state[p]["exp_avg"].data_ptr() for k, p in t.params.items()}
        ref = {k: r.data_ptr() for k, r in t.reference.items()}
        unpack(t, meta, flat, idx, held="warm")
        assert state_equal(a, t)
        assert ptrs == {k: t.optimizer.state[p]["exp_avg"].data_ptr() for k, p in t.params.items()}
        assert ref == {k: r.data_ptr() for k, r in t.reference.items()}
    with pytest.raises(ValueError, match="held"):
        unpack(b, meta, flat, idx, held="stale")


def test_a_prepared_learner_receives_its_parameters_in_place():
    a = _trained()
    meta, flat, idx = pack(a)
    rx = torch.zeros(2 * flat.numel())
    sk = P.build_skeleton(P.skeleton(a), param_storage=rx)
    assert all(p.untyped_storage().data_ptr() == rx.untyped_storage().data_ptr() for p in sk.params.values())
    rx[: flat.numel()] = flat  # what `recv_state(..., into=...)` does: the parameters travel first
    unpack(sk, meta, rx[: flat.numel()], idx, held="warm", zero_moments=True)
    assert state_equal(a, sk)
    batch = trajectories(a, seed=3)
    a.rl_step(batch)
    sk.rl_step(batch)  # gradients and the optimizer on parameters that are views of one buffer
    assert state_equal(a, sk)


def _committed_worker(keep_memory: bool):
    from cells.training.wire import weights_checksum
    from cells.training.worker import TrainingWorker

    a = _trained()
    w = TrainingWorker("cell-x", keep_memory=keep_memory)
    w.enter()
    rx = torch.zeros(2 * sum(p.numel() for p in a.params.values()))
    w.learner = P.build_skeleton(P.skeleton(a), param_storage=rx)
    unpack(w.learner, *pack(a), held="warm")
    crc = weights_checksum({k: p.detach() for k, p in a.params.items()})
    w.committed, w._rx, w.tag = {"version": 7, "checksum": crc}, (rx, torch.zeros(0, dtype=torch.long)), "run:3:7"
    w.hyper = P.hyper(a)
    return a, w, crc


def test_a_rank_leaving_training_parks_the_whole_state_in_host_memory():
    from cells.training.wire import weights_checksum

    a, w, crc = _committed_worker(keep_memory=False)  # an engine that takes the memory back
    assert w.weights_for(7) is not None and w.learner is not None  # while training: a copy
    w.leave()
    assert w.learner is None and w._rx is None and not w.active.is_set()  # the learner's memory: gone
    assert w.parked is not None and w.tag == "run:3:7"  # ... the committed state parked, packed
    assert w.weights_for(6) is None  # another version: fetch it
    got = w.weights_for(7)
    assert got is not None and weights_checksum(got) == crc
    assert weights_checksum(w.weights_for(7)) == crc  # still held: the state's home until it changes
    w.enter()
    w.unparked()  # the next attempt unpacks it
    assert w.parked is None and state_equal(a, w.learner)  # bitwise the state it parked


def test_a_rank_keeping_its_memory_keeps_the_whole_state_and_hands_out_copies():
    from cells.training.wire import weights_checksum

    a, w, crc = _committed_worker(keep_memory=True)  # host memory: nothing takes it back
    learner, rx = w.learner, w._rx
    w.leave()
    assert not w.active.is_set() and w.learner is learner and w._rx is rx and w.tag == "run:3:7"
    assert state_equal(a, w.learner)  # still the state under its tag: a re-join with no step between sends nothing
    assert w.weights_for(6) is None
    got = w.weights_for(7)
    assert got is not None and weights_checksum(got) == crc
    ptrs = {p.untyped_storage().data_ptr() for p in learner.params.values()}
    assert not ptrs & {t.untyped_storage().data_ptr() for t in got.values()}  # a copy: the engine owns it
    assert weights_checksum(w.weights_for(7)) == crc  # the learner still holds them
    w.enter()
    assert w.learner is learner  # the next stint joins into these tensors
