"""The reference model's summed log-probs of every pair of a DPO run's tokenized pairs.

    python scripts/reference_logps.py --tokenized results/tokenized/KEY/data.parquet \
        --model resources/models/tiny --nodes 2 --gpus-per-node 1 --batch-pairs 32 \
        --precision auto --attn-implementation auto \
        --out results/reference_logps/REF/logps.parquet

Data parallel over nodes x gpus_per_node workers, one per device (each holds the model):
inside a SLURM job of several nodes, one srun task per node starts that node's workers;
elsewhere every worker runs on this machine. Each worker writes its chunks of pairs to
``parts/`` beside the output as it finishes them, so a rerun after a kill computes only
what is missing; the output is written once every chunk is there (snaketune.logps).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune import qlora
from snaketune.cli import run
from snaketune.logps import compute_parts, merge, threads_per_worker
from snaketune.model import resolve_precision
from snaketune.packing import resolve_attention
from snaketune.provenance import NAME, output_hashes, record, write_provenance

log = logging.getLogger("reference_logps")


def start_workers(args: argparse.Namespace, node: int, local: int, argv: list[str]) -> int:
    """Start ``local`` workers of node ``node`` and wait for them; the first failure's code."""
    first = node * args.gpus_per_node
    workers = args.nodes * args.gpus_per_node
    env = {"OMP_WAIT_POLICY": "PASSIVE",  # workers sharing cores sleep while they wait
           **os.environ, "OMP_NUM_THREADS": str(threads_per_worker(local))}  # fmt: skip
    internal = ["--workers", str(workers), "--parent", str(os.getpid())]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(w), *internal],
                              env=env) for w in range(first, first + local)]  # fmt: skip
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenized", required=True, help="the run's tokenized pairs (parquet)")
    parser.add_argument("--model", required=True, help="the reference model's directory")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the run")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="devices per node")
    parser.add_argument("--batch-pairs", type=int, default=8, help="pairs per forward pass")
    parser.add_argument("--precision", default="auto", help="the run's precision")
    parser.add_argument("--attn-implementation", default="auto", help="the run's attention")
    parser.add_argument("--quantize", default="none", choices=["none", "4bit"],
                        help="the run's lora.quantize (a 4-bit base)")  # fmt: skip
    parser.add_argument("--quant-type", default="nf4", help="the run's lora.quant_type")
    parser.add_argument("--double-quant", default="true", choices=["true", "false"],
                        help="the run's lora.double_quant")  # fmt: skip
    parser.add_argument("--compute-dtype", default="auto", help="the run's lora.compute_dtype")
    parser.add_argument("--out", required=True, help="the log-probs parquet to write")
    parser.add_argument("--node", type=int, help="(internal) start this node's workers")
    parser.add_argument("--worker", type=int, help="(internal) compute as this worker")
    parser.add_argument("--workers", type=int, help="(internal) of this many workers")
    parser.add_argument("--parent", type=int, help="(internal) the process that started it")
    args = parser.parse_args(argv)
    out = Path(args.out)
    parts = out.parent / "parts"
    shared = ["--tokenized", args.tokenized, "--model", args.model, "--nodes", str(args.nodes),
              "--gpus-per-node", str(args.gpus_per_node), "--batch-pairs", str(args.batch_pairs),
              "--precision", args.precision, "--attn-implementation", args.attn_implementation,
              "--quantize", args.quantize, "--quant-type", args.quant_type,
              "--double-quant", args.double_quant, "--compute-dtype", args.compute_dtype,
              "--out", args.out]  # fmt: skip
    if args.worker is not None:  # one device's share
        from snaketune.runlock import die_with_parent

        die_with_parent()  # never outlive the process that started it
        if os.getppid() != args.parent:
            return 1  # that process is already gone
        parts.mkdir(parents=True, exist_ok=True)
        precision = resolve_precision(args.precision)
        quantization = None if args.quantize == "none" else {
            "quantize": args.quantize,
            "quant_type": args.quant_type,
            "double_quant": args.double_quant == "true",
            "compute_dtype": args.compute_dtype,
        }  # fmt: skip
        quantize = qlora.settings(quantization, precision)
        done = compute_parts(args.tokenized, args.model, parts, args.worker, args.workers,
                             args.batch_pairs, precision,
                             resolve_attention(args.attn_implementation), quantize)  # fmt: skip
        log.info("worker %d: %d chunks computed", args.worker, done)
        return 0
    if args.node is not None:  # one node's workers (an srun task)
        return start_workers(args, args.node, args.gpus_per_node, shared)
    parts.mkdir(parents=True, exist_ok=True)
    if args.nodes > 1 and os.environ.get("SLURM_JOB_ID") and shutil.which("srun"):
        inner = " ".join(shlex.quote(a) for a in [sys.executable, __file__, *shared])
        code = subprocess.call([
            "srun", f"--nodes={args.nodes}", f"--ntasks={args.nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "bash", "-c", f'exec {inner} --node "$SLURM_NODEID"',
        ])  # fmt: skip
    else:  # every (emulated) node's workers here
        code = start_workers(args, 0, args.nodes * args.gpus_per_node, shared)
    if code != 0:
        log.error("a worker failed (exit %d); the chunks written are kept, a rerun computes "
                  "the rest", code)  # fmt: skip
        return code
    table = merge(args.tokenized, parts, out)
    settings = {
        "precision": args.precision,
        "attn_implementation": args.attn_implementation,
        "quantize": args.quantize,
    }
    inputs = {"tokenized": args.tokenized, "model": args.model}
    prov = record("reference_logps", str(out), settings, inputs,
                  output_hashes(out.parent, [out.name]))  # fmt: skip
    write_provenance(out.parent / NAME, prov)
    shutil.rmtree(parts, ignore_errors=True)
    log.info("reference log-probs of %d pairs -> %s", table.num_rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
