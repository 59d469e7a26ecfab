"""The README's quick-start code blocks, read from the README and run as written against a
real cluster (scheduler + two toy-model cells), so they cannot drift from the product."""

import os
import re
import subprocess
import sys

import pytest
import yaml

from cells.entry import prepare_toy as _prepare_toy
from cells.localcluster import ROOT, Cluster, find_free_port
from scheduler.contract.tokens import SCOPE_ENV, TOKEN_ENV

pytestmark = pytest.mark.slow


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start: clients"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_has_the_two_client_blocks():
    blocks = readme_python_blocks()
    assert len(blocks) == 2 and "OpenAI(" in blocks[0] and "TrainerClient(" in blocks[1]


@pytest.fixture(scope="module")
def toy_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    raw = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    raw["scheduler"].update(db_path=str(tmp / "db.sqlite"), min_rollout_cells=1)
    raw["cells"].update(count=2)
    raw["cells"]["engine"].update(num_blocks=256)
    raw["trainer"]["enabled"] = False
    _prepare_toy(raw)
    c = Cluster(tmp, num_cells=2, cfg=raw, port=find_free_port())
    yield c
    c.stop()


@pytest.mark.parametrize("index", [0, 1], ids=["openai_client", "trainer_client"])
def test_readme_block_runs(toy_cluster, index, tmp_path):
    code = readme_python_blocks()[index].replace("127.0.0.1:8700", f"127.0.0.1:{toy_cluster.port}")
    # each example with its own scope only: the agent's token for the chat, the trainer's for the rest
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({SCOPE_ENV["agent"]: toy_cluster.agent_token, SCOPE_ENV["trainer"]: toy_cluster.trainer_token,
                "PYTHONPATH": str(ROOT)})
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr + toy_cluster.logs()
    if index == 1:
        assert "'done'" in r.stdout.splitlines()[1]  # the flip to training ran and reported
        states = {c["id"]: c["state"] for c in toy_cluster.cells()}
        assert states == {"cell-0": "rollout", "cell-1": "rollout"}  # and flipped back
    else:
        sid = toy_cluster.session("demo-1")
        assert sum(sid["loss_mask"]) > 0  # both turns were sampled and recorded as token ids
