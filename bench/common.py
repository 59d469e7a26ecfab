"""Shared bench plumbing: argument parsing, one-thread torch, the final JSON line."""

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
    if extra:
        extra(ap)
    return ap.parse_args()


def set_threads(n: int = 1) -> None:
    import torch

    torch.set_num_threads(n)


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
