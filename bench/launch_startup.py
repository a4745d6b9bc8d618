"""How long a train job takes from its shell start to its first worker's start: the
launcher's own start-up (imports, run lock, attempt log, preflight) before torchrun starts
a worker. Every train job, every retry and every requeue pays it.

    python bench/launch_startup.py                      # this checkout, 5 starts
    python bench/launch_startup.py --root OTHER_CHECKOUT --repeats 5

Each start runs ``scripts/train.py`` (as the train rule does) of ``--root`` on the fixture
model's shards (1 node x 1 process), waits for the first process started with
``--worker``, and kills the job. Printed: seconds from the launcher's process start to the
worker's process start (both as the kernel records them), each start and the median, and
the seconds the launcher spends importing its modules (``python -X importtime``).
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module: take this folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def first_worker(root: Path, spec: dict, shards: Path, model: Path, work: Path) -> float:
    """Seconds from the launcher's start to its first worker's start (one job, killed)."""
    import psutil

    cmd = [sys.executable, str(root / "scripts/train.py"), "--run-spec", json.dumps(spec),
           "--shards", str(shards), "--model", str(model), "--deepspeed",
           str(root / "config/deepspeed/zero2.json"), "--out", "results/x/train"]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    launcher = psutil.Process(proc.pid)
    began = launcher.create_time()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = [p for p in launcher.children(recursive=True)
                       if "--worker" in p.cmdline()]  # fmt: skip
            if workers:
                return min(p.create_time() for p in workers) - began
            if proc.poll() is not None:
                raise RuntimeError(f"the job ended ({proc.returncode}) before a worker started")
            time.sleep(0.005)
        raise RuntimeError("no worker within 120 s")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def import_seconds(root: Path) -> float:
    """The launcher's import time of snaketune.train.launch (the cumulative figure)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import snaketune.train.launch"],
                          cwd=root / "scripts", capture_output=True, text=True, check=True)  # fmt: skip
    lines = [x for x in proc.stderr.splitlines() if re.search(r"\| snaketune\.train\.launch$", x)]
    return int(lines[-1].split("|")[1]) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose train.py runs")
    parser.add_argument("--repeats", type=int, default=5, help="job starts measured")
    args = parser.parse_args()
    from snaketune.app.fixtures import FixtureSizes, demo_run_spec, make_sharded_fixture
    from snaketune.data.shard import Layout

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        made = make_sharded_fixture(tmp, FixtureSizes(train_rows=64, test_rows=8),
                                    Layout(1, 1, 8, 1), packing=False)  # fmt: skip
        spec = demo_run_spec(ROOT, nodes=1, max_steps=1, packing=False)
        times = []
        for i in range(args.repeats):
            work = tmp / f"job-{i}"
            work.mkdir()
            times.append(first_worker(args.root.resolve(), spec, made["shards"], made["model"],
                                      work))  # fmt: skip
    print(f"checkout: {args.root.resolve()}")
    print(f"shell start -> first worker start: median {statistics.median(times):.2f} s "
          f"({', '.join(f'{t:.2f}' for t in times)})")  # fmt: skip
    print(f"launcher imports (snaketune.train.launch): {import_seconds(args.root.resolve()):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
