"""Evaluate a model on a held-out tokenized set: loss and perplexity over response tokens,
GSM8K-style exact match of greedy generations (the number after ``####``, as a string),
and ``math_verify`` accuracy: the generation's final answer (its ``####`` line, else its
last ``\\boxed{}``, else its last number) checked against the reference's by math-verify,
so ``$1,000``, ``1,000.00``, ``\\boxed{1000}`` and ``1000 dollars`` all match 1000.

The eval set is checked against the training set first, by example id and by text hash:
an eval example that was trained on fails the stage before any model is loaded.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from snaketune.core import parts
from snaketune.core.errors import DataError
from snaketune.core.io import write_outputs
from snaketune.core.rows import IGNORE_INDEX, pad_id, prompt_and_answer
from snaketune.data.kinds import Kind, kind_of_columns
from snaketune.data.shard import check_overlap
from snaketune.evaluation.answers import final_answer, last_boxed, math_verify_match, parse_answer
from snaketune.evaluation.generation import generate, stop_ids_of
from snaketune.evaluation.model import DTYPES, padded_logits, resolve_precision
from snaketune.evaluation.sharded import DUMMY, ONE, Share, load_sharded

log = logging.getLogger(__name__)


def load_examples(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The eval rows (and the columns of their kind: a preference pair's rejected side)."""
    kind = kind_of_columns(parts.names(path))
    table = parts.read_table(path, kind.read_columns)
    if limit is not None:
        table = table.slice(0, limit)
    rows = table.to_pylist()
    if not rows:
        raise DataError(f"{path}: the eval set is empty")
    return rows


def nll_sums(model, batch: list[dict], pad_id: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ``batch``'s response tokens, and their count (one
    forward pass, right-padded)."""
    labels = torch.full((len(batch), max(len(r["input_ids"]) for r in batch)), IGNORE_INDEX)
    for j, r in enumerate(batch):
        labels[j, : len(r["labels"])] = torch.tensor(r["labels"])
    logits = padded_logits(model, batch, pad_id)
    shift_logits, shift_labels = logits.float().cpu()[:, :-1], labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return nll.item(), int((shift_labels != IGNORE_INDEX).sum())


def heldout_loss(
    model, rows: list[dict], batch_size: int, pad_id: int, share: Share = ONE
) -> dict[str, float]:
    """Mean negative log-likelihood per response token, and its perplexity (over every
    rank's share: each rank runs as many forward passes)."""
    from snaketune.core.collective import gather_combined

    mine, total, count = share.mine(rows), 0.0, 0
    for b in range(share.batches(len(rows), batch_size)):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        t, c = nll_sums(model, batch or [DUMMY], pad_id)
        if batch:
            total, count = total + t, count + c
    total, count = gather_combined([total, float(count)], ("sum", "sum"))
    count = int(count)
    loss = total / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "response_tokens": count}


def score(
    rows: list[dict], generations: list[str], stopped: list[bool], tokenizer
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each generation against its reference with the figures that fit the references
    (snaketune.evaluation.figures: numeric answers, free text or both): the samples, and the
    figures over all of them (``exact_match`` and ``math_verify`` always: the held-out pass
    while training reads them)."""
    from snaketune.data.pictures import COLUMN
    from snaketune.evaluation.figures import answer_format, text_scores
    from snaketune.evaluation.thumbnails import SHOWN, shown, thumbnail

    samples, correct, verified, answers = [], 0, 0, 0
    for i, (r, text, ended) in enumerate(zip(rows, generations, stopped, strict=True)):
        prompt, answer = prompt_and_answer(r["input_ids"], r["labels"])
        reference = tokenizer.decode(answer, skip_special_tokens=True)
        want, got = parse_answer(reference), parse_answer(text)
        answers += want is not None
        ok = want is not None and got == want
        correct += ok
        final = final_answer(text)
        mv = math_verify_match(want or last_boxed(reference), final)  # GSM8K or MATH
        verified += mv
        samples.append(
            {
                "example_id": r["example_id"],
                "prompt": shown(tokenizer.decode(prompt)),
                "reference": reference,
                "generation": text,
                "parsed_answer": got,
                "reference_answer": want,
                "correct": ok,
                "final_answer": final,
                "math_verify": mv,
                "stopped": ended,
            }
        )
        if r.get(COLUMN) and i < SHOWN:  # a picture row: its pictures, small, for the report
            samples[-1]["pictures"] = [thumbnail(p) for p in r[COLUMN]]
    fmt = answer_format([s["reference"] for s in samples])
    figures = {
        "format": fmt,
        "exact_match": correct / len(rows),
        "math_verify": verified / len(rows),
        # generations that ended on a stop id of the model, not at max_new_tokens
        "stop_rate": sum(stopped) / len(rows),
        # references with a '#### <answer>' line: what exact match can score
        "reference_answers": answers,
    }
    if fmt != "numeric":  # free-text references: chrF (and normalized match if short)
        per, overlap = text_scores([s["reference"] for s in samples], generations)
        for sample, one in zip(samples, per, strict=True):
            sample.update(one)
        figures.update(overlap)
    return samples, figures


def against_base(metrics: dict[str, Any], base_metrics: dict[str, Any]) -> None:
    """Add the base model's figures and the gain over them, in place."""
    from snaketune.evaluation.figures import FAMILY, GENERATED

    keys = dict.fromkeys((*GENERATED, *FAMILY["mixed"], *FAMILY["documents"]))
    metrics["base"] = {k: base_metrics.get(k) for k in keys if k in base_metrics}
    metrics["gain"] = {
        k: metrics[k] - base_metrics[k]
        for k in ("exact_match", "math_verify", "bits_per_byte")
        if k in metrics and k in base_metrics
    }
    # one sign for every gain, as in ``figures``: tuned - base (a lower loss is negative)
    metrics["gain"]["loss"] = metrics["loss"] - base_metrics["loss"]
    if "tools" in metrics and "tools" in base_metrics:  # an agent's calls, base and tuned
        metrics["base"]["tools"] = base_metrics["tools"]
    if base_metrics.get("model"):  # the base model's path, or the run's it started from
        metrics["base"]["model"] = base_metrics["model"]
    mine, theirs = metrics.get("preference"), base_metrics.get("preference")
    if mine and theirs:
        # the starting model's implicit rewards against itself are all 0
        start = {
            "likelihood_accuracy": theirs["likelihood_accuracy"],
            "preference_accuracy": 0.0,
            "reward_margin": 0.0,
        }
        metrics["base"]["preference"] = start
        metrics["gain"].update(
            {
                f"preference_{k}" if k != "preference_accuracy" else k: mine[k] - v
                for k, v in start.items()
                if k in mine
            }
        )


def scorer(kind: Kind) -> ModuleType | None:
    """The module scoring a kind's held-out examples beyond the loss (None: none), by the
    name its kind gives them (``Kind.heldout``)."""
    from snaketune.evaluation import preference

    return {"preference": preference}.get(kind.heldout or "")


def recorded_scores(eval_tokenized: Path, base_metrics: Path | None) -> dict[str, Any] | None:
    """What the starting model's evaluation (``base_metrics``) recorded of the scores the
    eval rows' kind gives (a pair's log-probs, by example id); None for none."""
    own = scorer(kind_of_columns(parts.names(eval_tokenized)))
    if base_metrics is None or own is None:
        return None
    return own.recorded(base_metrics.with_name("samples.jsonl"))


def scored(
    model,
    tokenizer,
    rows: list[dict],
    batch_size: int,
    max_new_tokens: int,
    share: Share,
    teacher: Path | None = None,
    generator: Callable | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The loss, the generations scored and what the rows' kind scores of its own (a pair's
    log-probs), every rank on its share; the figures and samples of all of them, in the
    eval set's order, on rank 0 (empty on the others). ``teacher``: a teacher's top-k of the
    rows (snaketune.evaluation.topk), the held-out KL to it too. ``generator``: what
    generates in place of ``generate`` (a run with tools: snaketune.tools.tooluse.ToolLoop,
    whose ``finish(samples, metrics)`` adds its own)."""
    pad = pad_id(tokenizer)
    metrics: dict[str, Any] = heldout_loss(model, rows, batch_size, pad, share)
    if teacher is not None:
        from snaketune.evaluation.topk import heldout_kl

        metrics.update(heldout_kl(model, rows, teacher, batch_size, pad, share))
    kind = kind_of_columns(rows[0])
    if not kind.generates:  # documents: no prompt to generate from; the kind's figures
        if share.rank != 0:
            return {}, []
        metrics.update(kind.impl().held_out_figures(metrics, rows))
        return metrics, []
    calls = share.batches(len(rows), batch_size) if share.world > 1 else None
    gen = generator or generate
    texts, stopped = gen(model, tokenizer, share.mine(rows), batch_size, max_new_tokens, calls)
    mine: list[tuple] = list(zip(texts, stopped, strict=True))
    if (own := scorer(kind)) is not None:
        mine = [
            (*m, lp)
            for m, lp in zip(mine, own.logps(model, rows, batch_size, pad, share), strict=True)
        ]
    every = share.in_order(mine)
    if every is None:
        return {}, []
    samples, figures = score(rows, [e[0] for e in every], [e[1] for e in every], tokenizer)
    metrics.update(figures)
    if hasattr(gen, "finish"):
        gen.finish(samples, metrics)
    for sample, e in zip(samples, every, strict=True):
        if len(e) == 3:
            sample.update(own.sample_fields(e[2]))
    return metrics, samples


def load_model(model_dir: Path, share: Share = ONE, base: Path | None = None):
    """The tokenizer and the model to evaluate: on a GPU node there, in bf16 (fp16 without
    bf16 support); on CPU in fp32. ``base``: ``model_dir`` is a LoRA adapter (a run with
    export.merged: false), loaded on that base as the run trained it. Over several
    processes, sharded (the third value keeps transformers' view of the DeepSpeed config
    alive; None for one process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketune.core import qlora
    from snaketune.core.errors import UserError

    dtype = DTYPES[resolve_precision("auto")]
    quantized = base is not None and qlora.read_record(model_dir) is not None
    if share.world > 1:
        if quantized:
            raise UserError(
                f"{model_dir}: the adapter of a 4-bit run is evaluated on its 4-bit "
                "base on one GPU (it holds the model that GPU would hold); set "
                "eval.nodes and eval.gpus_per_node to 1 for this run"
            )
        return load_sharded(model_dir, dtype, base)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if base is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        return tokenizer, model.to(device).eval(), None
    return tokenizer, adapter_model(model_dir, base, dtype, device), None


def adapter_model(adapter: Path, base: Path, dtype, device: str):
    """A LoRA run's adapter on its base, in eval mode on ``device``: the base in ``dtype``,
    or (a 4-bit run: the adapter's quantization record) in 4 bits as the run loaded it, so
    each layer computes with the dequantized weight the run trained with."""
    from transformers import AutoModelForCausalLM

    from snaketune.core import qlora
    from snaketune.core.lora_targets import load_adapter
    from snaketune.evaluation.model import build_model

    record = qlora.read_record(adapter)
    if record is None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, local_files_only=True)
        model.to(device)
    else:
        name = {v: k for k, v in DTYPES.items()}[dtype]
        model = build_model(base, name, "sdpa", quantize=record, device=device)
        model.config.use_cache = True  # build_model sets it off: training reads no KV cache
    return load_adapter(model, adapter).eval()  # the targets as the run made them


def evaluate(
    model_dir: Path,
    eval_tokenized: Path,
    train_tokenized: Path | None,
    out_dir: Path,
    limit: int | None,
    max_new_tokens: int,
    batch_size: int,
    base_metrics: dict[str, Any] | None = None,
    finish: Callable[[Path, dict[str, Any]], None] | None = None,
    lm_eval: dict[str, Any] | None = None,
    base_pairs: dict[str, tuple[float, float]] | None = None,
    beta: float | None = None,
    share: Share = ONE,
    on_loaded: Callable[[Any], None] | None = None,
    adapter_base: Path | None = None,
    first: Sequence[str] = (),
    user_scores: Callable[[list[dict[str, Any]], dict[str, Any]], list[str]] | None = None,
    teacher: Path | None = None,
    generator: Callable | None = None,
) -> dict[str, Any] | None:
    """Write ``metrics.json`` and ``samples.jsonl`` under ``out_dir``; return the metrics.
    With ``share`` of several processes every one calls this: the model is sharded over them
    (snaketune.evaluation.sharded), rank 0 writes and returns the metrics, the others None;
    ``on_loaded(model)`` runs once it is loaded (a heartbeat); ``adapter_base``: ``model_dir``
    is an adapter on that base; ``base_metrics`` adds the base's figures and the gains;
    ``finish(tmp, metrics)`` runs on the complete directory before it is renamed into place;
    ``lm_eval`` (a run's eval.lm_eval settings) runs those lm-evaluation-harness tasks too.
    An eval set whose kind scores its rows (pairs) adds their scores to each sample and its
    figures (against ``base_pairs``, the starting model's, with ``beta``). ``first``: its
    method's headline; ``user_scores(samples, metrics)`` adds the user's metrics
    (snaketune.evaluation.scorers), returns their keys; ``teacher``: the teacher's top-k of
    the eval set (a distilled model's held-out KL to it); ``generator``: as ``scored``'s."""
    if train_tokenized is not None:
        check_overlap(train_tokenized, eval_tokenized)
    rows = load_examples(eval_tokenized, limit)
    tokenizer, model, _keep = load_model(model_dir, share, adapter_base)
    if on_loaded is not None:
        on_loaded(model)
    metrics, samples = scored(
        model, tokenizer, rows, batch_size, max_new_tokens, share, teacher, generator
    )
    if lm_eval:  # every rank runs the same requests (a sharded model's passes are collective)
        from snaketune.evaluation.lmeval import run_tasks, with_base

        tasks = run_tasks(model, tokenizer, lm_eval)
        metrics["lm_eval"] = with_base(tasks, (base_metrics or {}).get("lm_eval"))
    if share.rank != 0:  # rank 0 writes
        return None
    metrics.update(stop_ids=stop_ids_of(model, tokenizer), examples=len(rows))
    metrics.update(model=str(model_dir), max_new_tokens=max_new_tokens, processes=share.world)
    if (own := scorer(kind_of_columns(rows[0]))) is not None:
        metrics.update(own.figures(samples, base_pairs, beta))
    if base_metrics is not None:
        against_base(metrics, base_metrics)
    user = user_scores(samples, metrics) if user_scores is not None else []
    describe(metrics, first, user)
    write_outputs(out_dir, metrics, samples, finish)
    log.info("%s", said(metrics))
    return metrics


def said(metrics: dict[str, Any]) -> str:
    """The evaluation's line: each figure (with the base's), the stop ids, the examples."""
    figures = ", ".join(
        f"{k} {v['value']:.4g}" + (f" (base {v['base']:.4g})" if "base" in v else "")
        for k, v in metrics["figures"].items()
    )
    return f"{figures}; stop ids {metrics['stop_ids']}; {metrics['examples']} examples"


def describe(metrics: dict[str, Any], first: Sequence[str], user: Sequence[str]) -> None:
    """metrics.json's ``headline`` (the method's figures, the data's, the loss, the user's)
    and ``figures`` (every figure shown, headline first, with the base's), in place."""
    from snaketune.evaluation import figures

    metrics["headline"] = figures.headline(first, metrics["format"], user)
    keys = figures.shown(metrics, metrics["headline"])
    metrics["figures"] = figures.table(metrics, [*keys, *user])
