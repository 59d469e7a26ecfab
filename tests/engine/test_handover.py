import pytest
import torch

from cells.engine.records import EngineError, SamplingParams

from .enginekit import make_engine, params, prompts, run_all


def migrate(src, dst, rid, rounds=2):
    """Copy rounds while the source decodes, then stop-and-copy, import, resume, free."""
    assert dst.handover.reserve(rid, src.handover.snapshot(rid).num_tokens, headroom_blocks=2)
    sent, events = 0, []
    for _ in range(rounds):
        done = src.handover.num_complete_blocks(rid)
        if done > sent:
            dst.handover.import_kv(rid, sent, src.handover.export_kv(rid, sent, done))
            sent = done
        events += src.step()  # the request keeps decoding between rounds
    src.handover.pause_request(rid)
    end = src.handover.num_kv_blocks(rid)
    if end > sent:
        dst.handover.import_kv(rid, sent, src.handover.export_kv(rid, sent, end))
    snap = src.handover.snapshot(rid)
    dst.handover.import_request(snap)
    for layer in range(src.spec.num_layers):
        ks, vs = src.pool.read(layer, rid, snap.num_computed)
        kd, vd = dst.pool.read(layer, rid, snap.num_computed)
        assert torch.equal(ks, kd) and torch.equal(vs, vd), "imported KV differs"
    dst.handover.resume_request(rid)
    src.handover.release(rid)
    return events


def _reference(batch_invariant, ps, pars):
    eng = make_engine(batch_invariant)
    for i, (p, sp) in enumerate(zip(ps, pars)):
        eng.add_request(f"r{i}", p, sp)
    return {k: [e.record.token_id for e in v] for k, v in run_all(eng).items()}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("after_steps", [1, 5, 11])
def test_hand_over_is_token_identical_in_batch_invariant_mode(greedy, after_steps):
    ps = prompts(4, seed=20)
    pars = [params(i, greedy, max_tokens=20) for i in range(4)]
    ref = _reference(True, ps, pars)
    src, dst = make_engine(True), make_engine(True)
    for i in range(4):
        src.add_request(f"r{i}", ps[i], pars[i])
    # different neighbours on the destination
    for j, p in enumerate(prompts(3, seed=99)):
        dst.add_request(f"d{j}", p, params(50 + j, max_tokens=30))
    got = {}
    for _ in range(after_steps):
        for ev in src.step():
            got.setdefault(ev.request_id, []).append(ev.record.token_id)
    for ev in migrate(src, dst, "r1"):
        got.setdefault(ev.request_id, []).append(ev.record.token_id)
    for eng in (src, dst):
        for k, evs in run_all(eng).items():
            got.setdefault(k, []).extend(e.record.token_id for e in evs)
    for k in ref:
        assert got[k] == ref[k], k
    src.pool.check_integrity()
    dst.pool.check_integrity()
    assert src.pool.num_used == 0 and dst.pool.num_used == 0


def test_fast_mode_hand_over_loses_and_doubles_nothing():
    ps = prompts(3, seed=21)
    src, dst = make_engine(False), make_engine(False)
    for i in range(3):
        src.add_request(f"r{i}", ps[i], params(i, max_tokens=20))
    idx = {}
    for _ in range(6):
        for ev in src.step():
            idx.setdefault(ev.request_id, []).append(ev.index)
    for ev in migrate(src, dst, "r0"):
        idx.setdefault(ev.request_id, []).append(ev.index)
    for eng in (src, dst):
        for k, evs in run_all(eng).items():
            idx.setdefault(k, []).extend(e.index for e in evs)
    assert all(v == list(range(20)) for v in idx.values()), idx


def test_state_from_a_different_model_shape_is_refused():
    src = make_engine(True)
    src.add_request("r", prompts(1)[0], SamplingParams(max_tokens=5))
    src.step()
    src.handover.pause_request("r")
    other = make_engine(True, block_size=16)
    assert other.handover.reserve("r", 100)
    with pytest.raises(EngineError, match="shape"):
        other.handover.import_kv("r", 0, src.handover.export_kv("r", 0, 1))
    with pytest.raises(EngineError, match="block size"):
        other.handover.import_request(src.handover.snapshot("r"))


def test_refused_reservation_has_no_side_effects():
    dst = make_engine(True, num_blocks=4)
    assert not dst.handover.reserve("r", 1000)
    dst.pool.check_integrity()
    assert dst.pool.num_free == 4


def test_source_resumes_after_an_aborted_hand_over():
    ps = prompts(1, seed=22)
    ref = _reference(True, ps, [params(0, max_tokens=15)])["r0"]
    src = make_engine(True)
    src.add_request("r0", ps[0], params(0, max_tokens=15))
    toks = [e.record.token_id for _ in range(4) for e in src.step()]
    src.handover.pause_request("r0")
    assert src.step() == []  # paused: nothing decodes
    src.handover.resume_request("r0")
    toks += [e.record.token_id for e in run_all(src)["r0"]]
    assert toks == ref


def test_snapshot_records_do_not_grow_with_context():
    src = make_engine(True)
    src.add_request("r", prompts(1)[0], params(0, max_tokens=30))
    for _ in range(25):
        src.step()
    snap = src.handover.snapshot("r", records_from=20, token_ids_from=src.handover.snapshot("r").num_tokens)
    assert len(snap.records) == 5 and snap.records_from == 20 and snap.token_ids == []
    assert snap.to_dict()["params"]["seed"] == 100


def test_parked_request_frees_its_blocks_and_moves_on_token_identical():
    """Suspension with the KV in host memory: the parked request stops, its blocks return to
    the pool, and a later hand-over from the host copy continues it token for token."""
    ps = prompts(3, seed=23)
    pars = [params(i, max_tokens=24) for i in range(3)]
    ref = _reference(True, ps, pars)
    src, dst = make_engine(True), make_engine(True)
    for i in range(3):
        src.add_request(f"r{i}", ps[i], pars[i])
    got = {}
    for _ in range(7):
        for ev in src.step():
            got.setdefault(ev.request_id, []).append(ev.record.token_id)
    before = src.handover.export_kv("r2", 0, src.handover.num_kv_blocks("r2"))
    used = src.pool.num_used
    nbytes = src.handover.park("r2")
    assert nbytes == before.numel() * before.element_size() > 0
    assert src.handover.park("r2") == nbytes  # idempotent
    assert src.pool.num_used == used - before.shape[2]
    assert src.handover.parked() == ["r2"] and src.num_inflight() == 2
    assert src.summary().parked == ["r2"] and "r2" in src.summary().request_ids
    for k, evs in run_all(src).items():  # the others finish; the parked one never decodes
        got.setdefault(k, []).extend(e.record.token_id for e in evs)
    assert "r2" in src.requests and src.pool.num_used == 0
    assert torch.equal(src.handover.export_kv("r2", 0, before.shape[2]), before)
    src.handover.resume_request("r2")  # an aborted move out: it stays parked
    assert src.handover.parked() == ["r2"]
    snap = src.handover.snapshot("r2")
    assert dst.handover.reserve("r2", snap.num_tokens, headroom_blocks=2)
    src.handover.pause_request("r2")
    dst.handover.import_kv("r2", 0, src.handover.export_kv("r2", 0, src.handover.num_kv_blocks("r2")))
    dst.handover.import_request(src.handover.snapshot("r2"))
    dst.handover.resume_request("r2")
    src.handover.release("r2")
    for k, evs in run_all(dst).items():
        got.setdefault(k, []).extend(e.record.token_id for e in evs)
    assert got == ref
    assert src.requests == {} and src.pool.num_used == 0 and dst.pool.num_used == 0
    src.pool.check_integrity()


def test_pause_after_stops_right_after_that_token_and_unpause_undoes_it():
    ps = prompts(2, seed=31)
    pars = [params(i, max_tokens=12) for i in range(2)]
    ref = _reference(True, ps, pars)
    eng = make_engine(True)
    for i in range(2):
        eng.add_request(f"r{i}", ps[i], pars[i])
    got: dict[str, list[int]] = {}

    def step():
        for ev in eng.step():
            got.setdefault(ev.request_id, []).append(ev.record.token_id)

    for _ in range(3):
        step()
    n = eng.handover.request_length("r0")[0]
    eng.handover.pause_after("r0", n + 1)
    step()
    assert eng.handover.request_length("r0")[0] == n + 1 and eng.requests["r0"].status == "paused"
    for _ in range(3):  # r0 stands still, r1 goes on
        step()
    assert eng.handover.request_length("r0")[0] == n + 1 and len(got["r1"]) == 7
    eng.handover.pause_after("r0", n + 5)  # already paused: nothing changes
    eng.handover.unpause("r0")
    eng.handover.pause_after("r1", 1)  # already past it: paused at once
    assert eng.requests["r1"].status == "paused"
    eng.handover.unpause("r1")
    eng.handover.pause_after("r0", n + 3)
    eng.handover.unpause("r0")  # an armed pause that never fired is dropped
    eng.handover.unpause("gone")  # unknown: nothing to undo
    for k, evs in run_all(eng).items():
        got.setdefault(k, []).extend(e.record.token_id for e in evs)
    assert got == ref  # token-exact against never pausing
