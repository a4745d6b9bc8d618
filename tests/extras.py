"""Every optional extra of pyproject.toml resolves beside the pinned stack: uv's resolver
reads the packages' metadata from the index (no wheel is downloaded, nothing installed),
for Python 3.11 on x86-64 Linux, as a GPU cluster's nodes have it. CI runs it
(.ci/run); it needs the package index::

    python tests/extras.py            # every extra
    python tests/extras.py gpu eval   # these

Exits 1 naming each extra that does not resolve, with the resolver's reason.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def extras() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return sorted(project.get("optional-dependencies", {}))


def resolve(extra: str) -> subprocess.CompletedProcess:
    """uv pip compile of the project with ``extra``: the pins and the extra, together."""
    uv = Path(sys.executable).parent / "uv"
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run(
            [str(uv), "pip", "compile", "pyproject.toml", "--extra", extra, "--quiet",
             "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
             "--no-header", "-o", str(Path(tmp) / "lock.txt")],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip


def main(argv: list[str]) -> int:
    failed = []
    for extra in argv or extras():
        proc = resolve(extra)
        print(f"extra {extra}: {'resolves' if proc.returncode == 0 else 'does NOT resolve'} "
              "beside the pins")  # fmt: skip
        if proc.returncode != 0:
            failed.append(extra)
            print(proc.stderr.strip()[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
