"""Train a run on its per-node shards: N nodes x G devices, DeepSpeed, LoRA or full.

    python scripts/train.py --run-spec "$(cat spec.json)" --shards results/demo/shards \
        --model resources/models/tiny --deepspeed config/deepspeed/zero2.json \
        --out results/demo/train

This launches the workers (see snaketune/launch.py): on a SLURM allocation one srun task
per node, elsewhere N torchrun agents on this machine. Each worker is this script again,
run by torchrun with --worker; by hand on a node:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        scripts/train.py --worker --run-spec ... --shards ... --model ... --deepspeed ... --out ...

A rerun resumes from the newest complete checkpoint in <out>/checkpoints/ when the run's
settings and shards are unchanged (otherwise the old checkpoints are moved aside).
Exit codes: 0 done, 2 bad input or a failing GPU (the GPU health watchdog stopped the run
after saving a checkpoint), 3 stopped by SIGTERM/SIGUSR1 after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.cli import run
from snaketune.errors import UserError
from snaketune.io import digest, publish, sha256_file, write_json
from snaketune.provenance import output_hashes, record
from snaketune.train import (
    STOPPED_EXIT_CODE,
    WORKER_OUTPUTS,
    newest_complete,
    staged,
)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-spec", required=True, help="the run's config entry (defaults filled), as JSON"
    )
    parser.add_argument(
        "--shards", required=True, type=Path, help="shard directory (node-k.parquet, manifest.json)"
    )
    parser.add_argument("--model", required=True, type=Path, help="base model directory")
    parser.add_argument(
        "--deepspeed", required=True, type=Path, help="DeepSpeed JSON (preset or file)"
    )
    parser.add_argument("--out", required=True, type=Path, help="results/<run>/train")
    parser.add_argument(
        "--launcher",
        choices=["auto", "local", "slurm"],
        default="auto",
        help="auto: slurm inside a SLURM job with srun available, else local",
    )
    parser.add_argument(
        "--log-example-ids",
        type=Path,
        default=None,
        help="directory: each rank appends the example ids it trains on to rank-<r>.txt",
    )
    parser.add_argument(
        "--worker", action="store_true", help="run as a torchrun worker (set by the launcher)"
    )
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> int:
    from snaketune.train import run_worker

    ids_log = None
    if args.log_example_ids:
        args.log_example_ids.mkdir(parents=True, exist_ok=True)
        ids_log = args.log_example_ids / f"rank-{os.environ.get('RANK', '0')}.txt"
    return run_worker(
        json.loads(args.run_spec), args.shards, args.model, args.deepspeed, args.out, ids_log
    )


def fingerprint(spec: dict, shards: Path, deepspeed: Path) -> str:
    """What a checkpoint must match to be resumed from."""
    return digest(
        {
            "run": spec,
            "manifest": sha256_file(shards / "manifest.json"),
            "deepspeed": sha256_file(deepspeed),
        }
    )


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import logging

    import torch

    from snaketune.launch import (
        free_port,
        local_commands,
        preflight_command,
        slurm_command,
        supervise,
    )
    from snaketune.preflight import gather

    logger = logging.getLogger("snaketune.train")
    spec = json.loads(args.run_spec)
    manifest = json.loads((args.shards / "manifest.json").read_text())
    nodes, gpus = manifest["nodes"], manifest["gpus_per_node"]
    if (nodes, gpus) != (spec["nodes"], spec["gpus_per_node"]):
        raise UserError(
            f"{args.shards} was made for {nodes} x {gpus}, the run asks for "
            f"{spec['nodes']} x {spec['gpus_per_node']}; rerun shard_dataset"
        )
    if spec["wandb"]["enabled"] and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "wandb.enabled is set but wandb is not installed: pip install wandb, "
            "or set wandb.enabled: false"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoints"
    print_ = fingerprint(spec, args.shards, args.deepspeed)
    stamp = ckpt / "fingerprint"
    if ckpt.exists() and (not stamp.exists() or stamp.read_text() != print_):
        aside = args.out / f"checkpoints.previous-{print_[:8]}"
        shutil.rmtree(aside, ignore_errors=True)
        ckpt.rename(aside)
        logger.warning(
            "run settings or shards changed: old checkpoints moved to %s; starting fresh", aside
        )
    ckpt.mkdir(exist_ok=True)
    stamp.write_text(print_)
    (ckpt / "health" / "fatal.json").unlink(missing_ok=True)  # from an earlier attempt

    worker_argv = [str(Path(__file__).resolve()), "--worker", *argv]
    run_id = f"snaketune-{args.out.parent.name}"
    launcher = args.launcher
    in_step = bool(os.environ.get("SLURM_STEP_ID"))  # already one task of an srun step
    if launcher == "auto":
        in_job = os.environ.get("SLURM_JOB_ID") and shutil.which("srun")
        launcher = "slurm" if in_job and not (in_step and nodes == 1) else "local"
    if launcher == "slurm" and in_step:
        raise UserError(
            f"train with nodes: {nodes} runs inside a single-task SLURM step, which cannot "
            "start tasks on other nodes; the train rule must keep its `mpi` resource "
            "(check that the profile's set-resources do not remove it)"
        )
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    logger.info("launching %d node(s) x %d process(es) with the %s launcher", nodes, gpus, launcher)
    if launcher == "local":
        code, signalled = supervise(
            local_commands(nodes, gpus, worker_argv, run_id, free_port()), env
        )
    else:
        import subprocess

        # Preflight on every node before any compute: devices, shared run directory,
        # rendezvous host and port. One line and exit 2 on a problem.
        shutil.rmtree(args.out / "preflight", ignore_errors=True)
        step = subprocess.run(preflight_command(nodes, gpus, str(args.out.resolve())), env=env)
        if step.returncode != 0:  # its tasks always exit 0: srun itself failed
            raise UserError(
                f"preflight: the srun step failed (exit {step.returncode}) before every node "
                "reported; see srun's message above in this log"
            )
        summary = gather(args.out, nodes)
        logger.info(
            "preflight passed: %s",
            "; ".join(
                f"{r['host']}: {r['devices']['count']} devices ({r['devices']['kind']}), "
                f"rendezvous {r.get('head_address')}"
                for r in summary["results"].values()
            ),
        )
        code, signalled = (
            subprocess.run(slurm_command(nodes, gpus, worker_argv, run_id), env=env).returncode,
            None,
        )
    if signalled:
        # The agents exit 1 on a forwarded signal whatever their workers did; report the stop.
        saved = newest_complete(ckpt)
        logger.warning(
            "stopped by %s; newest complete checkpoint: %s; rerun to resume",
            signalled,
            saved.name if saved else "none",
        )
        return STOPPED_EXIT_CODE
    fatal = ckpt / "health" / "fatal.json"
    if code != 0 and fatal.is_file():  # torchrun's own exit code is 1 whatever the workers'
        report = json.loads(fatal.read_text())
        saved = newest_complete(ckpt)
        raise UserError(
            f"GPU health: {'; '.join(report['messages'])}; stopped at step {report['step']} "
            f"(checkpoint {saved.name if saved else 'none'}); take the node out (e.g. sbatch "
            "--exclude) and rerun to resume"
        )
    if code != 0:
        logger.error(
            "training exited with code %d; rerun the rule to resume from the last checkpoint", code
        )
        return code
    missing = [n for n in WORKER_OUTPUTS if not staged(args.out, n).exists()]
    if missing:
        raise RuntimeError(f"the workers exited 0 without writing {missing}")
    hosts = sorted((ckpt / "hosts").glob("node-*"))
    write_json(staged(args.out, "run_config.json"), spec)
    outputs = {
        n: sha256_file(staged(args.out, n))
        for n in ("probe.safetensors", "metrics.jsonl", "run_config.json")
    }
    for n, h in output_hashes(staged(args.out, "model")).items():
        outputs[f"model/{n}"] = h
    final = staged(args.out, "final_checkpoint")
    prov = record(
        "train",
        args.out,
        spec,
        {"shards": args.shards, "model": args.model, "deepspeed": args.deepspeed},
        outputs,
        hosts={h.name: h.read_text() for h in hosts},
        device="cuda" if torch.cuda.is_available() else "cpu",
        final_checkpoint_bytes=sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
        shards_manifest_sha256=sha256_file(args.shards / "manifest.json"),
    )
    write_json(staged(args.out, "provenance.json"), prov)
    names = (*WORKER_OUTPUTS, "run_config.json", "provenance.json")
    publish([(staged(args.out, n), args.out / n) for n in names])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(run(main))
