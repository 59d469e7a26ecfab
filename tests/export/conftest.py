"""The export tests reuse the scheduler tests' harness (a TestClient on an app with no loop)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
