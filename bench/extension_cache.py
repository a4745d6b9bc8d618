"""Two Python environments on one machine and DeepSpeed's JIT-built CPU op: the seconds a
process of each takes to load it, in turn (A, B, A, B, ...), with torch's one shared
extension cache (what every environment used before) and with each environment's own
(snaketune.core.cache.extensions_dir, what the train jobs use now). A train job on CPU loads
this op before its first step, so the figure is what its start-up gains or loses.

    python bench/extension_cache.py --rounds 3                  # B: a copy of this environment
    python bench/extension_cache.py --other /tmp/venv-b/bin/python   # B: another one

Without ``--other`` the second environment is a copy of the first (``cp -a`` of
``sys.prefix`` into a temporary folder, removed after): its torch sits elsewhere, so its
build flags differ, as two clones' or two venvs' do. Prints one line per load and the
median of each environment's loads after its first, per mode.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = (
    "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; "
    "ShareMemCommBuilder().load(verbose=False)"
)
OWN = "from snaketune.core.cache import extensions_dir; print(extensions_dir())"


def load_seconds(python: str, cache: str) -> float:
    """One process of ``python`` loading the op with ``cache`` as its extension folder."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache, "PYTHONWARNINGS": "ignore"}
    began = time.monotonic()
    subprocess.run([python, "-c", LOAD], env=env, check=True, capture_output=True)
    return time.monotonic() - began


def own_cache(python: str) -> str:
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    env = {**os.environ, "PYTHONPATH": scripts}
    return subprocess.run([python, "-c", OWN], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the second environment's python (default: a copy)")
    parser.add_argument("--rounds", type=int, default=3, help="loads of each environment")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-ext-"))
    try:
        return compare(args.other or copy_of_this(work), args.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def copy_of_this(work: Path) -> str:
    """A copy of this environment (its python, its packages) without its op builds."""
    copy = work / "venv-b"
    subprocess.run(["cp", "-a", sys.prefix, str(copy)], check=True)
    shutil.rmtree(copy / "torch_extensions", ignore_errors=True)
    return str(copy / "bin" / Path(sys.executable).name)


def compare(other: str, rounds: int) -> int:
    envs = {"A": sys.executable, "B": other}
    shared = tempfile.mkdtemp(prefix="torch-ext-shared-")  # torch's one folder, as before
    modes = {
        "shared (torch's one folder)": dict.fromkeys(envs, shared),
        "own (extensions_dir)": {k: own_cache(p) for k, p in envs.items()},
    }
    for mode, caches in modes.items():
        seen: dict[str, list[float]] = {k: [] for k in envs}
        for r in range(rounds):
            for name, python in envs.items():
                s = load_seconds(python, caches[name])
                seen[name].append(s)
                print(f"{mode}: round {r + 1}, environment {name}: {s:.1f} s", flush=True)
        after_first = {k: statistics.median(v[1:]) for k, v in seen.items() if len(v) > 1}
        print(f"{mode}: median load after each environment's first: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in after_first.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
