"""Print the first ```bash block under a README heading (CI and the README test share it)."""
import sys
from pathlib import Path


def block(readme: str, heading: str) -> str:
    lines = readme.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("#") and ln.lstrip("#").strip() == heading)
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```bash"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[fence + 1:end]).strip()


if __name__ == "__main__":
    print(block(Path(__file__).resolve().parent.parent.joinpath("README.md").read_text(), sys.argv[1]))
