"""Faults of a cell's other roles: a training rank, and a rogue cell that lies."""

from __future__ import annotations

import random
import time

from faultkit.nemesis import version_weights
from faultkit.runs import Run
from faultkit.scenarios.common import _names
from faultkit.settings import TRANSFER_TIMEOUT_S
from faultkit.verdicts import Verdicts


def _training_batch(spec, seed: int) -> list[dict]:
    """Synthetic finished trajectories over the model's output ids (4 groups of 3, exact old
    log-probs): what a training step consumes."""
    rng = random.Random(seed)
    ids = spec.output_ids() or list(range(spec.vocab_size))
    out = []
    for g in range(4):
        prompt = [rng.choice(ids) for _ in range(rng.randrange(4, 12))]
        for i in range(3):
            toks = prompt + [rng.choice(ids) for _ in range(rng.randrange(3, 16))]
            m = [j >= len(prompt) for j in range(len(toks))]
            out.append({"id": f"t{seed}-{g}-{i}", "reward": float(rng.random() < 0.5) + 0.1 * i, "group_id": f"g{g}",
                        "segment_starts": [0], "token_ids": toks, "loss_mask": [int(x) for x in m],
                        "logprobs": [-2.0 if x else None for x in m], "versions": [0 if x else None for x in m],
                        "old_logprobs": [-2.0 if x else None for x in m],
                        "provenance": ["exact" if x else None for x in m]})
    return out


def scn_training_rank_fault(camp: Verdicts, run: Run, k: int) -> None:
    """A training cell dies (SIGKILL) or stalls (SIGSTOP) in the middle of an update: the step
    is redone by the other training cell from the start-of-update state it restored (the
    coordinator holds none; the state it reads back is a cell's checkpoint). Checked:
    the parameters equal a fault-free update of the same batch (max over tensors of
    ||a - b|| / ||a - theta_0|| <= 1e-3), one version number is taken, and only after the redo."""
    from cells.engine.embedded.checkpoint import save_checkpoint
    from cells.engine.embedded.model_spec import resolve_spec
    from cells.rl.learner import Learner
    from cells.rl.objectives import ObjectiveConfig
    from cells.training import protocol as P
    from cells.training import state_files
    from cells.training.coordinator import TrainingCoordinator
    from cells.training.wire import params_view
    from scheduler.contract.config import parse_config

    variant = ["kill", "stop"][k % 2]
    victim, other, _ = _names(run.rng)
    run.params.update(variant=variant, victim=victim, other=other)
    camp.restart({victim: {"training.after_minibatch": f"1*{variant}"}})
    v = camp.next_version  # a version command tells every cell where the coordinator's store is
    camp.next_version += 1
    camp.publish(v).join(60)
    camp.flip_all(run, [(victim, "training"), (other, "training")])
    camp.start_clients(run, 3)  # rollouts go on on the third cell throughout
    spec = resolve_spec(parse_config(camp.cfg).cells.engine.model)
    batch = _training_batch(spec, run.seed)
    # the guard off: this checks the redo of a kept update (a rejected one takes no number)
    clean = Learner(spec, camp.weights[v], lr=2e-3, minibatches=2, objective=ObjectiveConfig(max_update_kl=None))
    start = save_checkpoint(camp.workdir / f"start-{run.seed}", spec, camp.weights[v])  # the ranks build from it
    clean_before = {n: t.clone() for n, t in camp.weights[v].items()}
    clean.rl_step(batch)
    taken: list[int] = []
    coord = TrainingCoordinator(P.hyper(clean), P.skeleton(clean)["params"], camp.host.address,
                                start={"kind": "path", "path": str(start)}, timeout_s=TRANSFER_TIMEOUT_S + 2,
                                ack_timeout_s=15, emit=lambda rec: camp.history.info("trainer", rec.get("event", "train"), **{
                                    k2: v2 for k2, v2 in rec.items() if k2 != "event" and isinstance(v2, (int, float, str))}))
    coord.lr = 2e-3
    m = coord.update(batch, [victim, other], next_version=lambda: taken.append(coord.version + 1) or coord.version + 1)
    gone = camp.nem.killed(victim) if variant == "kill" else camp.nem.stopped(victim)
    if gone and m["attempts"] >= 2:
        camp.fault(run, "SIGKILL" if variant == "kill" else "SIGSTOP", victim,
                   failpoint="training.after_minibatch", attempts=m["attempts"], cells_lost=m["cells_lost"])
    else:
        run.notes.append(f"training fault on {victim} did not disturb the step: {gone}, attempts {m['attempts']}")
    path = camp.workdir / f"state-{run.seed}"
    done = coord.checkpoint_done(coord.checkpoint(str(path)), str(path), 60)  # the state, from the cell holding it
    meta, flat, _ = state_files.load_packed(path) if done.get("ok") else ({"entries": []}, None, None)
    after = params_view(meta, flat) if flat is not None else {}
    diff = 0.0 if after else float("inf")
    for name, p in clean.params.items():
        den = float((p.detach() - clean_before[name]).norm())
        if den > 0 and name in after:
            diff = max(diff, float((p.detach() - after[name]).norm()) / den)
    run.params.update(param_rel_diff=diff, attempts=m["attempts"], restored=m["join_cells"] == 0)
    if diff > 1e-3:
        run.violations.append(f"training: the update after the fault differs from the fault-free one ({diff:.2e})")
    if len(taken) != 1:
        run.violations.append(f"training: version numbers taken {taken} (a partial update was committed)")
    camp.restart({victim: None})
    camp.flip_all(run, [(other, "rollout")])


def scn_rogue_cell(camp: Verdicts, run: Run, k: int) -> None:
    """A process holding the cell token plays a cell (faultkit/rogue.py): one whose probe no model
    gives is refused at registration; one that holds the model and then reports an
    out-of-vocabulary token, a -inf log-prob or log-probs that are not its tokens' is quarantined
    (at its sync, or when a verified cell's exact scoring contradicts it). Nothing it sampled is
    ever handed out for training, and the fleet serves throughout (the run's clients)."""
    from cells.agent.cell import probe_answer
    from cells.engine.embedded import EmbeddedEngine
    from faultkit.rogue import MODES, RogueCell
    from scheduler.contract.config import parse_config

    mode = MODES[k % len(MODES)]
    run.params["mode"] = mode
    eng_cfg = parse_config(camp.cfg).cells.engine
    boot = EmbeddedEngine(eng_cfg)  # what a fresh cell process holds: version 0's weights
    v = camp.target
    serve = EmbeddedEngine(eng_cfg, weights=camp.weights.setdefault(v, version_weights(camp.cfg, v)), version=v) \
        if v else boot
    name = f"rogue-{run.index}"
    rogue = RogueCell(camp.cluster.url, camp.cluster.tokens["cell"], name, mode, serve,
                      probe_answer(boot, boot.version), boot.version, v, boot.capabilities.vocab_size)
    rogue.start()
    camp.start_clients(run, 3)
    if mode == "bad_probe":
        rogue.join(30)
        code, body = rogue.register_answer or (None, {})
        if code == 409 and body.get("reason") == "probe_mismatch":
            camp.fault(run, "probe_refused", name)
        else:
            run.violations.append(f"rogue: a cell answering the probe wrongly registered ({code}: {body})")
        return
    # more clients until one request lands on the rogue (it is verified: it holds the model)
    deadline = time.monotonic() + 60
    while not rogue.given and time.monotonic() < deadline and not rogue.fenced.is_set():
        camp.start_clients(run, 1, min_tokens=0)
        time.sleep(0.5)
    if not camp.await_fault(run, lambda: _trust_of(camp, name) == "quarantined", 90, "quarantined", name,
                            given=len(rogue.given)):
        run.violations.append(f"rogue: {mode} was not quarantined (given {len(rogue.given)} requests)")
    rogue.stop.set()
    rogue.join(10)
    untrusted = _untrusted_sessions(camp, name)
    if untrusted:
        run.violations.append(f"rogue: sessions holding tokens {name} sampled are not kept from training: {untrusted}")


def _trust_of(camp: Verdicts, cell_id: str) -> str | None:
    with camp._conn_lock:
        r = camp._conn2.execute("SELECT trust FROM cells WHERE id = ?", (cell_id,)).fetchone()
    return r[0] if r else None


def _untrusted_sessions(camp: Verdicts, cell_id: str) -> list[str]:
    """Sessions holding tokens `cell_id` sampled that are not marked never to be trained."""
    with camp._conn_lock:
        rows = camp._conn2.execute("SELECT DISTINCT t.session_id FROM token_chunks t JOIN sessions s ON s.id = t.session_id"
                                   " WHERE t.cell = ? AND s.tainted = 0", (cell_id,)).fetchall()
    return [r[0] for r in rows]
