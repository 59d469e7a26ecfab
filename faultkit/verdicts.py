"""A run's checks: requests settled, invariants I1-I6, restarts that keep the committed state."""

from __future__ import annotations

import json
import signal

from faultkit import checker
from faultkit.celllogs import check_accepted_syncs, commit_fences, read_sync_log
from faultkit.fleet import Fleet
from faultkit.runs import Run
from faultkit.settings import CELLS, HEALTHY_DEADLINE_S, REQUEST_DEADLINE_S, STALL_LOG_LINE


class Verdicts(Fleet):
    """What a run is judged on: every request ended, the invariants over its history and the
    store's snapshots, the state a restart must keep."""

    def stall_count(self) -> int:
        """Requests the scheduler's stall watchdog has taken back so far (its log outlives
        its restarts)."""
        path = self.cluster.tmp / "scheduler.log"
        if not path.exists():
            return 0
        n = 0
        for line in path.read_text(errors="replace").splitlines():
            if STALL_LOG_LINE in line:
                n += int(line.split(" reports ")[1].split()[0])
        return n

    def note_exits(self, run: Run) -> None:
        """Record processes that died on their own: a fault's SIGKILL is expected, a crash
        (an abort, an exception out of main) is not."""
        for name in ["scheduler", *(f"cell-{i}" for i in range(CELLS))]:
            p = self.cluster.procs.get(name)
            if p is None or p.poll() is None or p.returncode == -signal.SIGKILL or (name, p.pid) in self._exits_seen:
                continue
            self._exits_seen.add((name, p.pid))
            text = f"{name} (pid {p.pid}) exited with {p.returncode} on its own"
            run.exits.append(text)
            self.history.info("nemesis", "unexpected_exit", target=name, returncode=p.returncode, run=run.index)
            self.log(f"  {text}")

    def settle(self, run: Run) -> None:
        """Restart what the fault killed, wake what it stopped, let every request end."""
        nem = self.nem
        self.note_exits(run)
        if not nem.alive("scheduler"):
            nem.restart_scheduler()
        dead = {f"cell-{i}": None for i in range(CELLS) if not nem.alive(f"cell-{i}")}
        if dead:
            self.restart(dead)
        for i in range(CELLS):
            if nem.stopped(f"cell-{i}"):
                nem.signal(f"cell-{i}", signal.SIGCONT, "settle")
        ids = [c.stream.request_id for c in run.clients if c.stream.request_id]

        def ended() -> bool:
            s = run.samples[-1]["requests"] if run.samples else {}
            return all(s.get(r, {}).get("state") in checker.TERMINAL for r in ids)

        self.wait(ended, REQUEST_DEADLINE_S, f"requests {ids} ended")
        if run.flips:
            self.flips_done(run.flips, HEALTHY_DEADLINE_S)
        for c in run.clients:
            c.stream.join(10)

    # -- checks -----------------------------------------------------------------------------
    def check(self, run: Run) -> None:
        for c in run.clients:
            s = c.stream
            if s.is_alive():
                self.history.fail(c.ref, "stream still open", request_id=s.request_id, tokens=len(s.tokens))
            elif s.error:
                self.history.fail(c.ref, s.error, request_id=s.request_id, tokens=len(s.tokens))
            else:
                self.history.ok(c.ref, request_id=s.request_id, tokens=len(s.tokens), finish_reason=s.finish_reason)
        sessions = [c.stream.session_id for c in run.clients if c.stream.session_id]
        final = self.snapshot(sessions)
        out: list[str] = []
        token_versions: set[int | None] = set()
        for c in run.clients:
            s = c.stream
            r = final["requests"].get(s.request_id or "")
            rows = None
            expect = None
            if r is not None:
                rows = [(t[1], t[2], t[3], t[4]) for t in final["tokens"].get(r["session"], []) if t[0] >= r["base"]]
                token_versions |= {t[2] for t in rows}
                v = checker.single_version(rows)
                if r["state"] == "finished" and v is not None and v in self.complete:
                    expect = self.reference(v, s)
            client = {"request_id": s.request_id, "session_id": s.session_id, "max_tokens": s.max_tokens,
                      "tokens": list(s.tokens), "finish_reason": s.finish_reason, "error": s.error}
            vio, lost = checker.check_request(client, r, rows, expect)
            if s.session_id:  # what the client received against what the trainer is handed
                resp = self.http.get(f"/v1/sessions/{s.session_id}")
                vio += checker.check_client_vs_trainer(list(s.prompt), list(s.tokens), bool(s.finish_reason),
                                                       resp.json() if resp.status_code == 200 else None,
                                                       s.request_id or s.session_id)
            if s.replay_mismatch:
                vio.append(f"I1: the client of {s.request_id} was replayed other tokens than it first got "
                           f"({s.replay_mismatch})")
            failed = r is not None and r["state"] == "failed"
            run.failed += failed
            run.stream_errors += bool(s.error)
            run.reconnects += s.reconnects
            out += vio
            run.lost += bool(lost or failed or s.error)  # what a client feels: no answer, or an error one
        outcomes = []
        if self.mig_log.exists():
            with open(self.mig_log, "rb") as f:
                f.seek(run.mig_log_offset)
                for line in f.read().decode(errors="replace").splitlines():
                    try:
                        outcomes.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        for o in outcomes:
            self.history.info("cell", "migration_outcome", run=run.index,
                              **{k: o.get(k) for k in ("cell", "role", "result", "migration_id", "request_id", "reason")})
        out += checker.check_migration_outcomes(outcomes, final["migrations"])
        out += check_accepted_syncs(read_sync_log(self.sync_log, run.sync_log_offset), commit_fences(outcomes))
        out += checker.check_token_epochs(final["requests"], final["migrations"], final.get("token_epochs", {}))
        with self._lock:
            served = set(self.served)
        once = checker.check_fenced_commits(final) + checker.check_foreign_batches(final.get("foreign_batches", []))
        once += checker.check_versions(served, token_versions, self.complete, self.partial)
        out += [v for v in once if v not in self._seen_once]  # store-wide checks: report each once
        self._seen_once.update(once)
        for v in out:
            if v not in run.violations:
                run.violations.append(v)
                self.history.info("checker", "violation", text=v, run=run.index)

    def check_restart(self, run: Run, before: dict) -> None:
        """I5: what the restarted scheduler serves extends what the killed one committed."""
        fl = self.http.get("/v1/flips").json()
        fl = fl["flips"] if isinstance(fl, dict) else fl
        flips = {f["id"]: f["state"] for f in fl}
        for fid in set(before["flips"]) - set(flips):  # past the list's window (newest 100)
            r = self.http.get(f"/v1/flips/{fid}")
            if r.status_code == 200:
                flips[fid] = r.json()["state"]
        after = {"flips": flips,
                 "versions": {v["version"]: v["state"] for v in self.http.get("/v1/versions").json()["versions"]},
                 "generations": {c["id"]: c["generation"] for c in self.cluster.cells()},
                 "sessions": {sid: self.http.get(f"/v1/sessions/{sid}").json()["token_ids"]
                              for sid in before["sessions"]},
                 "requests": self.snapshot()["requests"]}  # what the restarted scheduler's recovery wrote
        vio = checker.check_restart(before, after)
        self.history.info("checker", "restart", run=run.index, flips=len(before["flips"]),
                          sessions=len(before["sessions"]), requests=len(before["requests"]), violations=vio)
        for v in vio:
            if v not in run.violations:
                run.violations.append(v)
                self.history.info("checker", "violation", text=v, run=run.index)

    def committed_state(self, run: Run) -> dict:
        """The store as a dead scheduler left it (for I5)."""
        sids = [c.stream.session_id for c in run.clients if c.stream.session_id]
        s = self.snapshot(sids)
        newest = sorted(s["flip_rows"], key=lambda f: s["flip_rows"][f]["created_at"])[-100:]
        flips = {f: st for f, st in s["flips"].items() if f in newest or st in ("pending", "draining", "loading")}
        return {"flips": flips, "versions": s["versions"],
                "generations": {c: v["generation"] for c, v in s["cells"].items()},
                "sessions": {sid: [t[1] for t in rows] for sid, rows in s.get("tokens", {}).items()},
                "requests": s["requests"]}
