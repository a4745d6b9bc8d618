"""The offline fixtures: reproducible, tiny, and shaped like the real thing."""

from __future__ import annotations

import json
import re

from snaketune.app.fixtures import make_fixtures
from snaketune.core.io import sha256_tree


def test_fixtures_are_byte_for_byte_reproducible(fixtures_dir, tmp_path):
    make_fixtures(tmp_path)
    assert sha256_tree(tmp_path) == sha256_tree(fixtures_dir)


def test_tiny_llama_loads_and_is_tiny(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    assert model.config.model_type == "llama"
    n = sum(p.numel() for p in model.parameters())
    assert 150_000 <= n <= 300_000, n


def test_tokenizer_is_byte_level_bpe_with_specials_and_template(tokenizer):
    assert tokenizer.is_fast
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.chat_template
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    assert backend["model"]["type"] == "BPE"
    # byte-level BPE, numbers split into single digits first (as Llama 3 and Qwen do)
    steps = [p["type"] for p in backend["pre_tokenizer"]["pretokenizers"]]
    assert steps == ["Digits", "ByteLevel"]
    assert tokenizer.tokenize(" 1234")[-4:] == ["1", "2", "3", "4"]
    text = "Ünïcödé & emoji 🙂 round-trip"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gsm8k_like_splits(fixtures_dir):
    splits = {}
    for split in ("train", "test"):
        lines = (fixtures_dir / "gsm8k-demo" / f"{split}.jsonl").read_text().splitlines()
        splits[split] = [json.loads(line) for line in lines]
        for row in splits[split]:
            assert set(row) == {"question", "answer"}
            assert re.search(r"\n#### -?\d+$", row["answer"]), row["answer"]
    assert len(splits["train"]) == 512 and len(splits["test"]) == 64
    train_q = {r["question"] for r in splits["train"]}
    assert not train_q & {r["question"] for r in splits["test"]}


def test_arith_demo_splits_hold_out_number_pairs(fixtures_dir):
    """The demo's task: GSM8K-style questions, "#### a+b" answers without a carry, and no
    number pair of the test split in the train split."""
    pattern = re.compile(
        r"\w+ has (\d+) \w+\. She buys (\d) more\. How many \w+ does she have now\?"
    )
    pairs = {}
    for split in ("train", "test"):
        lines = (fixtures_dir / "arith-demo" / f"{split}.jsonl").read_text().splitlines()
        pairs[split] = set()
        for row in map(json.loads, lines):
            a, b = map(int, pattern.fullmatch(row["question"]).groups())
            assert row["answer"] == f"#### {a + b}" and a % 10 + b <= 9 and 10 <= a <= 94
            pairs[split].add((a, b))
        assert len(lines) == {"train": 2048, "test": 64}[split]
    assert len(pairs["test"]) == 64 and not pairs["test"] & pairs["train"]
