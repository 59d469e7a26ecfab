"""The migration stall as the scheduler's token stream sees it."""

from scheduler.control.stallmeter import AFTER_COMMIT, StallMeter


def _steady(m, rid, t0, t1, gap):
    t = t0
    while t < t1:
        m.on_tokens(rid, 1, t)
        t += gap
    return t


def test_stall_is_the_largest_gap_minus_the_typical_one():
    m = StallMeter()
    t = _steady(m, "r", 0.0, 3.0, 0.01)
    m.started("r", t)
    t = _steady(m, "r", t, t + 0.2, 0.01)  # copy rounds: decoding goes on
    t += 0.09  # the stop-and-copy: a 0.1 s gap between two tokens
    m.committed("r")
    out = [m.on_tokens("r", 1, t + i * 0.01) for i in range(AFTER_COMMIT)]
    assert out[:-1] == [None] * (AFTER_COMMIT - 1)
    assert abs(out[-1].seconds - 0.09) < 1e-6  # 0.1 s gap less the 0.01 s typical one
    assert "r" not in m.watches


def test_a_batch_of_tokens_counts_as_one_arrival_and_every_stall_counts():
    m = StallMeter()
    t = _steady(m, "r", 0.0, 2.5, 0.05)
    m.started("r", t)
    m.on_tokens("r", 1, t + 0.3)  # a quiesced copy round before the commit is a stall too
    m.committed("r")
    stall = m.on_tokens("r", AFTER_COMMIT, t + 0.35).seconds  # one batch of 32 closes the window
    # the largest gap straddles the command: from the last arrival before it (t - 0.05) to t + 0.3
    assert abs(stall - (0.35 - 0.05)) < 1e-6


def test_abort_records_nothing_and_a_short_request_is_measured_at_its_end():
    m = StallMeter()
    t = _steady(m, "a", 0.0, 2.1, 0.02)
    m.started("a", t)
    m.aborted("a")
    assert m.on_tokens("a", 1, t + 1.0) is None and m.ended("a") is None
    t = _steady(m, "b", 0.0, 2.1, 0.02)
    m.started("b", t)
    m.committed("b")
    m.on_tokens("b", 1, t + 0.5)
    stall = m.ended("b")
    assert stall is not None and abs(stall.seconds - 0.5) < 1e-6  # (t + 0.5) - (t - 0.02) - 0.02
    assert m.arrivals == {} and m.watches == {}


def test_no_history_means_the_whole_gap_counts():
    m = StallMeter()
    m.on_tokens("n", 1, 10.0)
    m.started("n", 10.0)
    m.committed("n")
    assert abs(m.on_tokens("n", AFTER_COMMIT, 10.4).seconds - 0.4) < 1e-9


def test_the_stall_comes_back_with_its_moves_tag():
    m = StallMeter()
    m.on_tokens("t", 1, 1.0)
    m.started("t", 1.0, ("mig-1", "kv"))
    m.committed("t")
    assert m.on_tokens("t", AFTER_COMMIT, 1.25) == (0.25, ("mig-1", "kv"))
