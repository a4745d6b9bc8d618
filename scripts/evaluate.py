"""Evaluate a model on a held-out tokenized eval set with the figures that fit it: loss and
perplexity; exact match and math_verify for numeric answers, chrF (and normalized exact
match) for free text; preference figures for pairs; the user's metrics (--metrics).

    python scripts/evaluate.py --model results/demo/merged_model \
        --eval results/tokenized/EVALKEY/data.parquet --train results/tokenized/KEY/data.parquet \
        --base-metrics results/base_eval/EVALKEY/metrics.json --out results/demo/eval \
        --max-new-tokens 256 --batch-size 8

With --lm-eval, also runs those lm-evaluation-harness tasks (metrics.json's lm_eval).
With --nodes/--gpus-per-node over 1 process in all, the model is sharded over that many
workers (DeepSpeed ZeRO-3, snaketune.evaluation.sharded), started by the train job's
launcher (snaketune.train.agents) with heartbeats and the stall watch; rank 0 writes.
Writes metrics.json, samples.jsonl (prompt, reference, generation, parsed answer,
correct) and provenance.json. With --train, fails first if any eval example is a training
example. With --base-metrics, adds the base model's figures and the gain over them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from snaketune.app.cli import run


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """The workers of a sharded evaluation, through the shared launcher; their heartbeats
    and the stall watch's verdict under ``<out>.workers/``, removed once the stage is done."""
    from snaketune.evaluation.logps import threads_per_worker
    from snaketune.plan.schema import run_default
    from snaketune.train.agents import Workers, choose_launcher, start, worker_environment

    watched = args.out.with_name(args.out.name + ".workers")
    timeout = args.timeout_minutes or run_default("timeout_minutes")
    workers = Workers([str(Path(__file__).resolve()), *argv, "--worker"], args.nodes,
                      args.gpus_per_node, f"evaluate-{args.out.parent.name}-{args.out.name}",
                      "evaluate", watched, watched, timeout * 60)  # fmt: skip
    env = worker_environment()
    here = choose_launcher(workers.launcher, args.nodes, workers.rule) == "local"
    env["OMP_NUM_THREADS"] = str(threads_per_worker(
        args.nodes * args.gpus_per_node if here else args.gpus_per_node))  # fmt: skip
    code, signalled = start(workers, env)
    if code != 0:
        from snaketune.core.heartbeat import stall_verdict

        why = stall_verdict(watched) or (f"stopped by {signalled}" if signalled else None)
        print(f"error: a worker of the evaluation failed (exit {code})"
              + (f": {why}" if why else ""), file=sys.stderr)  # fmt: skip
        return code
    shutil.rmtree(watched, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="model directory to evaluate")
    parser.add_argument("--eval", type=Path, required=True, help="tokenized eval parquet")
    parser.add_argument("--train", type=Path, help="tokenized training parquet (overlap check)")
    parser.add_argument("--base-metrics", type=Path, help="the base model's metrics.json (gain)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--limit", type=int, default=None, help="first N eval examples (all by default)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest generation")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per batch")
    parser.add_argument(
        "--lm-eval", type=json.loads, default=None,
        help="lm-evaluation-harness settings as JSON (a run's eval.lm_eval block)",
    )  # fmt: skip
    parser.add_argument(
        "--method", default=None,
        help="the run's method (snaketune.methods): what its evaluation scores and leads with "
        "(none: a base model's evaluation)",
    )  # fmt: skip
    parser.add_argument(
        "--beta", type=float, default=None,
        help="the beta held-out pairs' implicit rewards against the base's are scored with",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, default=None,
        help="a model that scores (a reward model) from a causal one: its new head's seed, "
        "as its run's training drew it",
    )  # fmt: skip
    parser.add_argument(
        "--metrics", type=json.loads, default=None,
        help="the user's metrics as JSON (snaketune.evaluation.scorers.spec)",
    )  # fmt: skip
    parser.add_argument(
        "--adapter-base",
        type=Path,
        default=None,
        help="--model is a LoRA adapter (export.merged: false): its base",
    )
    parser.add_argument(
        "--teacher-topk",
        type=Path,
        default=None,
        help="a distilled model's teacher's top-k log-probs of the eval set (rule "
        "teacher_logps): the held-out KL to the teacher too",
    )
    parser.add_argument(
        "--teacher-model",
        type=Path,
        default=None,
        help="an on-policy distilled model's teacher: its NLL of the model's greedy "
        "completions (and of the base's) too (snaketune.evaluation.teacher_nll)",
    )
    parser.add_argument(
        "--tools", type=json.loads, default=None,
        help="a run with tools: its tools and their settings as JSON (the tool loop runs on "
        "each held-out prompt: snaketune.tools.tooluse.ToolLoop)",
    )  # fmt: skip
    parser.add_argument("--nodes", type=int, default=1, help="nodes the model is sharded over")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs of each node")
    parser.add_argument("--timeout-minutes", type=float, default=None,
                        help="a worker making no progress this long is named and the stage "
                        "ended (default: the schema's timeout_minutes)")  # fmt: skip
    parser.add_argument("--worker", action="store_true", help="(internal) one worker")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    sharded = args.nodes * args.gpus_per_node > 1
    if sharded and not args.worker:
        return launch(args, raw)
    from snaketune.core.qlora import hide_bitsandbytes, needs_bitsandbytes

    # a model saved unquantized loads without bitsandbytes: not imported (peft would, ~2 s)
    hide_bitsandbytes(args.adapter_base is not None or needs_bitsandbytes(args.model))
    from snaketune.core.imports import load, loading

    with loading():  # torch and transformers' models: no collections meanwhile
        from transformers.utils import logging as hf_logging

        from snaketune.core.provenance import NAME, output_hashes, record, write_provenance
        from snaketune.evaluation import teacher_nll
        from snaketune.evaluation.evaluate import evaluate, recorded_scores
        from snaketune.evaluation.scorers import scorer
        from snaketune.evaluation.sharded import Share

        load("transformers.modeling_utils")  # what loading a model imports

    hf_logging.disable_progress_bar()
    base = json.loads(args.base_metrics.read_text()) if args.base_metrics else None
    inputs = {"model": args.model, "eval": args.eval}
    inputs.update({"adapter_base": args.adapter_base} if args.adapter_base else {})
    inputs.update({"train": args.train} if args.train else {})
    inputs.update({"base_metrics": args.base_metrics} if args.base_metrics else {})
    inputs.update({"teacher_topk": args.teacher_topk} if args.teacher_topk else {})
    inputs.update({"teacher_model": args.teacher_model} if args.teacher_model else {})
    config = {"limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "batch_size": args.batch_size, "lm_eval": args.lm_eval}  # fmt: skip
    config.update({k: getattr(args, k) for k in ("method", "beta", "seed", "metrics", "tools")
                   if getattr(args, k) is not None})  # fmt: skip
    from snaketune.methods import method_named

    method = method_named(args.method) if args.method else None  # none: a base model's

    def finish(tmp: Path, _: dict) -> None:
        stage = "evaluate" if args.train else "evaluate_base"
        write_provenance(tmp / NAME, record(stage, args.out, config, inputs, output_hashes(tmp)))

    if args.tools and sharded:
        print(
            "evaluate: a run with tools is evaluated on one process; set eval.nodes and "
            "eval.gpus_per_node to 1 for it",
            file=sys.stderr,
        )
        return 2
    if method is not None and method.reward_model:  # it scores held-out pairs
        return reward(args, base, finish, sharded, method.headline)
    share, beat = Share.from_environ() if sharded else Share(), None
    base_samples = args.base_metrics.with_name("samples.jsonl") if args.base_metrics else None
    if sharded:
        from snaketune.core.heartbeat import Heartbeat
        from snaketune.core.runlock import die_with_parent

        die_with_parent()  # never outlive the agent that started it
        folder = args.out.with_name(args.out.name + ".workers") / "heartbeat"
        beat = Heartbeat(folder, share.rank, int(os.environ.get("GROUP_RANK", 0))).start()
    metrics = evaluate(
        args.model,
        args.eval,
        args.train,
        args.out,
        args.limit,
        args.max_new_tokens,
        args.batch_size,
        base,
        finish,
        args.lm_eval,
        recorded_scores(args.eval, args.base_metrics),
        args.beta,
        share,
        None if beat is None else beat.watch,
        args.adapter_base,
        method.headline if method is not None else (),
        teacher_nll.both(
            scorer(args.metrics, base_samples),
            teacher_nll.scorer(args.teacher_model, args.eval, base_samples),
        ),
        args.teacher_topk,
        tool_loop(args.tools),
    )
    if metrics is None:  # not rank 0
        return 0
    print(json.dumps({k: v["value"] for k, v in metrics["figures"].items()}))
    return 0


def tool_loop(settings: dict | None):
    """The evaluation's generation of a run with tools (None: plain generation)."""
    if not settings:
        return None
    from snaketune.tools.toolloop import ToolLoop

    return ToolLoop(settings)


def reward(args: argparse.Namespace, base: dict | None, finish, sharded: bool,
           first: tuple[str, ...]) -> int:  # fmt: skip
    """A reward model's evaluation: its held-out pairs' scores (one process)."""
    from snaketune.core.errors import UserError
    from snaketune.evaluation.reward_eval import evaluate_reward

    if sharded:
        raise UserError(f"{args.model}: a reward model is scored in one process; run with "
                        "--nodes 1 --gpus-per-node 1 (as the workflow plans it)")  # fmt: skip
    metrics = evaluate_reward(args.model, args.eval, args.train, args.out, args.limit,
                              args.batch_size, args.seed, base, finish,
                              args.adapter_base, first)  # fmt: skip
    print(json.dumps(metrics["preference"]))
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
