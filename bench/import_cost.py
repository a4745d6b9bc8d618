"""What a stage's process pays to import its libraries, with the torch.compile calls of
bitsandbytes and DeepSpeed's Muon optimizer deferred to their first use
(snaketune.core.imports) and without.

    python bench/import_cost.py                 # 7 pairs
    python bench/import_cost.py --repeats 11

Each side is a fresh Python importing what a training worker imports (peft, trl, deepspeed,
transformers, TRL's SFT and DPO trainers, and the Muon optimizer that every
deepspeed.initialize with ZeRO imports in its check of the optimizer) and snaketune:
  deferred     snaketune first, as every stage's process loads it: its deferral is in
               place when peft imports bitsandbytes and DeepSpeed imports Muon
  as loaded    snaketune last: both load as they always did, calling torch.compile,
               which imports TorchInductor
The sides run in turn, one pair after another; a figure is the median pair's. CPU seconds
are the child's user + system time (the kernel's accounting of the finished process), peak
memory its maximum resident set; each side says whether TorchInductor's compiler
(torch._inductor.compile_fx) was loaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = (
    "import peft, trl, deepspeed, transformers; from trl import SFTTrainer, DPOTrainer; "
    "import deepspeed.runtime.zero.muon.muon_optimizer"
)
REPORT = "import sys; print('torch._inductor.compile_fx' in sys.modules)"
SIDES = {
    "deferred": f"import snaketune; {LIBRARIES}; {REPORT}",
    "as loaded": f"{LIBRARIES}; import snaketune; {REPORT}",
}


def run(code: str) -> tuple[float, float, float, bool]:
    """(CPU seconds, wall seconds, peak MiB, TorchInductor's compiler loaded) of one side."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH")]))}  # fmt: skip
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, text=True)  # fmt: skip
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the kernel's accounting of the child
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the side exited {os.waitstatus_to_exitcode(status)}: {code}")
    wall = time.perf_counter() - began
    peak = usage.ru_maxrss / 1024  # Linux reports KiB
    return usage.ru_utime + usage.ru_stime, wall, peak, out.strip().endswith("True")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="pairs (one run a side)")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores; a fresh Python a side, {args.repeats} pairs")
    print(f"{'pair':<6}{'deferred CPU s':>16}{'as loaded CPU s':>17}{'ratio':>8}"
          f"{'deferred MiB':>14}{'as loaded MiB':>15}")  # fmt: skip
    figures: dict[str, list[tuple]] = {name: [] for name in SIDES}
    for pair in range(1, args.repeats + 1):
        for name, code in SIDES.items():
            figures[name].append(run(code))
        a, b = figures["deferred"][-1], figures["as loaded"][-1]
        print(f"{pair:<6}{a[0]:>16.2f}{b[0]:>17.2f}{a[0] / b[0]:>8.3f}{a[2]:>14.0f}{b[2]:>15.0f}",
              flush=True)  # fmt: skip
    ratios = [a[0] / b[0] for a, b in zip(figures["deferred"], figures["as loaded"], strict=True)]
    for name, runs in figures.items():
        print(f"{name}: median {statistics.median(r[0] for r in runs):.2f} CPU-s, "
              f"{statistics.median(r[1] for r in runs):.2f} s wall, "
              f"{statistics.median(r[2] for r in runs):.0f} MiB peak; TorchInductor's compiler "
              f"loaded: {sorted({r[3] for r in runs})}")  # fmt: skip
    print(
        f"CPU seconds deferred / as loaded, median of {len(ratios)} pairs: "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
