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

    python bench/import_cost.py --collector     # Python's garbage collector while loading

--collector: both sides import the same (snaketune first, then the libraries above), as
  loading    the entry scripts do: under snaketune.core.imports.loading(), the collector off
             while the modules load, what they made frozen after
  collecting Python's collector running as it does by default (every 700 new objects)
and each says how many full collections (generation 2) ran while the modules loaded and
the CPU seconds spent in collections (gc.callbacks; in-process, beside the kernel's total).
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
# the time in collections and the full ones, counted from before the imports
COUNTING = (
    "import gc, time; spent = [0.0, 0.0]\n"
    "def count(phase, info):\n"
    "    if phase == 'start': spent[1] = time.process_time()\n"
    "    else: spent[0] += time.process_time() - spent[1]\n"
    "gc.callbacks.append(count); full = gc.get_stats()[2]['collections']\n"
)
COLLECTED = (
    "print(f\"{gc.get_stats()[2]['collections'] - full} full, {spent[0]:.2f} CPU-s in "
    'collections")'
)
COLLECTOR_SIDES = {
    "loading": f"{COUNTING}import snaketune\nfrom snaketune.core.imports import loading\n"
    f"with loading():\n    {LIBRARIES}\n{COLLECTED}",
    "collecting": f"{COUNTING}import snaketune\n{LIBRARIES}\n{COLLECTED}",
}


def run(code: str) -> tuple[float, float, float, str]:
    """(CPU seconds, wall seconds, peak MiB, the side's report: its last line) of one side."""
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
    return usage.ru_utime + usage.ru_stime, wall, peak, out.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7, help="pairs (one run a side)")
    parser.add_argument("--collector", action="store_true",
                        help="instead: the collector off while loading against collecting")  # fmt: skip
    args = parser.parse_args()
    sides = COLLECTOR_SIDES if args.collector else SIDES
    a_name, b_name = sides
    print(f"machine: {os.cpu_count()} cores; a fresh Python a side, {args.repeats} pairs")
    print(f"{'pair':<6}{a_name + ' CPU s':>18}{b_name + ' CPU s':>18}{'ratio':>8}"
          f"{a_name + ' MiB':>16}{b_name + ' MiB':>16}")  # fmt: skip
    figures: dict[str, list[tuple]] = {name: [] for name in sides}
    for pair in range(1, args.repeats + 1):
        for name, code in sides.items():
            figures[name].append(run(code))
        a, b = figures[a_name][-1], figures[b_name][-1]
        print(f"{pair:<6}{a[0]:>18.2f}{b[0]:>18.2f}{a[0] / b[0]:>8.3f}{a[2]:>16.0f}{b[2]:>16.0f}",
              flush=True)  # fmt: skip
    ratios = [a[0] / b[0] for a, b in zip(figures[a_name], figures[b_name], strict=True)]
    report = "collections while loading" if args.collector else "TorchInductor's compiler loaded"
    for name, runs in figures.items():
        print(f"{name}: median {statistics.median(r[0] for r in runs):.2f} CPU-s, "
              f"{statistics.median(r[1] for r in runs):.2f} s wall, "
              f"{statistics.median(r[2] for r in runs):.0f} MiB peak; {report}: "
              f"{sorted({r[3] for r in runs})}")  # fmt: skip
    print(
        f"CPU seconds {a_name} / {b_name}, median of {len(ratios)} pairs: "
        f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
