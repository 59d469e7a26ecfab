"""Shared bench plumbing: argument parsing, one-thread torch, the final JSON line, and the
verdict: `finish` judges the result against bench/targets.yaml, records what code it was
measured on, prints it and exits 1 when a target is missed (0 with --no-targets)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(description: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="smaller, faster run")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    add_target_args(ap)
    if extra:
        extra(ap)
    return ap.parse_args()


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """--no-targets, for a bench that builds its own parser."""
    ap.add_argument("--no-targets", action="store_true",
                    help="exit 0 even when a target of bench/targets.yaml is missed (exploring)")


def set_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


def finish(result: dict, args: argparse.Namespace, bench: str, argv: list[str] | None = None) -> None:
    """The end of every bench: `targets`, `all_met` and `provenance` added to the result, the
    result printed (`emit`), each missed target named on stderr, then exit 1 if one was missed
    and --no-targets was not given, else 0."""
    from judge import judge, missed, provenance, variant_of

    quick = bool(getattr(args, "quick", False))
    argv = sys.argv[1:] if argv is None else argv
    result["targets"], result["all_met"] = judge(result, bench, quick, variant=variant_of(bench, argv))
    result["provenance"] = provenance(bench, argv)
    emit(result, bool(getattr(args, "json", False)))
    for line in missed(result["targets"]):
        print(f"target missed: {line}", file=sys.stderr)
    sys.exit(0 if result["all_met"] or getattr(args, "no_targets", False) else 1)


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
