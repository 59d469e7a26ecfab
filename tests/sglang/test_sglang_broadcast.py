"""One publish, two kinds of receivers: embedded cells join the trainer's bucketed broadcast,
SGLang cells (the recording fake, whose `flattened_bucket` receive joins a real gloo group)
get the version over an update group; a cell that never joins is reported failed within the
join timeout and catches up point-to-point, installed in place.

The test process is the trainer (it owns the `VersionHost`) and every cell: each SGLang cell
is a `CellVersions` with an engine loop on its own thread, as the cell agent runs it.
"""

from __future__ import annotations

import threading
import time

import fake_sglang
import pytest
import torch

from cells.engine.records import SamplingParams
from cells.engine.sglang.engine import SGLangEngine
from cells.transport.receive import receive_broadcast
from cells.transport.store import connect, get_json
from cells.transport.versions_host import VersionHost
from cells.versions import CellVersions
from scheduler.contract.config.engine import SGLangEngineConfig
from scheduler.contract.protocol import LoadVersionCmd

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(90)

OP_TIMEOUT_S = 5.0
JOIN_TIMEOUT_S = 3.0
"""How long the trainer waits for a receiver to say it is ready: what a cell that never joins
costs the publish."""
SLACK_S = 10.0
"""Scheduling slack on a loaded 2-core machine."""
BUCKET_BYTES = 4096
REQUESTS = 4
"""Requests in flight per SGLang cell during the update (the fake may end one early by EOS)."""


def version_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A toy version in dtypes SGLang loads, several buckets long (one tensor alone in one)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.qkv_proj.weight": torch.randn(48, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.float16),
        "model.layers.0.mlp.quant": torch.randint(-100, 100, (37,), generator=g, dtype=torch.int8),
        "lm_head.weight": torch.randn(2000, generator=g),
    }


def bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) >= set(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        and torch.equal(got[k].view(torch.uint8) if got[k].numel() else got[k],
                        want[k].view(torch.uint8) if want[k].numel() else want[k])
        for k in want)


class Scorer:
    """A scoring copy (`scoring: cell_copy`): its rank in the update group verifies the CRCs."""

    device = "cpu"

    def __init__(self) -> None:
        self.loaded: list[tuple[int, dict[str, torch.Tensor]]] = []

    def score(self, token_ids, *, temperature=1.0):
        return torch.zeros(len(token_ids) - 1)

    def load_weights(self, version, tensors):
        self.loaded.append((version, {k: v.clone() for k, v in tensors.items()}))


class SGLangCell:
    """An SGLang cell as the agent runs it: `CellVersions` beside an engine loop thread that
    installs staged versions between steps and decodes. Every engine call after construction
    happens on that thread."""

    def __init__(self, cell_id: str, *, scorer: Scorer | None = None, run_loop: bool = True) -> None:
        mods, _ = fake_sglang.fake_modules()
        cfg = SGLangEngineConfig(model_path="m", scoring="cell_copy" if scorer else "publisher_copy")
        self.cell_id, self.scorer = cell_id, scorer
        self.engine = SGLangEngine(cfg, modules=mods, scorer=scorer, transfer_timeout_s=OP_TIMEOUT_S + SLACK_S)
        self.fake = self.engine.runtime.sglang
        self.events: list[dict] = []
        self.tokens: list = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.steps_left = float("inf")
        """Engine steps the loop may still take (it installs versions regardless): the fake
        decodes only when stepped, so a test can hold requests in flight across an update."""
        self.versions = CellVersions(cell_id, emit=lambda e: self.events.append(e.to_dict()), wake=self._wake.set,
                                     timeout_s=OP_TIMEOUT_S, engine=self.engine,
                                     join_timeout_s=JOIN_TIMEOUT_S + SLACK_S)
        self.thread = threading.Thread(target=self._loop, name=f"engine-{cell_id}", daemon=True)
        if run_loop:
            self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.versions.has_staged():
                self.versions.activate_staged(self.engine)
            if self.steps_left > 0 and self.engine.has_work():
                self.steps_left -= 1
                self.tokens += self.engine.step()
            else:
                self._wake.wait(0.01)
                self._wake.clear()

    def load(self, host: VersionHost, version: int, mode: str = "broadcast") -> None:
        a = host.address
        cmd = LoadVersionCmd(1, version, {"host": a.host, "port": a.port, "namespace": host.namespace}, mode)
        self.versions.load(cmd, [], self.engine.version)

    @staticmethod
    def wait(cond, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() >= deadline:
                raise AssertionError(f"condition not met in {timeout_s}s")
            time.sleep(0.01)

    def wait_event(self, version: int, timeout_s: float) -> dict:
        """The final event for `version` (ok, or a failure no fetch followed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [e for e in self.events if e["version"] == version and (e["ok"] or e["mode"] == "fetch")]
            if done and version not in self.versions.loading:
                return done[-1]
            time.sleep(0.02)
        raise AssertionError(f"{self.cell_id}: no outcome for version {version} in {timeout_s}s: {self.events}")

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.engine.close()


@pytest.fixture
def host():
    h = VersionHost("127.0.0.1", 0, bucket_bytes=BUCKET_BYTES, timeout_s=OP_TIMEOUT_S,
                    join_timeout_s=JOIN_TIMEOUT_S)
    h.start()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def cells():
    made: list[SGLangCell] = []

    def make(cell_id: str, **kw) -> SGLangCell:
        made.append(SGLangCell(cell_id, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _update_calls(log: list[tuple]) -> list[int]:
    return [i for i, e in enumerate(log) if e[0] == "update_weights_from_distributed"]


def test_one_publish_serves_embedded_and_sglang_cells_and_a_missing_one_catches_up(host, cells):
    v1 = version_tensors(1)
    host.put(1, v1)
    sg0, sg1 = cells("sg0"), cells("sg1", scorer=Scorer())
    ghost = cells("ghost")  # named by the scheduler, never joins
    for c in (sg0, sg1):  # requests in flight across the update: a few tokens, then held
        c.steps_left = 0
        for i in range(REQUESTS):
            c.engine.add_request(f"r{i}", [1, 2, 3 + i], SamplingParams(max_tokens=40, seed=i))
        c.steps_left = 2
        c.wait(lambda c=c: c.steps_left == 0, SLACK_S)
        assert 0 < len(c.tokens) < REQUESTS * 40
    emb: dict = {}
    embedded = threading.Thread(target=lambda: emb.update(got=receive_broadcast(
        host.address, "emb", 1, timeout_s=OP_TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S + SLACK_S)))
    embedded.start()
    for c in (sg0, sg1):
        c.load(host, 1)

    t0 = time.monotonic()
    res = host.broadcast(1, ["emb", "sg0", "sg1", "ghost"], {"emb": 0, "sg0": 1, "sg1": 2, "ghost": 1})
    elapsed = time.monotonic() - t0

    assert sorted(res.delivered) == ["emb", "sg0", "sg1"], res
    assert res.failed == {"ghost": "did not join"}, res
    assert elapsed < JOIN_TIMEOUT_S + OP_TIMEOUT_S + SLACK_S, elapsed  # the missing cell cost one join wait
    embedded.join(timeout=SLACK_S)
    assert emb["got"].error is None and bitwise_equal(emb["got"].tensors, v1)

    # Ranks in receiver order: sg0 adds one (SGLang), sg1 two (SGLang, its scoring copy).
    store = connect(host.address, timeout_s=OP_TIMEOUT_S)
    specs = {c: get_json(store, f"versions/ug/1/spec/0/{c}")["group"] for c in ("sg0", "sg1")}
    assert [(s["rank_offset"], s["world_size"]) for s in specs.values()] == [(1, 4), (2, 4)]
    assert get_json(store, "versions/ug/1/plan/0")["members"] == ["sg0", "sg1"]

    for c in (sg0, sg1):
        event = c.wait_event(1, SLACK_S)
        assert event["ok"] and event["mode"] == "broadcast", event
        assert c.engine.version == 1 and c.engine.state == "serving"
        assert bitwise_equal(c.fake.weights, v1), c.cell_id  # what SGLang received
        log = c.fake.log
        updates = _update_calls(log)
        assert len(updates) >= 2  # several buckets
        pause = log.index(("pause", "retract"))
        resumed = max(i for i, e in enumerate(log) if e == ("continue",))
        assert pause < updates[0] and updates[-1] < resumed, log
    version, copy = sg1.scorer.loaded[-1]
    assert version == 1 and bitwise_equal(copy, v1)  # the scoring copy verified every bucket

    # The requests in flight went on under version 1: no token lost or doubled, and every
    # token sampled after the update carries it (SGLang's own version spans agree).
    for c in (sg0, sg1):
        c.steps_left = float("inf")
        c.wake()
        c.wait(lambda c=c: not c.engine.has_work(), SLACK_S)
        per_request: dict[str, list] = {}
        for t in c.tokens:
            per_request.setdefault(t.request_id, []).append(t)
        assert len(per_request) == REQUESTS
        for events in per_request.values():
            assert [t.index for t in events] == list(range(len(events)))
            versions = [t.record.version for t in events]
            assert versions == sorted(versions) and versions[0] == 0
        assert any(t.record.version == 1 for t in c.tokens), c.cell_id
        assert c.engine.version_tag_mismatches == 0

    # The cell that missed it catches up point-to-point and installs it in place.
    assert ghost.engine.version == 0 and ghost.fake.weights == {}
    ghost.load(host, 1, mode="fetch")
    event = ghost.wait_event(1, OP_TIMEOUT_S + SLACK_S)
    assert event["ok"] and event["mode"] == "fetch", event
    assert ghost.engine.version == 1 and bitwise_equal(ghost.fake.weights, v1)
    assert _update_calls(ghost.fake.log) == [] and ("update_weights_from_tensor",) in ghost.fake.log


def test_receive_version_runs_on_the_engine_loop_not_the_loader_thread(host, cells):
    v2 = version_tensors(2)
    host.put(2, v2)
    cell = cells("sg", run_loop=False)  # this test drives the engine loop itself
    calls: list[str] = []
    receive = cell.engine.receive_version

    def recording(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return receive(*args, **kwargs)

    cell.engine.receive_version = recording
    out: dict = {}
    publisher = threading.Thread(target=lambda: out.update(res=host.broadcast(2, ["sg"], {"sg": 1})))
    publisher.start()
    cell.load(host, 2)

    deadline = time.monotonic() + JOIN_TIMEOUT_S + SLACK_S
    while not cell.versions.has_staged() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cell.versions.has_staged(), cell.events  # the loader thread got the plan ...
    time.sleep(0.2)
    assert calls == [] and cell.engine.version == 0  # ... and left the engine alone

    engine_loop = threading.Thread(target=cell.versions.activate_staged, args=(cell.engine,), name="engine-loop")
    engine_loop.start()
    engine_loop.join(timeout=OP_TIMEOUT_S + SLACK_S)
    publisher.join(timeout=OP_TIMEOUT_S + SLACK_S)
    assert calls == ["engine-loop"]
    assert out["res"].delivered == ["sg"] and out["res"].failed == {}, out["res"]
    assert cell.engine.version == 2 and bitwise_equal(cell.fake.weights, v2)
    assert cell.wait_event(2, SLACK_S)["ok"]


def test_a_failed_update_is_retried_over_a_fresh_group(host, cells):
    """An engine that fails its first update (before any bucket lands) asks once for a fresh
    group; its peer, whose group broke with it, is served again in the same attempt."""
    v3 = version_tensors(3)
    host.put(3, v3)
    flaky, steady = cells("flaky"), cells("steady")
    flaky.fake.fail["init_weights_update_group"] = "rendezvous refused"
    first = flaky.fake.init_weights_update_group

    def fail_once(**kw):
        r = first(**kw)
        flaky.fake.fail.pop("init_weights_update_group", None)
        return r

    flaky.fake.init_weights_update_group = fail_once
    for c in (flaky, steady):
        c.load(host, 3)
    res = host.broadcast(3, ["flaky", "steady"], {"flaky": 1, "steady": 1})
    assert sorted(res.delivered) == ["flaky", "steady"] and res.failed == {}, res
    assert res.num_attempts == 2
    for c in (flaky, steady):
        event = c.wait_event(3, SLACK_S)
        assert event["ok"] and event["mode"] == "broadcast", (c.cell_id, c.events)
        assert c.engine.version == 3 and bitwise_equal(c.fake.weights, v3)
    failures = [e for e in flaky.events if not e["ok"]]
    assert failures == []  # a retried attempt is not a failed broadcast


def test_a_member_that_never_reaches_the_barrier_costs_one_bounded_wait(host, cells):
    """A cell that said it is ready but whose engine never gets to the update (its loop is
    stuck) never writes `joined`: the trainer calls the attempt off after its join wait,
    before any collective, and the member that did join gets the version on the retry."""
    v4 = version_tensors(4)
    host.put(4, v4)
    stuck, steady = cells("stuck", run_loop=False), cells("steady")
    for c in (stuck, steady):
        c.load(host, 4)
    t0 = time.monotonic()
    res = host.broadcast(4, ["stuck", "steady"], {"stuck": 1, "steady": 1})
    elapsed = time.monotonic() - t0
    assert res.delivered == ["steady"] and list(res.failed) == ["stuck"], res
    assert res.num_attempts == 2
    assert elapsed < JOIN_TIMEOUT_S + 2 * (OP_TIMEOUT_S + 5.0) + SLACK_S, elapsed
    event = steady.wait_event(4, SLACK_S)
    assert event["ok"] and steady.engine.version == 4 and bitwise_equal(steady.fake.weights, v4)
    # The steady cell's first attempt was called off at the barrier: it never formed that group.
    groups = [e for e in steady.fake.log if e[0] == "init_weights_update_group"]
    assert len(groups) == 1 and steady.engine.engine_restarts == 0
    assert stuck.engine.version == 0 and stuck.fake.log.count(("init_weights_update_group",)) == 0
    assert "barrier" in res.failed["stuck"], res
    store = connect(host.address, timeout_s=OP_TIMEOUT_S)
    assert get_json(store, "versions/ug/4/spec/0/steady")["group"]["barrier_s"] == JOIN_TIMEOUT_S
