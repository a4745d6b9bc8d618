"""Offline fixtures: a tiny Llama model, a byte-level BPE tokenizer, and two datasets.

Everything is made from fixed seeds and local text, byte for byte the same on every run,
in a few seconds, so tests and the demo never touch the network::

    python scripts/make_fixtures.py --out resources/fixtures

Layout written under ``out``::

    tiny-llama/      config.json, generation_config.json, model.safetensors, tokenizer files
    gsm8k-demo/      train.jsonl, test.jsonl  ({"question", "answer"}; GSM8K's shape: a worked
                     answer with <<calculator>> marks and a "#### N" line); pairs-train.jsonl:
                     preference pairs as a user makes them from such answers, of 1 to 8
                     steps ({"question", "chosen": the worked answer, "rejected": a wrong
                     final number, the answer cut short, or a bare wrong number}: sides and
                     pairs of very different lengths)
    arith-demo/      train.jsonl, test.jsonl  (the demo's task, learnable by the tiny model in a
                     minute on two CPU cores: "Tina has 43 clips. She buys 5 more. ..." ->
                     "#### 48", two-digit plus one-digit sums without a carry; no number pair
                     of the test split is in the train split); pairs-train.jsonl,
                     pairs-test.jsonl: the same questions as preference pairs ({"question",
                     "chosen": the right sum, "rejected": a near miss}) for the DPO demo
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.core.io import atomic_paths

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAD, BOS, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"

NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina"]
ITEMS = ["clips", "apples", "books", "pencils", "marbles", "cookies", "stamps", "shells"]


@dataclass(frozen=True)
class FixtureSizes:
    """How big the fixtures are (defaults: the demo's)."""

    train_rows: int = 512
    test_rows: int = 64
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    tie_word_embeddings: bool = False
    # Std of the random weights. Wider than Llama's 0.02 so that a LoRA adapter over frozen
    # random embeddings and output layer can still make confident predictions (at 0.02 the
    # frozen output layer caps every logit near 1 and LoRA cannot learn the demo task).
    init_range: float = 0.1
    arith_train_rows: int = 2048
    arith_test_rows: int = 64


def _problem(rng: random.Random) -> dict[str, str]:
    """One grade-school word problem with a worked answer ending in ``#### N``."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{name} has {a} {item}. She buys {b} more. How many {item} does she have now?"
        ans = a + b
        work = f"{name} has {a} + {b} = <<{a}+{b}={ans}>>{ans} {item}."
    elif kind == 1:
        q = f"{name} packs {c} boxes with {b} {item} each. How many {item} are packed in total?"
        ans = b * c
        work = f"{c} boxes hold {c} * {b} = <<{c}*{b}={ans}>>{ans} {item}."
    else:
        total = a + b * c
        q = (
            f"{name} had {total} {item} and gave {c} friends {b} {item} each. "
            f"How many {item} are left?"
        )
        given = b * c
        ans = total - given
        work = (
            f"{name} gave away {c} * {b} = <<{c}*{b}={given}>>{given} {item}.\n"
            f"{total} - {given} = <<{total}-{given}={ans}>>{ans} {item} are left."
        )
    return {"question": q, "answer": f"{work}\n#### {ans}"}


def make_gsm8k_like(train_rows: int, test_rows: int, seed: int = 1234) -> dict[str, list[dict]]:
    """Train and test splits with no question in both."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for split, n in (("train", train_rows), ("test", test_rows)):
        while len(splits[split]) < n:
            row = _problem(rng)
            if row["question"] not in seen:
                seen.add(row["question"])
                splits[split].append(row)
    return splits


def _arith_question(rng: random.Random, a: int, b: int) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return {
        "question": f"{name} has {a} {item}. She buys {b} more. How many {item} does she have now?",
        "answer": f"#### {a + b}",
    }


def make_arith(train_rows: int, test_rows: int, seed: int = 4321) -> dict[str, list[dict]]:
    """The demo's learnable task: a two-digit count (units 0-4) plus 1-5 more, so no carry.
    The test split takes ``test_rows`` number pairs (one question each) that the train split
    never uses, so a tuned model's score there is arithmetic, not recall."""
    rng = random.Random(seed)
    pairs = [(10 * t + u, b) for t in range(1, 10) for u in range(5) for b in range(1, 6)]
    rng.shuffle(pairs)
    test_pairs, train_pairs = pairs[:test_rows], pairs[test_rows:]
    splits: dict[str, list[dict]] = {"test": [_arith_question(rng, a, b) for a, b in test_pairs]}
    seen: set[str] = set()
    splits["train"] = []
    while len(splits["train"]) < train_rows:
        row = _arith_question(rng, *rng.choice(train_pairs))
        if row["question"] not in seen:
            seen.add(row["question"])
            splits["train"].append(row)
    return splits


def near_miss(answer: int, rng: random.Random) -> int:
    """A wrong answer close to the right one: off by one, or its digits swapped."""
    digits = str(answer)
    if len(digits) == 2 and digits[0] != digits[1] and digits[1] != "0" and rng.random() < 0.5:
        return int(digits[::-1])
    return answer + rng.choice((-1, 1))


def make_arith_pairs(arith: dict[str, list[dict]], seed: int = 2718) -> dict[str, list[dict]]:
    """Preference pairs on the demo's questions: chosen the right sum, rejected a near miss
    (off by one or swapped digits), for the DPO demo (pairs-train, pairs-test)."""
    rng = random.Random(seed)
    out = {}
    for split, rows in arith.items():
        pairs = []
        for row in rows:
            right = int(row["answer"].removeprefix("#### "))
            pairs.append(
                {
                    "question": row["question"],
                    "chosen": row["answer"],
                    "rejected": f"#### {near_miss(right, rng)}",
                }
            )
        out[f"pairs-{split}"] = pairs
    return out


def _chain_problem(rng: random.Random, steps: int) -> dict[str, str]:
    """A word problem of ``steps`` purchases, one worked line each, then "#### N" (worked
    answers of 1 to 8 lines, as GSM8K's run)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have = rng.randint(2, 30)
    buys = [rng.randint(2, 20) for _ in range(steps)]
    q = f"{name} has {have} {item}. " + " ".join(
        f"{'Then she' if i else 'She'} buys {b} more." for i, b in enumerate(buys)
    )
    lines = []
    for b in buys:
        lines.append(f"She has {have} + {b} = <<{have}+{b}={have + b}>>{have + b} {item}.")
        have += b
    return {
        "question": f"{q} How many {item} does she have now?",
        "answer": "\n".join(lines) + f"\n#### {have}",
    }


def make_gsm8k_pairs(rows: int, seed: int = 1618) -> list[dict]:
    """Preference pairs from worked answers, as a user makes them: chosen the worked answer
    (1 to 8 lines); rejected the same work with a wrong final number, the work cut after its
    first line, or a bare wrong "#### N". The two sides, and the pairs, differ widely in
    length, so a token-balanced plan gives ranks unequal pair counts."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(rows):
        row = _chain_problem(rng, rng.randint(1, 8))
        work, final = row["answer"].rsplit("\n#### ", 1)
        wrong = near_miss(int(final), rng)
        rejected = rng.choice([f"{work}\n#### {wrong}", work.split("\n")[0], f"#### {wrong}"])
        pairs.append({"question": row["question"], "chosen": row["answer"], "rejected": rejected})
    return pairs


def _corpus(*datasets: dict[str, list[dict]]) -> list[str]:
    """Text the tokenizer is trained on: the train splits and the chat markup words."""
    lines = ["user assistant system", "Question Answer Instruction Input Response"]
    for splits in datasets:
        for row in splits["train"]:
            lines.append(row["question"])
            lines.append(row["answer"])
    return lines


def build_tokenizer(
    corpus: list[str],
    vocab_size: int,
    chat_template: str = CHAT_TEMPLATE,
    special: tuple[str, str, str, list[str]] = (BOS, EOS, PAD, []),
    plain: list[str] | None = None,
):
    """A byte-level BPE tokenizer (fast) with pad/eos tokens and a chat template. Numbers are
    split into single digits (as Llama 3's and Qwen's tokenizers do), so arithmetic is
    learnable digit by digit. ``special``: bos, eos, pad and further special tokens (a
    family's template markup); ``plain``: added tokens that are not special (``<think>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad, more = special

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(dict.fromkeys([pad, bos, eos, *more])),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=chat_template,
        model_max_length=2048,
    )


def build_model(tokenizer, sizes: FixtureSizes, seed: int = 0):
    """A randomly initialised Llama-architecture causal LM."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=sizes.tie_word_embeddings,
        initializer_range=sizes.init_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=False,
    )
    return model


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")


def make_fixtures(out: str | Path, sizes: FixtureSizes | None = None) -> dict[str, Path]:
    """Write the model and dataset fixtures under ``out``; return their paths.

    Both directories are built beside their final names and renamed into place once both
    are complete, so an interrupted run never leaves a fixture that looks complete.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    sizes = sizes or FixtureSizes()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # BPE training order independent of cores
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = make_gsm8k_like(sizes.train_rows, sizes.test_rows)
    arith = make_arith(sizes.arith_train_rows, sizes.arith_test_rows)

    data_dir, arith_dir, model_dir = out / "gsm8k-demo", out / "arith-demo", out / "tiny-llama"
    with atomic_paths(data_dir, arith_dir, model_dir) as (data_tmp, arith_tmp, model_tmp):
        gsm8k = {**splits, "pairs-train": make_gsm8k_pairs(256)}
        for directory, dataset in (
            (data_tmp, gsm8k),
            (arith_tmp, {**arith, **make_arith_pairs(arith)}),
        ):
            directory.mkdir()
            for split, rows in dataset.items():
                _write_jsonl(directory / f"{split}.jsonl", rows)
        tokenizer = build_tokenizer(_corpus(splits, arith), sizes.vocab_size)
        model = build_model(tokenizer, sizes)
        model.save_pretrained(model_tmp, safe_serialization=True)
        tokenizer.save_pretrained(model_tmp)
    return {"model": model_dir, "dataset": data_dir, "arith": arith_dir}


def make_sharded_fixture(
    out: str | Path, sizes: FixtureSizes, layout, seed: int = 0, packing: bool = True
) -> dict[str, Path]:
    """Fixtures plus their train split tokenized and sharded for ``layout`` (a shard.Layout):
    what a benchmark needs to start the train stage without the workflow."""
    from snaketune.data.conversations import Source
    from snaketune.data.shard import shard
    from snaketune.data.sources import download_dataset
    from snaketune.data.tokenization import tokenize

    out = Path(out)
    paths = make_fixtures(out / "fixtures", sizes)
    spec = {
        "source": "local",
        "path": str(paths["dataset"] / "train.jsonl"),
        "format": "prompt_response",
        "columns": {"prompt": "question", "response": "answer"},
    }
    data = download_dataset("fixture", spec, out / "dataset")
    tokenize([Source("fixture", data, spec)], paths["model"], out / "tokenized.parquet", 512)
    manifest = shard(out / "tokenized.parquet", out / "shards", layout, seed, packing)
    (out / "shards" / "manifest.json").write_text(json.dumps(manifest))
    return {"model": paths["model"], "shards": out / "shards"}


def demo_run_spec(root: str | Path, **overrides: Any) -> dict[str, Any]:
    """The demo config's run with ``overrides``, validated with its defaults filled (what the
    train rule passes as --run-spec): for benchmarks that start the train stage directly.
    A method that trains every weight drops the LoRA block; ``max_steps`` replaces
    ``epochs``."""
    from snaketune.methods import method_of
    from snaketune.plan.config import load_yaml, validate_config

    root = Path(root)
    config = load_yaml(root / "config" / "config.yaml")
    run = config["runs"]["demo"]
    if "max_steps" in overrides:
        del run["epochs"]
    run.update(overrides)
    if method_of(run).adapter == "full":
        run.pop("lora", None)
    return validate_config(config, root)["runs"]["demo"]


def run_train_stage(
    root: str | Path,
    spec: dict[str, Any],
    shards: Path,
    model: Path,
    out: Path,
    preset: str = "zero2",
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """scripts/train.py (torchrun agents, DeepSpeed, the whole stage) to the end; returns
    the metrics.jsonl records."""
    import subprocess
    import sys

    root = Path(root)
    deepspeed = root / "config" / "deepspeed" / f"{preset}.json"
    cmd = [
        sys.executable,
        str(root / "scripts" / "train.py"),
        "--run-spec",
        json.dumps(spec),
        "--shards",
        str(shards),
        "--model",
        str(model),
        "--deepspeed",
        str(deepspeed),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"train stage failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
