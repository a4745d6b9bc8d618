"""The agent demo's fixtures (config/agent_demo.yaml), offline: a tiny Llama with Llama 3.2's
chat template (one whose tool calls TRL parses), tool-call transcripts to teach it the call
format, the questions GRPO trains on and the held-out ones.

The task: single-digit sums ("What is 3 plus 4?"), which a tiny model cannot work out by
itself but a calculator can. In the transcripts the assistant calls the calculator
(``add``, an environment's method: the environment reads the question) and answers with its
result for half of the questions, and answers by itself (a guess) for the other half: the
model SFT makes calls it for about half of them, and GRPO, rewarded for right answers,
learns to call it for all.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from snaketune.app.fixtures import FixtureSizes, _write_jsonl, build_model, build_tokenizer
from snaketune.core.io import atomic_paths

# How the demo's calculator is described to the model (transformers' get_json_schema of
# config/agent_demo/calculator.py's Calculator.add: a test checks they are the same).
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add the two numbers of the question.",
        "parameters": {"type": "object", "properties": {}},
        "return": {"type": "integer"},
    },
}
PHRASES = ("What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.")
SIZES = FixtureSizes(vocab_size=512, hidden_size=128, intermediate_size=256, layers=2)
# Llama 3.2's markup, special tokens of the tokenizer
MARKUP = [
    f"<|{name}|>"
    for name in (
        "begin_of_text",
        "start_header_id",
        "end_header_id",
        "eot_id",
        "eom_id",
        "python_tag",
    )
]


def questions() -> list[tuple[str, int]]:
    """Every question of the task and its answer (sums up to 9, in three phrasings)."""
    return [(p.format(a=a, b=b), a + b) for a in range(10) for b in range(10 - a) for p in PHRASES]


def transcript(question: str, answer: int, calls: bool, rng: random.Random) -> dict:
    """A messages row: the calculator called and its result given back, or a guess."""
    user = {"role": "user", "content": question}
    if not calls:
        said = [{"role": "assistant", "content": f"The answer is {rng.randint(0, 9)}."}]
    else:
        call = {"type": "function", "function": {"name": "add", "arguments": {}}}
        said = [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(answer)},
            {"role": "assistant", "content": f"The answer is {answer}."},
        ]
    return {"messages": [user, *said], "tools": json.dumps([ADD])}


def make_agent_fixtures(out: str | Path, seed: int = 75) -> dict[str, Path]:
    """Write agent-demo/ (transcripts, train and test questions) and tiny-agent/ under
    ``out``; both renamed into place once complete."""
    from trl.chat_template_utils import llama3_2_chat_template

    rng = random.Random(seed)
    every = questions()
    rng.shuffle(every)
    test, train = every[:24], every[24:]
    rows = [transcript(q, a, rng.random() < 0.5, rng) for q, a in train for _ in range(4)]
    rng.shuffle(rows)
    out = Path(out)
    data_dir, model_dir = out / "agent-demo", out / "tiny-agent"
    with atomic_paths(data_dir, model_dir) as (data_tmp, model_tmp):
        data_tmp.mkdir(parents=True)
        _write_jsonl(data_tmp / "transcripts.jsonl", rows)
        for name, split in (("train", train), ("test", test)):
            rows_of = [{"question": q, "answer": f"#### {a}"} for q, a in split]
            _write_jsonl(data_tmp / f"{name}.jsonl", rows_of)
        corpus = [json.dumps(r) for r in rows[:64]] + [llama3_2_chat_template]
        special = ("<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", MARKUP)
        tokenizer = build_tokenizer(corpus, SIZES.vocab_size, llama3_2_chat_template, special)
        model = build_model(tokenizer, SIZES)
        model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|eot_id|>")]
        model.save_pretrained(model_tmp, safe_serialization=True)
        tokenizer.save_pretrained(model_tmp)
    return {"model": model_dir, "data": data_dir}
