"""The fault campaign's scenarios, one run each on one shared cluster (bench/faults.py runs
them many times): the fault must fire, and no invariant may break — then the canary run with
fencing switched off must be caught by the same checkers."""

import pytest

from faultkit.campaign import Campaign
from faultkit.celllogs import CELL_LOGS
from faultkit.checker import CLIENT_VS_TRAINER, STORE_HISTORY
from faultkit.scenarios import CANARY_PLAN, SCENARIOS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    camp = Campaign(tmp_path_factory.mktemp("faults"), seed=7, log=print)
    try:
        yield camp
    finally:
        camp.close()


def _why(camp, run) -> str:
    return f"{run.summary()}\n{camp.cluster.logs()[-4000:]}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_keeps_every_invariant(campaign, name):
    (run,) = campaign.execute([(name, 0)])
    assert run.faults, _why(campaign, run)  # the fault really happened
    assert not run.hangs, _why(campaign, run)
    assert run.lost == 0, _why(campaign, run)
    assert run.violations == [], _why(campaign, run)
    assert run.checker_errors == [], _why(campaign, run)  # a crashed checker checked nothing
    assert run.recovery_s is not None, _why(campaign, run)
    assert run.unfired == 0 and run.failed == 0 and run.stream_errors == 0, _why(campaign, run)
    accepted = [c for c in run.clients if c.stream.request_id]
    assert accepted, _why(campaign, run)


def test_every_rogue_cell_is_quarantined_and_nothing_it_sampled_is_trained(campaign):
    """The rogue modes past the refused probe (run 0 above): an out-of-vocabulary token, a -inf
    log-prob, log-probs that are not its tokens'."""
    for run in campaign.execute([("rogue_cell", k) for k in (1, 2, 3)]):
        assert [f["kind"] for f in run.faults] == ["quarantined"], _why(campaign, run)
        assert not run.hangs and run.lost == 0 and run.violations == [], _why(campaign, run)


def test_canary_without_fencing_is_caught_by_the_store_and_the_clients(campaign):
    # Split ownership needs the zombie to wake inside a window that depends on timing: the
    # canary scenarios are tried in turn (twice over) until the store's own token history
    # shows one (not only the cells' migration logs), and a check independent of the store's
    # bookkeeping has caught one too: the cells' own logs of what the scheduler took from them,
    # or the tokens each client received against the session the trainer is handed. (With
    # seeded, batch-invariant sampling a zombie's tokens equal its successor's, and the store
    # takes no token that differs from the one at its index: the clients see no difference.)
    runs = []

    def caught(mark) -> bool:
        return any(mark(v) for r in runs for v in r.violations)

    def by_store(v: str) -> bool:
        return v.startswith("I2:") and STORE_HISTORY in v

    def independently(v: str) -> bool:
        return v.startswith(CLIENT_VS_TRAINER) or CELL_LOGS in v

    for entry in CANARY_PLAN * 2:
        runs += campaign.execute([entry], canary=True)
        if caught(by_store) and caught(independently):
            break
    assert all(r.faults for r in runs), [_why(campaign, r) for r in runs]
    assert caught(by_store), [_why(campaign, r) for r in runs]
    assert caught(independently), [_why(campaign, r) for r in runs]
    assert not campaign.nem.scheduler_env  # the switch is off again for whatever runs next
