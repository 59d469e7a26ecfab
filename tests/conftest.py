"""Shared fixtures: one torch thread per process, free loopback ports."""

from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The API token every scheduler a test starts requires, and every client of it sends
# (scheduler/contract/tokens.py: an unset token file falls back to this variable). Tests of the token
# file itself unset it.
os.environ["CELLFLIP_API_TOKEN"] = "test-token-" + os.urandom(8).hex()
AUTH = {"Authorization": f"Bearer {os.environ['CELLFLIP_API_TOKEN']}"}

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the control plane's tests do not need torch
    pass


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def free_port() -> int:
    return find_free_port()
