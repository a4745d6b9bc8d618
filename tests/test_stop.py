"""Tuned models that know when to stop: the chat template's end-of-turn token found and
checked at tokenize time, added to the exported models' generation_config when the base
model stops on another token (as Qwen base models do), and the evaluation's stop_rate."""

from __future__ import annotations

import json
import logging

from conftest import base_variant
from test_tokenize import LONG, QA, run_tokenize

from snaketune.data.chat import ChatRenderer
from snaketune.data.tokens import add_end_of_turn, end_of_turn_id, stop_ids


def test_the_end_of_turn_token_is_the_one_the_template_closes_an_assistant_turn_with(tokenizer):
    end = end_of_turn_id(tokenizer, ChatRenderer(tokenizer))
    assert tokenizer.convert_ids_to_tokens(end) == "<|im_end|>"
    llama3 = (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    )
    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    end = end_of_turn_id(tok, ChatRenderer(tok, llama3))
    assert tok.convert_ids_to_tokens(end) == "<|eot_id|>"
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    assert end_of_turn_id(tok, ChatRenderer(tok, plain)) is None  # no special token: no check


def test_tokenize_counts_turns_cut_before_their_end_and_says_so(tmp_path, tiny_model, caplog):
    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}
    _, stats = run_tokenize(tmp_path, "qa", spec, QA, tiny_model)
    assert stats.end_of_turn == "<|im_end|>" and stats.rows_without_end_of_turn == 0
    assert stats.model_stops_at_end_of_turn is True
    with caplog.at_level(logging.WARNING):
        _, stats = run_tokenize(tmp_path, "long", {"format": "prompt_response"}, LONG,
                                tiny_model, max_length=64, overlong="truncate")  # fmt: skip
    assert stats.rows_without_end_of_turn == 1  # the one truncated row that kept labels
    assert "1 of 2 examples' assistant turns do not end with <|im_end|>" in caplog.text


def test_an_export_whose_base_stops_elsewhere_gets_the_end_of_turn_added(tiny_model, tmp_path):
    model = base_variant(tiny_model, tmp_path / "base")
    eos, end = stop_ids(model)[0], 2
    assert stop_ids(model) == [eos] and eos != end
    done = add_end_of_turn(model)
    assert done == (f"generation_config eos_token_id [{eos}] -> [{eos}, {end}]: <|im_end|>, "
                    "which the chat template ends an assistant turn with, now stops generation")  # fmt: skip
    assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == [eos, end]
    assert add_end_of_turn(model) is None  # once is enough
