"""bench/gpu_check.py on CPU with tiny sizes: every part's code path runs (the migration between
two cell processes through the host-staged path, in bf16; the version received over gloo with
its checksum), and its import closure is the GPU image's packages plus the carried wheels."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMAGE = {
    # what the GPU image has: torch, triton, numpy, safetensors, pyyaml, httpx, transformers and
    # what they depend on
    "torch", "torchgen", "functorch", "triton", "numpy", "safetensors", "yaml", "_yaml", "httpx", "httpcore", "h11", "anyio", "idna",
    "certifi", "sniffio", "transformers", "tokenizers", "huggingface_hub", "typing_extensions", "sympy", "mpmath",
    "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "packaging", "regex", "requests", "tqdm",
}
OURS = {"cells", "scheduler", "gpu_check", "gpu_parts", "gpu_migrate", "common", "judge", "expr"}

RUNNER = r"""
import json, sys
allowed = set(json.loads(sys.argv[1]))
before = set(sys.modules)
refused = []

class OnlyThese:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in allowed or top.startswith("_") or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return None
        refused.append(top)
        raise ModuleNotFoundError(f"No module named {top!r} (not in the GPU image)", name=top)

sys.meta_path.insert(0, OnlyThese())
sys.path.insert(0, sys.argv[2] + "/bench")
import gpu_check
try:
    gpu_check.main(sys.argv[3:])
except SystemExit:
    pass
tops = {m.split(".")[0] for m in set(sys.modules) - before}
third = sorted(t for t in tops if t not in sys.stdlib_module_names and not t.startswith("_") and t != "cython_runtime")
print(json.dumps({"third_party": third, "refused": sorted(set(refused))}))
"""


@pytest.mark.slow
def test_gpu_check_runs_every_part_on_cpu_within_the_gpu_images_packages(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from gpu_check import WHEEL_PACKAGES
    finally:
        sys.path.pop(0)
    allowed = sorted(IMAGE | OURS | set(WHEEL_PACKAGES))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    args = ["--out", str(tmp_path), "--device", "cpu", "--tiny", "--json", "--no-targets"]
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(allowed), ROOT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    closure = json.loads(proc.stdout.strip().splitlines()[-1])
    used = set(closure["third_party"]) - OURS
    assert used - IMAGE <= set(WHEEL_PACKAGES), closure  # beyond the image: only the carried wheels
    # pydantic is the one thing the image lacks that the engine's import path needs
    assert "pydantic" in used
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = res["parts"]
    assert sorted(parts) == list("abcdef")
    for name in "abcdf":
        assert parts[name]["ok"] is True, (name, parts[name])
    assert parts["e"]["ran"] is False and parts["e"]["ok"] is None
    b = parts["b"]
    assert b["outcome"] == {"src": "committed", "dst": "committed"} and b["negative_control_caught"]
    assert b["tokens_before_move"] > 0 and b["tokens_after_move"] > 0 and b["dtype"] == "torch.bfloat16"
    c = parts["c"]
    assert c["batches"] == [1, 3, 8, 64] and c["mismatches"] == 0 and c["negative_control_caught"]
    d = parts["d"]
    assert d["checksum_verified"] and d["staging_equals_sent"] and d["negative_control_caught"]
    assert set(parts["f"]["roofline_fraction"]) == {"1", "16", "64"}
    # --part reruns one part into the same file, keeping the others
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), *args, "--part", "e"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert sorted(again) == list("abcdef") and again["a"] == parts["a"]


def test_gpu_check_unpacks_carried_wheels_onto_the_path(tmp_path, monkeypatch):
    import zipfile

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    with zipfile.ZipFile(tmp_path / "fakepkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("fakepkg_gpu41/__init__.py", "VALUE = 41\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    site = gpu_check.use_wheels(tmp_path)
    import fakepkg_gpu41

    assert fakepkg_gpu41.VALUE == 41 and str(site) in os.environ["PYTHONPATH"]
    assert gpu_check.use_wheels(tmp_path / "none") is None
