"""The embedded engine on one GPU, in one command sized for five minutes (not yet timed on one):

    python bench/gpu_check.py --out DIR [--part X ...] [--device cuda] [--tiny] [--wheels DIR]

(a) a 1.72 B-parameter Qwen3-architecture model (random weights) decodes in bf16; (b) a live
request moves between two cell processes on the device, token-exact against an unmoved twin,
and the path that carried it; (c) batch-invariant: decode log-probs bitwise equal to scoring at
batch 1, 3, 8 and 64 with prefill and decode mixed, and the same request's bitwise equal at
every batch; (d) a weight version received over gloo into device buffers, each bucket's CRC32
checked on the host staging copy, then decoding on it; (e) one training step (not run until the
learner has a device); (f) decode tokens/s at batch 1, 16 and 64 at a context of 1,024 with
`roofline_fraction` (bytes read per step ÷ step time ÷ the measured device-to-device copy rate).

Writes DIR/gpu_check.json; `--part X` reruns one part into that file. `--tiny --device cpu`
runs every part's code on CPU in seconds (the CPU suite does). What the GPU image lacks
(pydantic and its three companions) comes as cp312 wheels: `--wheels DIR` (default
bench/out/wheels when pydantic is not importable), fetched beforehand with
`pip download -d bench/out/wheels --only-binary=:all: --no-deps --python-version 3.12
--platform manylinux2014_x86_64 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
typing-inspection==0.4.5` and carried with the tree.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
import traceback
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL_PACKAGES = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection")
"""What a GPU image with torch, numpy, safetensors, pyyaml and httpx lacks for this check."""


def use_wheels(folder: Path) -> Path | None:
    """Unpack the wheels of `folder` once into folder/site and put it first on the path (of
    this process and of the cell processes it starts)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return None
    site = folder / "site"
    for w in wheels:
        mark = site / f".{w.name}.done"
        if not mark.exists():
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
            mark.touch()
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return site


def bootstrap(wheels: str | None) -> None:
    root = str(HERE.parent)
    for p in (str(HERE), root):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x)
    if wheels is not None:
        use_wheels(Path(wheels))
    elif importlib.util.find_spec("pydantic") is None:
        use_wheels(HERE / "out" / "wheels")
    if importlib.util.find_spec("pydantic") is None:
        sys.exit("gpu_check: pydantic is not importable and no wheels were found (--wheels DIR, or "
                 "bench/out/wheels): fetch them as this script's docstring says and carry the folder")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--part", action="append", choices=list("abcdef"), help="run only this part (repeatable)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU run of every part's code)")
    ap.add_argument("--wheels", default=None, help="folder of cp312 wheels for what the image lacks")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    ap.add_argument("--no-targets", action="store_true", help="exit 0 even when a target is missed")
    ap.add_argument("--migrate-role", default=None, help=argparse.SUPPRESS)  # a cell process of part (b)
    return ap.parse_args(argv)


def run_parts(args: argparse.Namespace, result: dict) -> dict:
    import gpu_parts
    import torch

    torch.set_num_threads(min(os.cpu_count() or 1, 8) if not args.tiny else 1)
    size = gpu_parts.sizes(args.tiny)
    work = Path(args.out)
    for name in args.part or sorted(gpu_parts.PARTS):
        t = time.perf_counter()
        try:
            out = gpu_parts.PARTS[name](args.device, size, work)
        except Exception as e:  # noqa: BLE001 - a failed part is reported, the others still run
            out = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        out["seconds"] = round(time.perf_counter() - t, 2)
        result["parts"][name] = out
        gc.collect()  # the part's engines go: the next part and its cell processes get the memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"part {name}: ok={out.get('ok')} in {out['seconds']} s", file=sys.stderr, flush=True)
    return result


def header(args: argparse.Namespace) -> dict:
    import torch

    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
    return {"device": args.device, "device_name": gpu, "torch": torch.__version__, "tiny": args.tiny,
            "python": sys.version.split()[0], "parts": {}}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    bootstrap(args.wheels)
    if args.migrate_role is not None:
        import gpu_migrate

        gpu_migrate.main(args.migrate_role)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu_check.json"
    result = header(args)
    if args.part and path.exists():  # rerun one part into the earlier run's file
        result["parts"] = json.loads(path.read_text()).get("parts", {})
    t = time.perf_counter()
    run_parts(args, result)
    result["seconds"] = round(time.perf_counter() - t, 1)
    result["all_ok"] = all(p.get("ok") is not False for p in result["parts"].values())
    from common import finish
    from judge import judge, provenance

    argv_used = sys.argv[1:] if argv is None else argv
    result["targets"], result["all_met"] = judge(result, "gpu_check", False)
    result["provenance"] = provenance("gpu_check", argv_used)
    path.write_text(json.dumps(result, indent=1))
    finish(result, args, "gpu_check", argv_used)


if __name__ == "__main__":
    main()
