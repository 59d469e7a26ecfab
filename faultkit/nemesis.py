"""The nemesis: fault actions on a local cluster's real processes, each recorded in the history.

- failpoints per process: a cell (or the scheduler) is (re)started with `CELLFLIP_FAILPOINTS`
  (scheduler/contract/failpoints.py: raise / kill / stop / sleep:S / block, `N*` for the N-th hit only);
- signals: SIGKILL (a crash), SIGSTOP then SIGCONT (a stall past the lease: a zombie);
- restarts: a killed cell comes back as a new incarnation, a killed scheduler on the same store;
- the trainer: a separate process that holds one weight version and broadcasts it, so that it
  can die mid-broadcast (`python -m faultkit.nemesis trainer ...`);
- a partition: the `block` action holds the thread at `migrate.transfer`, so no bytes flow
  until the peer's real timeout path fires.

A fault counts as fired only when it demonstrably happened: a process that died by SIGKILL, a
process seen stopped, a failpoint's message in its process's log, a signal delivered.
Every process is started and signalled here by its own handle; nothing is killed by name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cells.localcluster import Cluster
from faultkit.history import History

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def failpoint_env(spec: dict[str, str] | None) -> dict[str, str]:
    """{"migrate.before_commit": "1*kill"} → the environment that arms it."""
    return {"CELLFLIP_FAILPOINTS": ";".join(f"{k}={v}" for k, v in spec.items())} if spec else {}


def version_weights(cfg: dict, version: int):
    """The weights of `version`: version 0 is what cells boot with; every later one is a fixed
    perturbation of it, a pure function of the version (the trainer process and the checker's
    reference engines compute the same tensors)."""
    import torch

    from cells.engine.embedded.model import init_weights
    from cells.engine.embedded.model_spec import resolve_spec
    from scheduler.contract.config import parse_config

    ecfg = parse_config(cfg).cells.engine
    w = init_weights(resolve_spec(ecfg.model), ecfg.model.seed)
    if version == 0:
        return w
    g = torch.Generator().manual_seed(10_000 + version)
    return {k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in w.items()}


def proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid` (R, S, T = stopped, Z, ...), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[0]


class Nemesis:
    def __init__(self, cluster: Cluster, history: History) -> None:
        self.c = cluster
        self.h = history
        self.armed: dict[str, dict[str, str]] = {}
        """process name → failpoints it was started with (until it is restarted plain)."""
        self.scheduler_env: dict[str, str] = {}
        """Extra environment every scheduler start gets (the canary switch)."""
        self.trainers: list[subprocess.Popen] = []

    # -- observation ------------------------------------------------------------------------
    def proc(self, name: str) -> subprocess.Popen:
        return self.c.procs[name]

    def alive(self, name: str) -> bool:
        p = self.c.procs.get(name)
        return p is not None and p.poll() is None

    def killed(self, name: str) -> bool:
        """Died by SIGKILL (a failpoint `kill`, or ours)."""
        p = self.c.procs.get(name)
        return p is not None and p.poll() == -signal.SIGKILL

    def stopped(self, name: str) -> bool:
        p = self.c.procs.get(name)
        return p is not None and p.poll() is None and proc_state(p.pid) == "T"

    def log_size(self, name: str) -> int:
        f = self.c.tmp / f"{name}.log"
        return f.stat().st_size if f.exists() else 0

    def log_has(self, name: str, offset: int, needle: str) -> bool:
        f = self.c.tmp / f"{name}.log"
        if not f.exists():
            return False
        with open(f, "rb") as fh:
            fh.seek(offset)
            return needle.encode() in fh.read()

    # -- signals ----------------------------------------------------------------------------
    def signal(self, name: str, sig: int, why: str = "") -> bool:
        """Deliver `sig` to a live process; True if delivered (recorded as fired)."""
        p = self.c.procs.get(name)
        if p is None or p.poll() is not None:
            return False
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait(timeout=10)
        self.h.info("nemesis", "signal", target=name, signal=signal.Signals(sig).name, why=why)
        return True

    # -- restarts ---------------------------------------------------------------------------
    def restart_cells(self, plan: dict[int, dict[str, str] | None], timeout_s: float = 60) -> None:
        """(Re)start cells {index: failpoints or None} at once (a live one is SIGKILLed first)
        and wait until each new incarnation serves rollouts."""
        old = {}
        for i, fps in plan.items():
            name = f"cell-{i}"
            try:
                old[i] = self.c.cell(name).get("incarnation")
            except Exception:
                old[i] = None
            p = self.c.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(timeout=10)
            self.c.cell_env[i] = failpoint_env(fps)
            self.c.start_cell(i)
            if fps:
                self.armed[name] = dict(fps)
            else:
                self.armed.pop(name, None)
            self.h.info("nemesis", "restart", target=name, failpoints=fps or {})

        def up() -> bool:
            for i in plan:
                if not self.alive(f"cell-{i}"):
                    raise RuntimeError(f"cell-{i} exited at start:\n{self.c.logs()[-3000:]}")
                c = self.c.cell(f"cell-{i}")
                if c.get("incarnation") == old[i] or c.get("state") != "rollout":
                    return False
            return True

        self.c.wait(up, timeout_s, f"cells {sorted(plan)} restarted")

    def restart_scheduler(self, failpoints: dict[str, str] | None = None, kill: bool = True,
                          wait_ready: bool = True, timeout_s: float = 30) -> None:
        """Start the scheduler (SIGKILLing a live one first when `kill`) on the same store;
        `wait_ready`: until it rebuilt its inventory (every known cell re-synced, or the
        grace ran out)."""
        if self.alive("scheduler"):
            if not kill:
                return
            self.signal("scheduler", signal.SIGKILL, "restart")
        env = {**self.scheduler_env, **failpoint_env(failpoints)}
        self.c.start_scheduler(env)
        if failpoints:
            self.armed["scheduler"] = dict(failpoints)
        else:
            self.armed.pop("scheduler", None)
        self.h.info("nemesis", "restart", target="scheduler", failpoints=failpoints or {},
                    canary=bool(self.scheduler_env))
        if wait_ready:
            self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 30) -> None:
        self.c.wait(lambda: self.c.http.get("/healthz", timeout=2).json().get("ready"), timeout_s, "scheduler ready")

    # -- the trainer ------------------------------------------------------------------------
    def start_trainer(self, version: int, failpoints: dict[str, str] | None, bucket_bytes: int,
                      timeout_s: float) -> subprocess.Popen:
        """A trainer process that holds `version`, publishes it and broadcasts it."""
        log = open(self.c.tmp / "trainer.log", "a")  # noqa: SIM115 (the child owns it)
        env = {**self.c.env, **failpoint_env(failpoints),  # the trainer's token, no other
               **{k: v for k, v in self.c.scoped_env("trainer").items() if v is not None}}
        # faultkit is not an installed package: the child finds it from the repository root
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
        p = subprocess.Popen([sys.executable, "-m", "faultkit.nemesis", "trainer", "--scheduler", self.c.url,
                              "--config", str(self.c.cfg_path), "--version", str(version),
                              "--bucket-bytes", str(bucket_bytes), "--timeout", str(timeout_s)],
                             env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        self.trainers.append(p)
        self.h.info("nemesis", "trainer", version=version, failpoints=failpoints or {}, pid=p.pid)
        return p

    def go_trainer(self, p: subprocess.Popen, timeout_s: float = 60) -> None:
        """Wait until the trainer holds its version, then let it publish and broadcast."""
        log = self.c.tmp / "trainer.log"
        self.c.wait(lambda: p.poll() is not None or f'"ready": {p.pid}' in log.read_text(), timeout_s, "trainer ready")
        if p.poll() is None:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()

    def stop_trainers(self) -> None:
        for p in self.trainers:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        self.trainers.clear()


def _trainer_main(args: argparse.Namespace) -> int:
    """A minimal trainer: hold one version, publish it, broadcast it, then keep serving it."""
    import httpx
    import yaml

    from cells.transport.versions_host import VersionHost
    from scheduler.contract.tokens import SCOPE_ENV, auth_headers

    cfg = yaml.safe_load(Path(args.config).read_text())
    # One bucket per op: `broadcast.mid_bucket` then stops the trainer between two ops.
    host = VersionHost(bucket_bytes=args.bucket_bytes, timeout_s=args.timeout, join_timeout_s=args.timeout,
                       op_bytes=args.bucket_bytes)
    host.start()
    host.put(args.version, version_weights(cfg, args.version))
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.readline()  # the campaign says when (its clients are decoding by then)
    a = host.address
    auth = auth_headers(os.environ.get(SCOPE_ENV["trainer"]))
    httpx.put(f"{args.scheduler}/v1/trainer/version-host", json={"host": a.host, "port": a.port}, headers=auth,
              timeout=30).raise_for_status()
    r = httpx.post(f"{args.scheduler}/v1/versions", json={"version": args.version,
                                                          "source": {"host": a.host, "port": a.port}},
                   headers=auth, timeout=30)
    print(json.dumps({"published": r.status_code, "body": r.json()}), flush=True)
    if r.status_code != 201:
        return 1
    res = host.broadcast(args.version, r.json()["receivers"])
    print(json.dumps({"delivered": res.delivered, "failed": res.failed}), flush=True)
    time.sleep(args.serve_s)  # cells that missed it catch up from here
    host.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m faultkit.nemesis")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("trainer", help="hold, publish and broadcast one weight version")
    tr.add_argument("--scheduler", required=True)
    tr.add_argument("--config", required=True)
    tr.add_argument("--version", type=int, required=True)
    tr.add_argument("--bucket-bytes", type=int, default=256 << 10)
    tr.add_argument("--timeout", type=float, default=10.0)
    tr.add_argument("--serve-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    return _trainer_main(args)


if __name__ == "__main__":
    sys.exit(main())
