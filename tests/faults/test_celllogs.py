"""I2 from the cells' own sync logs: what each cell was told the scheduler took from it."""

import json

from faultkit.celllogs import CELL_LOGS, check_accepted_syncs, commit_fences, read_sync_log


def rec(cell, epoch, start, sent, request="r"):
    return {"cell": cell, "request": request, "epoch": epoch, "start": start, "n": 4, "sent": sent}


def test_a_fenced_history_passes():
    # cell-1 owns at epoch 1, the request moves to cell-2 at epoch 2, then back to cell-1 at 3
    recs = [rec("cell-1", 1, 0, 1.0), rec("cell-1", 1, 4, 1.1), rec("cell-2", 2, 8, 2.0),
            rec("cell-1", 3, 12, 3.0), rec("cell-9", 1, 0, 0.5, request="other")]
    assert check_accepted_syncs(recs) == []


def test_an_older_epoch_accepted_after_a_newer_one_is_caught():
    """The zombie: cell-1 slept past its lease, the request went on at cell-0 (epoch 2), and
    the tokens cell-1 sent on waking were taken anyway."""
    recs = [rec("cell-1", 1, 0, 1.0), rec("cell-0", 2, 8, 2.0), rec("cell-1", 1, 8, 5.0)]
    (v,) = check_accepted_syncs(recs)
    assert v.startswith("I2:") and CELL_LOGS in v and "cell-1" in v and "epoch 1" in v


def test_an_older_epoch_accepted_after_the_destination_learned_of_its_commit_is_caught():
    """The zombie destination: it committed (epoch 2) and slept; the source resumed and its
    tokens at epoch 1 were taken although they were sent after the commit."""
    outcomes = [{"cell": "cell-2", "request_id": "r", "role": "destination", "result": "committed", "epoch": 2,
                 "marks": {"committed": 2.0}},
                {"cell": "cell-1", "request_id": "r", "role": "source", "result": "failed", "epoch": None,
                 "marks": {"result": 2.5}}]
    fences = commit_fences(outcomes)
    assert fences == [{"request": "r", "epoch": 2, "at": 2.0, "cell": "cell-2"}]
    recs = [rec("cell-1", 1, 0, 1.0), rec("cell-1", 1, 8, 3.0), rec("cell-2", 2, 8, 9.0)]
    (v,) = check_accepted_syncs(recs, fences)
    assert "cell-1's tokens at epoch 1" in v and "learned of its commit" in v
    # the negative control: the same tokens sent before the commit are the source's by right
    assert check_accepted_syncs([rec("cell-1", 1, 0, 1.0), rec("cell-1", 1, 8, 1.5), rec("cell-2", 2, 8, 9.0)],
                                fences) == []


def test_two_cells_at_one_epoch_are_caught():
    recs = [rec("cell-1", 2, 0, 1.0), rec("cell-2", 2, 0, 1.5)]
    (v,) = check_accepted_syncs(recs)
    assert "cell-1 and cell-2 at one epoch 2" in v


def test_the_log_is_read_from_an_offset_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "syncs.jsonl"
    first = json.dumps(rec("cell-1", 1, 0, 1.0)) + "\n"
    path.write_text(first + json.dumps(rec("cell-2", 2, 4, 2.0)) + "\n" + '{"cell": "cell-')
    assert [r["cell"] for r in read_sync_log(path)] == ["cell-1", "cell-2"]
    assert [r["cell"] for r in read_sync_log(path, len(first))] == ["cell-2"]
    assert read_sync_log(tmp_path / "absent.jsonl") == []


def test_a_cell_logs_only_the_batches_the_scheduler_took(tmp_path, monkeypatch):
    from cells.agent.owned import SYNC_LOG_ENV, log_accepted
    from scheduler.contract.protocol import TokenBatch
    from scheduler.contract.records import TokenRecord, TokenRecords

    path = tmp_path / "syncs.jsonl"
    monkeypatch.setenv(SYNC_LOG_ENV, str(path))
    one = TokenRecords.of([TokenRecord(token_id=5, logprob=-0.5, version=1)])
    batches = [TokenBatch("a", 1, 0, one), TokenBatch("b", 3, 7, one), TokenBatch("c", 1, 2)]
    log_accepted("cell-4", 12.5, batches, {"b"})
    got = read_sync_log(path)
    assert [(r["request"], r["epoch"], r["start"], r["n"], r["sent"]) for r in got] == [("a", 1, 0, 1, 12.5)]
