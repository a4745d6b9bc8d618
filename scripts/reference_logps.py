"""The reference model's summed log-probs of every pair of a DPO run's tokenized pairs.

    python scripts/reference_logps.py --tokenized results/tokenized/KEY/data.parquet \
        --model resources/models/tiny --nodes 2 --gpus-per-node 1 --batch-pairs 32 \
        --precision auto --attn-implementation auto \
        --out results/reference_logps/REF/logps.parquet

Data parallel over nodes x gpus_per_node workers, one per device (each holds the model),
started by the train job's launcher (snaketune.train.agents): torchrun agents on this machine,
or one srun task per node inside a SLURM job after the preflight; the stall watch reads
the workers' heartbeats (results/reference_logps/REF/heartbeat/), a worker that fails takes
the others down, and each start of the stage keeps its own log
(results/reference_logps/REF/logs/attempt-<n>.log, snaketune.train.attempts). Each worker writes
its chunks of pairs to ``parts/`` beside the output as it finishes them, so a rerun after a
kill computes only what is missing; the output is written once every chunk is there
(snaketune.evaluation.logps).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run
from snaketune.core import qlora
from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
from snaketune.data.kernels import resolve_attention
from snaketune.evaluation.logps import CHUNK_PAIRS, compute_parts, merge, threads_per_worker
from snaketune.evaluation.model import resolve_precision

log = logging.getLogger("reference_logps")


def worker(args: argparse.Namespace, parts: Path) -> int:
    """One device's share: worker RANK of WORLD_SIZE (torchrun's), its heartbeat written."""
    from snaketune.core.heartbeat import DONE, FOLDER, Heartbeat
    from snaketune.core.runlock import die_with_parent

    die_with_parent()  # never outlive the agent that started it
    rank, workers = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    beat = Heartbeat(parts.parent / FOLDER, rank, int(os.environ.get("GROUP_RANK", 0))).start()
    parts.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(args.precision)
    quantization = None if args.quantize == "none" else {
        "quantize": args.quantize,
        "quant_type": args.quant_type,
        "double_quant": args.double_quant == "true",
        "compute_dtype": args.compute_dtype,
    }  # fmt: skip
    done = compute_parts(args.tokenized, args.model, parts, rank, workers, args.batch_pairs,
                         precision, resolve_attention(args.attn_implementation),
                         qlora.settings(quantization, precision),
                         on_batch=lambda chunk: beat.move("forward", chunk),
                         chunk_pairs=args.chunk_pairs)  # fmt: skip
    beat.move(DONE)
    beat.write()
    beat.stop()
    log.info("worker %d: %d chunks computed", rank, done)
    return 0


def launch(args: argparse.Namespace, shared: list[str], out: Path) -> int:
    """Every worker through the shared launcher, as one attempt of the stage; then the
    output once every chunk is there."""
    from snaketune.core.errors import UserError, error_lines
    from snaketune.train.agents import Workers, choose_launcher, start, worker_environment
    from snaketune.train.attempts import Attempt

    folder = out.parent
    attempt = Attempt(folder, stage="reference_logps", name=folder.name)
    timeout = args.timeout_minutes
    if timeout is None:  # run by hand: the run's default
        from snaketune.plan.schema import run_default

        timeout = run_default("timeout_minutes")
    workers = Workers([str(Path(__file__).resolve()), *shared, "--worker"], args.nodes,
                      args.gpus_per_node, f"reference-{folder.name}", "reference_logps", folder,
                      folder, timeout * 60)  # fmt: skip
    env = worker_environment()
    try:
        here = choose_launcher(workers.launcher, args.nodes, workers.rule) == "local"
        # the cores of this machine (every emulated node) or of each node, shared out
        local = args.nodes * args.gpus_per_node if here else args.gpus_per_node
        env["OMP_NUM_THREADS"] = str(threads_per_worker(local))
        code, signalled = start(workers, env)
        if code != 0:
            from snaketune.core.heartbeat import stall_verdict

            stalled = stall_verdict(folder)
            reason = f"stalled: {stalled}" if stalled else (
                f"stopped by {signalled}" if signalled else None)  # fmt: skip
            log.error("a worker failed (exit %d); the chunks written are kept, a rerun "
                      "computes the rest", code)  # fmt: skip
            attempt.finish(code, reason)
            return code
        table = merge(args.tokenized, folder / "parts", out, args.chunk_pairs)
    except UserError as exc:
        from snaketune.core.errors import print_error

        print_error(exc)
        attempt.finish(2, "; ".join(error_lines(exc)))
        return 2
    except BaseException as exc:  # recorded as this attempt's end, then raised
        attempt.finish(1, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        raise
    settings = {
        "precision": args.precision,
        "attn_implementation": args.attn_implementation,
        "quantize": args.quantize,
    }
    inputs = {"tokenized": args.tokenized, "model": args.model}
    prov = record("reference_logps", str(out), settings, inputs,
                  output_hashes(folder, [out.name]))  # fmt: skip
    write_provenance(folder / NAME, prov)
    shutil.rmtree(folder / "parts", ignore_errors=True)
    log.info("reference log-probs of %d pairs -> %s", table.num_rows, out)
    attempt.finish(0, f"{table.num_rows} pairs scored")
    return 0


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
    parser.add_argument("--timeout-minutes", type=float, default=None,
                        help="a worker making no progress this long is named and the stage "
                        "ended (the run's timeout_minutes; default: the schema's)")  # fmt: skip
    parser.add_argument("--chunk-pairs", type=int, default=CHUNK_PAIRS,
                        help="pairs per part file: what a rerun after a kill may compute "
                        f"again (default {CHUNK_PAIRS})")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help="(internal) one worker")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.worker:
        return worker(args, out.parent / "parts")
    shared = ["--tokenized", args.tokenized, "--model", args.model, "--nodes", str(args.nodes),
              "--gpus-per-node", str(args.gpus_per_node), "--batch-pairs", str(args.batch_pairs),
              "--precision", args.precision, "--attn-implementation", args.attn_implementation,
              "--quantize", args.quantize, "--quant-type", args.quant_type,
              "--double-quant", args.double_quant, "--compute-dtype", args.compute_dtype,
              "--out", args.out, "--chunk-pairs", str(args.chunk_pairs)]  # fmt: skip
    (out.parent / "parts").mkdir(parents=True, exist_ok=True)
    return launch(args, shared, out)


if __name__ == "__main__":
    sys.exit(run(main))
