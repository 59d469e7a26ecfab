"""`cellflip up`: scheduler + cells come up, the API answers, Ctrl-C stops every process."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from cells.localcluster import ROOT, SMALL_MODEL, Cluster, find_free_port

pytestmark = pytest.mark.slow


def test_up_serves_the_api_and_stops_cleanly_on_ctrl_c(tmp_path):
    port = find_free_port()
    cfg = {"scheduler": {"db_path": str(tmp_path / "db.sqlite"), "port": port},
           "cells": {"count": 2, "engine": {"type": "embedded", "model": SMALL_MODEL, "num_blocks": 64}}}
    (tmp_path / "up.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cells.cli", "up", "--config", str(tmp_path / "up.yaml")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "cellflip up:" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "cellflip up exited early"
        assert f"http://127.0.0.1:{port}" in line
        cells = httpx.get(f"http://127.0.0.1:{port}/v1/cells").json()["cells"]
        assert sorted(c["id"] for c in cells) == ["cell-0", "cell-1"] and all(c["state"] == "rollout" for c in cells)
        status = subprocess.run([sys.executable, "-m", "cells.cli", "status", "--scheduler", f"http://127.0.0.1:{port}"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "cell-1" in status.stdout and "rollout" in status.stdout
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


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
