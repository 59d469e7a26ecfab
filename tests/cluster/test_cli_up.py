"""`cellflip up`: scheduler + cells come up, the API answers, Ctrl-C stops every process."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from cells.localcluster import ROOT, SMALL_MODEL, Cluster, find_free_port
from scheduler.contract.tokens import SCOPE_ENV

pytestmark = pytest.mark.slow


def _ignore_sigint():
    """What a shell does to a job it starts in the background."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_up_serves_the_api_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = find_free_port()
    cfg = {"scheduler": {"db_path": str(tmp_path / "db.sqlite"), "port": port},
           "cells": {"count": 2, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 64}}}
    (tmp_path / "up.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in SCOPE_ENV.values():  # a newcomer's shell: the tokens are generated on first start
        env.pop(var, None)
    # its own process group, so a failing test can take every process it started down with it
    proc = subprocess.Popen([sys.executable, "-m", "cells.cli", "up", "--config", str(tmp_path / "up.yaml")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_ignore_sigint)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any("Ctrl-C stops everything" in ln for ln in lines) and time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
            assert lines[-1] or proc.poll() is None, f"cellflip up exited early: {lines}"
        out = "".join(lines)
        assert "starting the scheduler" in out and "cells in rollout: 2/2" in out, out
        assert f"http://127.0.0.1:{port}" in out
        token_file = tmp_path / "api.token"
        assert f"API token (admin) in {token_file}" in out
        auth = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/cells").status_code == 401
        agent = {"Authorization": f"Bearer {(tmp_path / 'agent.token').read_text().strip()}"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/cells", headers=agent).status_code == 403
        cells = httpx.get(f"http://127.0.0.1:{port}/v1/cells", headers=auth).json()["cells"]
        assert sorted(c["id"] for c in cells) == ["cell-0", "cell-1"] and all(c["state"] == "rollout" for c in cells)
        cli = [sys.executable, "-m", "cells.cli", "status", "--scheduler", f"http://127.0.0.1:{port}"]
        status = subprocess.run(cli + ["--config", str(tmp_path / "up.yaml")], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "cell-1" in status.stdout and "rollout" in status.stdout
        (tmp_path / "wrong.token").write_text("wrong\n")
        refused = subprocess.run(cli + ["--token-file", str(tmp_path / "wrong.token")], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "401" in refused.stderr
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
        # tokens made and revoked from the command line, with the admin token beside the store
        tok = [sys.executable, "-m", "cells.cli", "token"]
        where = ["--scheduler", f"http://127.0.0.1:{port}", "--config", str(tmp_path / "up.yaml")]
        made = subprocess.run(tok + ["create", "--scope", "trainer", "--name", "ci", *where], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        new = {"Authorization": f"Bearer {made.stdout.strip()}"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/cells", headers=new).status_code == 200
        tid = made.stderr.split()[1]
        listed = subprocess.run(tok + ["list", *where], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=60)
        assert tid in listed.stdout and made.stdout.strip() not in listed.stdout
        gone = subprocess.run(tok + ["revoke", tid, *where], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert gone.returncode == 0, gone.stderr
        assert httpx.get(f"http://127.0.0.1:{port}/v1/cells", headers=new).status_code == 401
        not_admin = subprocess.run(tok + ["create", "--scope", "admin", *where, "--token-file",
                                          str(tmp_path / "trainer.token")], cwd=tmp_path, env=env,
                                   capture_output=True, text=True, timeout=60)
        assert not_admin.returncode != 0 and "403" in not_admin.stderr
        proc.send_signal(signal.SIGINT)  # inherited as ignored: cellflip up stops on it all the same
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the cells and scheduler, if `up` left any


def test_cluster_stop_is_a_clean_sigterm_shutdown(tmp_path):
    """The scheduler (with cells long-polling it) and the cells end on SIGTERM by themselves:
    nothing is left for the SIGKILL after the grace."""
    cfg = {"scheduler": {"db_path": str(tmp_path / "db.sqlite")},
           "cells": {"count": 1, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 64}}}
    c = Cluster(tmp_path, num_cells=1, cfg=cfg)
    procs = dict(c.procs)
    try:
        time.sleep(1.0)  # the cell is in its idle long-poll
    finally:
        killed = c.stop(grace_s=20.0)  # a hung shutdown never ends by itself: any grace catches it
    assert killed == [], (killed, c.logs())
    assert all(p.returncode is not None for p in procs.values())
