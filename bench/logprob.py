"""The per-cell log-prob service over a run of several weight versions.

Two rollout cells (batch-invariant) decode a stream of requests while the bench, playing the
trainer with a version host, publishes VERSIONS new versions at a fixed period; the
service scores every sampled token with the weights of the version it was sampled under.
Fields:
- versions, tokens: versions published, sampled tokens in the run.
- exact_frac: sampled tokens with provenance `exact` / sampled tokens, as the store reports
  (GET /v1/sessions/{id}).
- verified_tokens: a random sample of at least 1% of the tokens re-scored here with the
  engine's scoring primitive and that version's weights; every one must match bitwise
  (`verified_mismatches` counts those that did not).
- decode_match_frac, decode_match_tokens: every exact old log-prob checked against the
  log-prob the client received when the token was sampled (the sampler's, an independent path
  from the scorer's), bitwise; decode_match_tokens / exact tokens is `decode_compared_frac`.
  The cells run with `inflight_policy: recompute` (`inflight_policy` in the JSON): a request
  running across a version switch is re-prefilled under the new weights, so every token was
  sampled from exactly the policy its old log-prob scores, and every one is compared. Under
  `keep_kv` (`--inflight-policy keep_kv`) the decode after a switch attends to KV of the older
  version and legitimately differs from the scorer's: only tokens before a request's first
  switch are compared then.
- version_lifetime_s: mean time a version was the active one (active → retiring).
- sync_pass_s: mean final pass: from a cell switching off a version to it dropping that
  version (every token of it scored), over cells and versions (the scheduler's record).
- final_pass_fraction = sync_pass_s / version_lifetime_s.
- snapshot_s: the `snapshot` strategy (score later from the trainer's copy) is not built;
  null.
- scoring_cost_ratio: scoring seconds per scored token (measured on the cells) / decoding
  cell-seconds per sampled token (rollout wall time × rollout cells / tokens), as measured.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import torch
from common import finish, parse_args, set_threads

from cells.engine.embedded import EmbeddedEngine
from cells.engine.embedded.model import init_weights
from cells.engine.embedded.model_spec import resolve_spec
from cells.localcluster import Cluster, Streamer, cluster_config
from cells.transport.versions_host import VersionHost
from scheduler.contract.config import parse_config


def _weights(cfg: dict, n: int) -> dict[int, dict[str, torch.Tensor]]:
    ecfg = parse_config(cfg).cells.engine
    w = init_weights(resolve_spec(ecfg.model), ecfg.model.seed)
    out, g = {0: w}, torch.Generator().manual_seed(7)
    for v in range(1, n + 1):
        w = {k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in w.items()}
        out[v] = w
    return out


def decode_matches(streams: list[Streamer], sessions: dict[str, dict], policy: str) -> tuple[int, int]:
    """(bitwise matches, compared): exact old log-probs against the log-probs each client
    received at decode time; under `keep_kv`, over tokens whose request ran under one version
    until then."""
    match = compared = 0
    for st in streams:
        s = sessions.get(st.session_id or "")
        if s is None:
            continue
        sampled = [i for i, m in enumerate(s["loss_mask"]) if m]
        if len(st.logprobs) != len(sampled):
            raise AssertionError(f"session {st.session_id}: {len(st.logprobs)} decode log-probs for {len(sampled)} tokens")
        first = s["versions"][sampled[0]] if sampled else None
        for lp, i in zip(st.logprobs, sampled):
            if policy == "keep_kv" and s["versions"][i] != first:
                break  # the request switched version: later tokens decoded over older KV
            if s["provenance"][i] == "exact":
                compared += 1
                match += float(lp) == s["old_logprobs"][i]
    return match, compared


def main() -> None:
    args = parse_args(__doc__, extra=lambda ap: ap.add_argument(
        "--inflight-policy", choices=("recompute", "keep_kv"), default="recompute",
        help="what a cell does with running requests at a version switch (recompute: every token comparable)"))
    set_threads(1)
    n_versions, period_s, max_tokens, n_streams = (3, 8.0, 160, 4) if args.quick else (4, 15.0, 300, 6)
    tmp = Path(tempfile.mkdtemp(prefix="cellflip-logprob-"))
    cfg = cluster_config(tmp, scheduler__lease_s=10.0, versions__score_batch_tokens=64,
                         versions__score_interval_s=0.1, versions__inflight_policy=args.inflight_policy)
    weights = _weights(cfg, n_versions)
    c = Cluster(tmp, num_cells=2, cfg=cfg, ready_timeout_s=300)
    host = VersionHost()
    host.start()
    rng = random.Random(0)
    streams: list[Streamer] = []
    try:
        t0 = time.monotonic()

        def top_up() -> None:
            live = [s for s in streams if s.is_alive()]
            for _ in range(n_streams - len(live)):
                s = Streamer(c.url, [rng.randrange(1024) for _ in range(rng.randrange(40, 200))], max_tokens,
                             seed=len(streams), timeout_s=600, token=c.agent_token)
                s.start()
                streams.append(s)

        for v in range(1, n_versions + 1):
            deadline = time.monotonic() + period_s
            while time.monotonic() < deadline:
                top_up()
                time.sleep(0.2)
            host.put(v, weights[v])
            a = host.address
            c.http.put("/v1/trainer/version-host", json={"host": a.host, "port": a.port}).raise_for_status()
            r = c.http.post("/v1/versions", json={"version": v, "source": {"host": a.host, "port": a.port}})
            r.raise_for_status()
            host.broadcast(v, r.json()["receivers"])
        deadline = time.monotonic() + period_s  # the last version lives a period too
        while time.monotonic() < deadline:
            top_up()
            time.sleep(0.2)
        for s in streams:
            s.join(600)
        rollout_s = time.monotonic() - t0
        sessions = {s.session_id: c.session(s.session_id) for s in streams if s.session_id}

        def unscored() -> int:
            for sid in sessions:
                sessions[sid] = c.session(sid)
            return sum(1 for s in sessions.values() for m, p in zip(s["loss_mask"], s["provenance"]) if m and p is None)

        c.wait(lambda: unscored() == 0, 300, "every token scored", every=1.0)
        # one more version retires the last trained-on one as well
        listing = c.http.get("/v1/versions").json()
        sampled = [(sid, i) for sid, s in sessions.items() for i, m in enumerate(s["loss_mask"]) if m]
        exact = sum(1 for sid, i in sampled if sessions[sid]["provenance"][i] == "exact")
        # verification: at least 1% of the tokens, re-scored here with that version's weights
        ecfg = parse_config(cfg).cells.engine
        engines = {v: EmbeddedEngine(ecfg, weights=w, version=v) for v, w in weights.items()}
        pick = random.Random(1).sample(sampled, max(1, len(sampled) // 50))
        mismatches = wrong_caught = 0
        for sid, i in pick:
            s = sessions[sid]
            v = s["versions"][i]
            lp = engines[v].score(s["token_ids"][: i + 1])
            mismatches += float(lp[i - 1]) != s["old_logprobs"][i]
            # the negative control: the same check against another version's weights must fail
            wrong = engines[v % n_versions + 1].score(s["token_ids"][: i + 1])
            wrong_caught += float(wrong[i - 1]) != s["old_logprobs"][i]
        match, compared = decode_matches(streams, sessions, args.inflight_policy)
        vers = listing["versions"]
        lifetimes = [v["lifetime_s"] for v in vers if v["lifetime_s"] is not None]
        passes = [v["final_pass_s"] for v in vers if v["final_pass_s"] is not None]
        life = sum(lifetimes) / len(lifetimes) if lifetimes else None
        sync = sum(passes) / len(passes) if passes else None
        scoring = listing["scoring"]
        score_per_tok = scoring["seconds"] / scoring["tokens"] if scoring["tokens"] else None
        decode_per_tok = rollout_s * 2 / len(sampled)
        result = {
            "versions": n_versions, "inflight_policy": args.inflight_policy, "tokens": len(sampled),
            "exact_frac": round(exact / len(sampled), 6), "verified_tokens": len(pick),
            "verified_mismatches": mismatches,
            "wrong_weights_caught_frac": round(wrong_caught / len(pick), 4),
            "decode_match_frac": round(match / compared, 6) if compared else None,
            "decode_match_tokens": compared,
            "decode_compared_frac": round(compared / exact, 4) if exact else None,
            "version_lifetime_s": round(life, 3) if life else None,
            "sync_pass_s": round(sync, 3) if sync is not None else None,
            "final_pass_fraction": round(sync / life, 4) if life and sync is not None else None,
            "snapshot_s": None,
            "scoring_cost_ratio": round(score_per_tok / decode_per_tok, 4) if score_per_tok else None,
            "retired": [v["version"] for v in vers if v["state"] == "retired"],
        }
    finally:
        host.close()
        c.stop()
    if not args.json:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    finish(result, args, "logprob")


if __name__ == "__main__":
    main()
