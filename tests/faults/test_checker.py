"""The fault checkers on hand-made histories and snapshots: clean ones pass, and every kind
of violation they exist for is reported (a checker that cannot fail proves nothing)."""

import copy

from faultkit import checker
from faultkit.history import History, load, pairs
from scheduler.contract.states import FLIP, REQUEST


def _sample(t=0.0, **over):
    s = {
        "t": t,
        "requests": {
            "r1": {"cell": "c0", "epoch": 1, "state": "running", "n": 5, "session": "s1", "base": 10, "reason": None},
            "r2": {"cell": "c0", "epoch": 2, "state": "migrating", "n": 3, "session": "s2", "base": 4, "reason": None},
            "r3": {"cell": None, "epoch": 3, "state": "queued", "n": 0, "session": "s3", "base": 4, "reason": None},
            "r4": {"cell": "c1", "epoch": 1, "state": "finished", "n": 8, "session": "s4", "base": 4, "reason": "length"},
        },
        "migrations": {
            "m1": {"request": "r2", "src": "c0", "dst": "c1", "epoch": 2, "state": "pending", "path": "kv",
                   "finished_at": None},
            "m0": {"request": "r4", "src": "c0", "dst": "c1", "epoch": 0, "state": "committed", "path": "kv",
                   "finished_at": 100.0},
        },
        "cells": {
            "c0": {"state": "rollout", "generation": 3, "incarnation": "a", "version": 1,
                   "history": [["joining", 1.0, ""], ["rollout", 2.0, ""]]},
            "c1": {"state": "rollout", "generation": 5, "incarnation": "b", "version": 1,
                   "history": [["joining", 1.0, ""], ["rollout", 2.0, ""]]},
        },
        "versions": {0: "retired", 1: "active"},
        "unscored": {1: 7},
        "flips": {"f1": "draining"},
    }
    s.update(over)
    return s


def _has(violations, *words):
    return any(all(w in v for w in words) for v in violations)


# -- one snapshot ----------------------------------------------------------------------------
def test_clean_snapshot_passes():
    assert checker.sample_problems(_sample()) == []


def test_owned_without_owner_and_waiting_with_owner():
    s = _sample()
    s["requests"]["r1"]["cell"] = None
    s["requests"]["r3"]["cell"] = "c1"
    v = checker.sample_problems(s)
    assert _has(v, "I2", "r1", "without an owner") and _has(v, "I2", "r3", "queued", "owned by c1")


def test_owned_by_a_fenced_cell():
    s = _sample()
    s["cells"]["c0"]["state"] = "down"
    assert _has(checker.sample_problems(s), "I2", "r1", "down")


def test_migrating_needs_exactly_one_pending_migration_from_its_owner():
    s = _sample()
    del s["migrations"]["m1"]
    assert _has(checker.sample_problems(s), "I2", "r2", "migrating")
    s = _sample()
    s["migrations"]["m1"]["epoch"] = 1  # from a stale epoch
    assert _has(checker.sample_problems(s), "I2", "m1", "c0@1")
    s = _sample()
    s["migrations"]["m2"] = dict(s["migrations"]["m1"])
    assert _has(checker.sample_problems(s), "I2", "2 pending")
    s = _sample()
    s["migrations"]["m9"] = dict(s["migrations"]["m1"], request="ghost")
    assert _has(checker.sample_problems(s), "I2", "ghost")


def test_retired_version_with_unscored_tokens_is_i3():
    s = _sample(versions={0: "retired", 1: "active"}, unscored={0: 2})
    assert _has(checker.sample_problems(s), "I3", "version 0", "2")
    # retiring (not yet retired) with a backlog is the normal state of a final pass
    assert checker.sample_problems(_sample(versions={0: "retiring", 1: "active"}, unscored={0: 2})) == []


def test_json_keys_are_accepted():
    s = _sample(versions={"0": "retired"}, unscored={"0": 1})
    assert _has(checker.sample_problems(s), "I3", "version 0")


# -- over time -------------------------------------------------------------------------------
def test_clean_sequence_passes():
    a = _sample(0.0)
    b = copy.deepcopy(a)
    b["t"] = 1.0
    b["requests"]["r2"].update(cell="c1", epoch=3, state="running")  # the commit
    b["migrations"]["m1"].update(state="committed", finished_at=101.0)
    b["requests"]["r3"].update(cell="c1", state="running")  # placed: same epoch, first owner
    b["versions"] = {0: "retired", 1: "active"}
    b["flips"] = {"f1": "done"}
    assert checker.check_samples([a, b]) == []


def test_epoch_going_back_and_two_owners_at_one_epoch():
    a = _sample(0.0)
    b = copy.deepcopy(a)
    b["requests"]["r1"].update(cell="c1")  # same epoch 1, another owner: split ownership
    c = copy.deepcopy(b)
    c["requests"]["r2"]["epoch"] = 1
    c["migrations"]["m1"]["epoch"] = 1
    v = checker.check_samples([a, b, c])
    assert _has(v, "I2", "r1", "two owners", "c0", "c1")
    assert _has(v, "I2", "epoch of r2 went back")


def test_terminal_states_and_committed_tokens_never_go_back():
    a = _sample(0.0)
    b = copy.deepcopy(a)
    b["requests"]["r4"].update(state="running", n=6)
    b["migrations"]["m0"]["state"] = "aborted"
    b["versions"] = {0: "active", 1: "active"}
    b["flips"] = {"f1": "pending"}
    b["cells"]["c1"]["generation"] = 4
    v = checker.check_samples([a, b])
    assert _has(v, "I1", "r4", "finished -> running")
    assert _has(v, "I1", "r4", "lost committed tokens")
    assert _has(v, "I2", "m0", "committed -> aborted")
    assert _has(v, "I3", "version 0", "retired -> active")
    assert _has(v, "f1", "draining -> pending")
    assert _has(v, "generation of c1")


def test_each_violation_is_reported_once():
    s = _sample()
    s["requests"]["r1"]["cell"] = None
    c = checker.SampleChecker()
    assert len(c.feed(s)) == 1
    assert c.feed(copy.deepcopy(s)) == []


def test_commit_by_a_fenced_destination():
    s = _sample()
    s["cells"]["c1"]["history"] = [["rollout", 1.0, ""], ["down", 99.0, "lease"], ["joining", 102.0, "new"]]
    assert _has(checker.check_fenced_commits(s), "I2", "m0", "fenced")
    s["cells"]["c1"]["history"] = [["rollout", 1.0, ""], ["down", 100.5, "lease"]]
    assert checker.check_fenced_commits(s) == []  # fenced after the commit: fine
    assert checker.down_intervals([["down", 1.0], ["joining", 2.0], ["down", 3.0]]) == [(1.0, 2.0), (3.0, float("inf"))]


# -- the cells' own account of migrations ------------------------------------------------------
def _out(mid, role, result):
    return {"cell": "c0" if role == "source" else "c1", "role": role, "result": result, "migration_id": mid,
            "request_id": "r"}


def test_migration_outcomes_one_party_continues():
    migs = {"m1": {"state": "committed", "request": "r"}, "m2": {"state": "aborted", "request": "r"}}
    ok = [_out("m1", "source", "committed"), _out("m1", "destination", "committed"),
          _out("m2", "source", "aborted"), _out("m2", "destination", "failed")]
    assert checker.check_migration_outcomes(ok, migs) == []


def test_split_ownership_is_reported():
    migs = {"m1": {"state": "committed", "request": "r"}, "m2": {"state": "committed", "request": "r"},
            "m3": {"state": "aborted", "request": "r"}}
    bad = [_out("m1", "source", "aborted"), _out("m1", "destination", "committed"),
           _out("m2", "source", "aborted"),  # destination died after its commit
           _out("m3", "destination", "committed")]
    v = checker.check_migration_outcomes(bad, migs)
    assert _has(v, "I2", "split ownership", "m1")
    assert _has(v, "I2", "m2", "after the commit won")
    assert _has(v, "I2", "m3", "store aborted")


# -- requests --------------------------------------------------------------------------------
def _client(tokens, max_tokens=4, finish="length"):
    return {"request_id": "r1", "session_id": "s1", "max_tokens": max_tokens, "tokens": tokens,
            "finish_reason": finish, "error": None}


def _final(n=4, state="finished", reason="length"):
    return {"state": state, "n": n, "reason": reason, "base": 0, "session": "s1", "cell": "c0", "epoch": 2}


ROWS = [(7, 1, 0, "exact"), (8, 1, 0, "exact"), (9, 1, 0, "exact"), (3, 1, 0, None)]


def test_clean_request():
    assert checker.check_request(_client([7, 8, 9, 3]), _final(), ROWS, [7, 8, 9, 3]) == ([], False)
    # a stream cut by a scheduler restart saw a prefix: fine
    assert checker.check_request(_client([7, 8], finish=None), _final(), ROWS, None) == ([], False)


def test_rejected_requests_are_not_checked():
    c = _client([])
    c["request_id"] = None
    assert checker.check_request(c, None, None, None) == ([], False)


def test_lost_requests():
    v, lost = checker.check_request(_client([7]), _final(state="running"), ROWS[:1], None)
    assert lost and _has(v, "I1", "never reached a terminal state")
    v, lost = checker.check_request(_client([7]), None, None, None)
    assert lost and _has(v, "I1", "unknown to the store")


def test_failed_needs_a_reason():
    v, lost = checker.check_request(_client([7], finish=None), _final(n=1, state="failed", reason=None), ROWS[:1], None)
    assert not lost and _has(v, "I1", "without a reason")


def test_duplicated_and_dropped_tokens():
    v, _ = checker.check_request(_client([7, 8, 9, 3]), _final(n=5), ROWS + [(3, 1, 0, None)], None)
    assert _has(v, "I1", "more than max_tokens")
    v, _ = checker.check_request(_client([7, 8, 9]), _final(n=3), ROWS[:3], None)
    assert _has(v, "I1", "finished by length", "dropped")
    v, _ = checker.check_request(_client([7, 8, 9, 3]), _final(n=4), ROWS[:3], None)
    assert _has(v, "I1", "buffer holds 3")
    v, _ = checker.check_request(_client([7, 8, 9, 3]), _final(), [(7, 0, 0, None)] + ROWS[1:], None)
    assert _has(v, "I1", "loss mask")


def test_client_must_see_a_prefix_of_the_store():
    v, _ = checker.check_request(_client([7, 9, 8, 3]), _final(), ROWS, None)
    assert _has(v, "I1", "not a prefix", "first difference at 1")
    v, _ = checker.check_request(_client([7, 8, 8, 9, 3], max_tokens=5), _final(n=4, reason="stop"), ROWS, None)
    assert _has(v, "I1", "not a prefix")  # the client saw a doubled token
    v, _ = checker.check_request(_client([7, 8]), _final(), ROWS, None)
    assert _has(v, "I1", "finish after 2 of 4")


def test_token_exactness_against_the_fault_free_run():
    v, _ = checker.check_request(_client([7, 8, 9, 3]), _final(), ROWS, [7, 8, 9, 4])
    assert _has(v, "I1", "differs from the fault-free run at token 3")
    assert checker.single_version(ROWS) == 0
    assert checker.single_version(ROWS[:2] + [(9, 1, 1, None)]) is None


# -- versions --------------------------------------------------------------------------------
def test_partial_version_never_served():
    assert checker.check_versions([("c0", 0), ("c1", 2)], [0, 2], complete={0, 2}, partial={1}) == []
    v = checker.check_versions([("c0", 1)], [0, 1], complete={0, 2}, partial={1})
    assert _has(v, "I4", "c0", "version 1") and _has(v, "I4", "tokens", "version 1")
    assert _has(checker.check_versions([("c0", 5)], [], complete={0}, partial=set()), "I4", "version 5")


# -- restart ---------------------------------------------------------------------------------
BEFORE = {"flips": {"f1": "pending", "f2": "done"}, "versions": {1: "active", 2: "broadcasting"},
          "generations": {"c0": 4}, "sessions": {"s1": [1, 2, 3]},
          "requests": {"r1": {"cell": "c0", "epoch": 2, "state": "running", "n": 3}}}


def test_restart_that_extends_the_committed_state():
    after = {"flips": {"f1": "draining", "f2": "done", "f3": "pending"}, "versions": {"1": "active", "2": "active"},
             "generations": {"c0": 5}, "sessions": {"s1": [1, 2, 3, 4]},
             "requests": {"r1": {"cell": None, "epoch": 3, "state": "queued", "n": 3}}}
    assert checker.check_restart(BEFORE, after) == []


def test_restart_that_loses_or_rewinds_committed_state():
    after = {"flips": {"f1": "pending"}, "versions": {1: "broadcasting"}, "generations": {"c0": 3},
             "sessions": {"s1": [1, 2]},
             "requests": {"r1": {"cell": "c0", "epoch": 1, "state": "running", "n": 3}}}
    v = checker.check_restart(BEFORE, after)
    assert _has(v, "I5", "f2", "gone")
    assert _has(v, "I5", "version 1", "active -> broadcasting")
    assert _has(v, "I5", "version 2", "gone")
    assert _has(v, "I5", "s1")
    assert _has(v, "I5", "generation of c0")
    assert _has(v, "I5", "r1", "went back")
    assert _has(checker.check_restart(BEFORE, {**after, "flips": {"f1": "pending", "f2": "failed"}}), "f2", "done -> failed")


def test_reachable_follows_the_state_machines():
    assert checker.reachable(FLIP, "pending", "done") and checker.reachable(FLIP, "done", "done")
    assert not checker.reachable(FLIP, "done", "pending")
    assert checker.reachable(REQUEST, "queued", "finished") and not checker.reachable(REQUEST, "failed", "running")


# -- recovery --------------------------------------------------------------------------------
def _rs(t, n1, n2, s2="running"):
    return {"t": t, "requests": {"a": {"n": n1, "state": "running"}, "b": {"n": n2, "state": s2}}}


def test_recovery_time():
    samples = [_rs(0.0, 5, 5), _rs(1.0, 5, 5), _rs(1.5, 6, 5), _rs(3.0, 6, 5), _rs(4.0, 6, 9)]
    assert checker.recovery_s(samples, 0.9, ["a", "b"], in_flight_s=0.0) == 3.1
    # tokens sent before the fault land within one sync: not a recovery
    samples = [_rs(0.0, 5, 5), _rs(1.1, 6, 6), _rs(2.0, 6, 6), _rs(3.0, 7, 7)]
    assert checker.recovery_s(samples, 1.0, ["a", "b"], in_flight_s=0.3) == 2.0
    assert checker.recovery_s([_rs(0.0, 5, 5, "finished"), _rs(1.0, 5, 5, "finished")], 0.5, ["b"]) == 0.0
    assert checker.recovery_s([_rs(0.0, 5, 5), _rs(5.0, 5, 5)], 0.5, ["a"]) is None


# -- history ---------------------------------------------------------------------------------
def test_history_records_and_round_trips(tmp_path):
    clock = iter(range(100)).__next__
    h = History(tmp_path / "h.jsonl", clock=lambda: float(clock()))
    a = h.invoke("client-1", "request", max_tokens=4)
    b = h.invoke("client-2", "request", max_tokens=5)
    h.info("nemesis", "fault", kind="SIGKILL", target="cell-0")
    h.ok(a, tokens=4)
    h.fail(b, "503")
    open_ = h.invoke("client-3", "request")
    h.close()
    recs = load(tmp_path / "h.jsonl")
    assert [r["type"] for r in recs] == ["invoke", "invoke", "info", "ok", "fail", "invoke"]
    assert [r["t"] for r in recs] == sorted(r["t"] for r in recs)
    got = pairs(recs)
    assert [(i["process"], c and c["type"]) for i, c in got] == [("client-1", "ok"), ("client-2", "fail"),
                                                                   ("client-3", None)]
    assert got[1][1]["value"]["reason"] == "503" and recs[open_]["f"] == "request"
    assert h.completion(a)["value"] == {"tokens": 4} and h.completion(open_) is None
    assert [r["i"] for r in h.select(f="request", type_="invoke")] == [a, b, open_]


def test_token_epochs_past_a_commit_point_must_be_newer():
    reqs = {"r": {"session": "s", "base": 2}}
    migs = {"m1": {"state": "committed", "request": "r", "epoch": 1, "commit_tokens": 3},
            "m0": {"state": "aborted", "request": "r", "epoch": 1, "commit_tokens": None}}
    clean = {"s": [(2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]}  # the tail (index 4) under epoch 2
    assert checker.check_token_epochs(reqs, migs, clean) == []
    zombie = {"s": [(2, 1), (3, 1), (4, 2), (5, 1), (6, 2)]}  # index 5 from the fenced epoch-1 owner
    v = checker.check_token_epochs(reqs, migs, zombie)
    assert len(v) == 1 and _has(v, "I2", checker.STORE_HISTORY, "m1", "from index 5")
    old_rows = {"s": [(2, None), (3, None), (5, None)]}  # a store from before epochs were kept
    assert checker.check_token_epochs(reqs, migs, old_rows) == []


def test_recovery_is_what_each_affected_client_felt_and_none_in_flight_says_so():
    from types import SimpleNamespace

    from faultkit.runs import Run, client_recoveries, summarize

    def client(times, finished_at=None):
        return SimpleNamespace(stream=SimpleNamespace(request_id="r", times=times, finished_at=finished_at))

    run = Run("s", 0, 0, t_fault=10.0)
    run.clients = [client([9.0, 9.5, 10.1, 12.5]),  # one in flight: 10.1 was sampled before the fault
                   client([9.0, 9.2], finished_at=9.3),  # done before the fault: not affected
                   client([11.0, 11.2]),  # started after it: not affected
                   client([9.8], finished_at=10.9)]  # only its finish came after
    assert client_recoveries(run) == [2.5, 0.9]
    run.recoveries = client_recoveries(run)
    quiet = Run("q", 1, 0, t_fault=10.0)
    out = summarize([run, quiet], [])
    assert (out["affected_requests"], out["recovery_p50_s"], out["max_recovery_s"]) == (2, 2.5, 2.5)
    assert out["by_scenario"]["s"]["recovery_max_s"] == 2.5
    q = out["by_scenario"]["q"]
    assert q["recovery_max_s"] is None and q["recovery"] == "no request in flight at any fault"


def test_client_tokens_against_what_the_trainer_is_handed():
    from faultkit.checker import CLIENT_VS_TRAINER, check_client_vs_trainer

    def session(ids, gen_mask=None):
        prompt = [1, 2, 3]
        gen = ids[len(prompt):]
        return {"token_ids": ids, "loss_mask": [0] * len(prompt) + (gen_mask or [1] * len(gen))}

    prompt = [1, 2, 3]
    assert check_client_vs_trainer(prompt, [7, 8], True, session([1, 2, 3, 7, 8]), "r") == []
    assert check_client_vs_trainer(prompt, [7], False, session([1, 2, 3, 7, 8]), "r") == []  # stream cut: more is fine
    bad = {
        "gap": check_client_vs_trainer(prompt, [7, 8], True, session([1, 2, 3, 7]), "r"),
        "changed": check_client_vs_trainer(prompt, [7, 8], True, session([1, 2, 3, 7, 9]), "r"),
        "duplicate": check_client_vs_trainer(prompt, [7, 8], True, session([1, 2, 3, 7, 8, 8]), "r"),
        "foreign prompt": check_client_vs_trainer(prompt, [7], True, session([1, 2, 4, 7]), "r"),
        "unsampled": check_client_vs_trainer(prompt, [7], True, session([1, 2, 3, 7], [0]), "r"),
        "missing session": check_client_vs_trainer(prompt, [7], True, None, "r"),
    }
    assert all(v and all(x.startswith(CLIENT_VS_TRAINER) for x in v) for v in bad.values()), bad
