"""A real Ray head on 127.0.0.1 for the module (started and stopped here), or a clean skip
where Ray is not installed."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cells.localcluster import find_free_port

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
"""Ray resolves 127.0.0.1 to the machine's outward address unless told it is not a
multi-machine cluster: the test's head, its actors and the cells' transfers stay on loopback."""


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _descendants(pgid: int) -> set[int]:
    """Processes of the head's process group and everything they started (the workers run in
    process groups of their own)."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                procs[int(entry)] = (int(fields[1]), int(fields[2]))  # ppid, pgid
            except (OSError, IndexError, ValueError):
                continue
    found = {pid for pid, (_, pg) in procs.items() if pg == pgid}
    grew = True
    while grew:
        new = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        found |= new
        grew = bool(new)
    return found


class RayHead:
    def __init__(self, num_cpus: int = 8) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="cfray", dir="/tmp"))  # short: Ray's socket paths
        self.port = find_free_port()
        self.address = f"127.0.0.1:{self.port}"
        ports = [find_free_port() for _ in range(3)]
        args = [_ray_bin(), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={self.port}",
                f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
                f"--temp-dir={self.tmp}", f"--dashboard-agent-listen-port={ports[0]}",
                f"--dashboard-agent-grpc-port={ports[1]}", f"--runtime-env-agent-port={ports[2]}"]
        self.env = {**os.environ, **RAY_ENV}
        for key in ("RAY_ADDRESS", "CELLFLIP_API_TOKEN"):
            self.env.pop(key, None)
        self.starter = subprocess.Popen(args, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, text=True)
        self.pgid = self.starter.pid  # the head's processes stay in the starter's group
        out, _ = self.starter.communicate(timeout=120)
        if self.starter.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed:\n{out[-3000:]}")

    def processes(self) -> set[int]:
        return _descendants(self.pgid)

    def stop(self, grace_s: float = 3.0) -> set[int]:
        """SIGTERM the head's processes, SIGKILL what remains (the GCS server does not stop on
        SIGTERM within seconds); returns what had to be killed."""
        pids = self.processes()
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and (pids := {p for p in pids if is_alive(p)}):
            time.sleep(0.2)
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_head(attempts: int = 2) -> RayHead:
    """Ray's own start-up gives up after about 30 s when its control store answers slowly (a
    loaded 2-core machine): one fresh attempt (new ports, new temp dir; the failed head's
    processes already stopped) before the failure stands."""
    for i in range(attempts):
        try:
            return RayHead()
        except RuntimeError as e:
            if i + 1 == attempts or "timed out during startup" not in str(e):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def ray_head():
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)  # this process is a Ray driver too; Ray reads these at import
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'cellflip[ray]')")
    head = _start_head()
    try:
        yield head
    finally:
        head.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
