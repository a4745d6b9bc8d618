"""snaketune.data.tokens piece by piece, at its edges (quick): the checks after a tokenize
pass, the vocabulary read from config.json, the first token at a character, the tokenizer's
load and its refusals, the end-of-turn probe, the renderer's stop, a warning per fault.
The tokenize job's own tests are test_tokenize.py's and test_stop.py's."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
from conftest import failing_load

from snaketune.core.errors import DataError
from snaketune.data import tokens
from snaketune.data.conversations import Stats


def stats(**fields) -> Stats:
    return Stats(**{"rows": 3, "max_token_id": 5, **fields})


def test_the_checks_after_a_pass_refuse_only_what_training_cannot_use(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    check = tokens.check_result
    error = "".join(["er", "ror"])  # read from a config: equal to "error", another object
    over = {"dropped_overlong": 2, "longest_overlong": (900, "qa:7")}
    with pytest.raises(DataError, match=r"^2 examples are longer than max_length 512 "
                       r"\(overlong: error; the longest, qa:7, has 900 tokens\)"):  # fmt: skip
        check(stats(**over), 512, error, tmp_path, "m")
    for policy in ("drop", "truncate"):  # before and after "error" in order: neither refuses
        check(stats(**over), 512, policy, tmp_path, "m")
    check(stats(), 512, error, tmp_path, "m")  # nothing over: nothing to refuse
    with pytest.raises(DataError, match="^no example left after tokenizing: 4 rows read"):
        check(stats(rows=0, rows_read=4), 512, "drop", tmp_path, "m")
    check(stats(rows=0), 512, "drop", tmp_path, "m", whole=False)  # a part may hold none
    check(stats(rows=1), 512, "drop", tmp_path, "m")
    check(stats(max_token_id=999), 512, "drop", tmp_path, "m")
    for past in (1000, 1001):  # the vocabulary's size, and past it
        with pytest.raises(DataError, match=f"^models.m: the tokenizer makes token id {past} "
                           "but the model's vocab_size is 1000"):  # fmt: skip
            check(stats(max_token_id=int(str(past))), 512, "drop", tmp_path, "m")
    check(stats(max_token_id=10**6), 512, "drop", tmp_path / "none", "m")  # no config: no check


def test_the_vocabulary_is_the_models_or_its_text_models(tmp_path):
    for cfg, size in [({"vocab_size": 7}, 7), ({"vocab_size": 7, "text_config": {"vocab_size": 9}}, 7),
                      ({"text_config": {"vocab_size": 9}}, 9), ({"text_config": None}, None), ({}, None)]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert tokens.model_vocab_size(tmp_path) == size, cfg
    assert tokens.model_vocab_size(tmp_path / "none") is None


class Encoding:
    """An encoding's offsets, as the Rust tokenizer gives them: three tokens over
    "ab cd" + "efg" repeated, character 2 (a space) in none."""

    offsets = [(0, 2), (3, 5), (5, 8)]

    def char_to_token(self, char):
        return next((k for k, (a, b) in enumerate(self.offsets) if a <= char < b), None)

    def token_to_chars(self, tok):
        return self.offsets[tok]


def test_the_first_token_at_a_character_starts_there_or_after():
    enc, end = Encoding(), len("x" * 300)  # a text's length past the small ints
    at = {0: 0, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}  # 2: no token covers it
    assert {c: tokens.first_token_at(enc, c, 99, end) for c in at} == at
    assert tokens.first_token_at(enc, 299 + 1, 99, end) == 99  # the end of the text: all of it
    assert tokens.first_token_at(enc, 8, 99, 8) == 99
    assert tokens.first_token_at(enc, 9, 99, 8) == 99


def test_a_tokenizer_that_cannot_load_is_one_line_naming_the_first_line(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    asked = {}
    for exc, reason in [(OSError("no tokenizer.json\nsee the docs"), "no tokenizer.json"),
                        (ValueError(""), "ValueError"), (KeyError("llama9"), "'llama9'"),
                        (OSError("y" * 300), "y" * 200)]:  # fmt: skip
        monkeypatch.setattr(AutoTokenizer, "from_pretrained", failing_load(exc, asked))
        with pytest.raises(DataError) as info:
            tokens.load_tokenizer(tmp_path)
        assert f"{tmp_path}: cannot load its tokenizer ({reason}); the model directory" in str(
            info.value)  # fmt: skip
    assert asked == {"local_files_only": True}  # never the network: a compute node has none
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: SimpleNamespace())
    with pytest.raises(DataError, match="has no fast"):  # no is_fast at all: not a fast one
        tokens.load_tokenizer(tmp_path)


def test_the_end_of_turn_probe_and_the_renderers_stop(tiny_model, tmp_path, caplog):
    from snaketune.data.chat import ChatRenderer
    from snaketune.data.conversations import Source

    renderer = tokens.renderer_for(tiny_model, None)
    tok = renderer.tokenizer
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    assert tokens.end_of_turn_id(tok, renderer) == end
    # a tokenizer that adds a special token in front of every text: not in the turn's markup
    tok.backend_tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", start)])  # fmt: skip
    assert tokens.end_of_turn_id(tok, ChatRenderer(tok)) == end
    broken = SimpleNamespace(spans=lambda turns: 1 / 0)  # a template the probe cannot render
    assert tokens.end_of_turn_id(tok, broken) is None

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [end, start]  # the stop is the first of the model's stop ids
    (model / "generation_config.json").write_text(json.dumps(gen))
    assert tokens.renderer_for(model, None).stop == "<|im_end|>"
    spec = {"format": "messages"}
    made = Stats()
    renderer, _ = tokens.tokenizer_for(
        [Source("d", tmp_path / "d.jsonl", spec)], model, None, "m", made
    )
    assert (renderer.full_rows, renderer.stopped_rows) == (0, 0)  # the probe's row not counted
    assert made.end_of_turn == "<|im_end|>" and made.model_stops_at_end_of_turn is True
    with pytest.raises(DataError, match="^models.demo: .*cannot load its tokenizer"):
        tokens.tokenizer_for(
            [Source("d", tmp_path / "d.jsonl", spec)], tmp_path, None, "demo", Stats()
        )
    with caplog.at_level(logging.WARNING):
        tokens.check_end_of_turn(made, model, "m")
        assert "generation_config stops only" not in caplog.text
        made.model_stops_at_end_of_turn = False
        tokens.check_end_of_turn(made, model, "m")
        assert "models.m: the chat template ends an assistant turn with <|im_end|>" in caplog.text


def test_the_end_of_turn_added_keeps_the_rest_of_the_generation_config(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    end = tokens.end_of_turn_id(*(lambda r: (r.tokenizer, r))(tokens.renderer_for(model, None)))
    path = model / "generation_config.json"
    gen = {**json.loads(path.read_text()), "eos_token_id": [end + 1], "max_new_tokens": 77}
    path.write_text(json.dumps(gen))
    assert tokens.add_end_of_turn(model).startswith(f"generation_config eos_token_id [{end + 1}]")
    saved = json.loads(path.read_text())
    assert saved["eos_token_id"] == [end + 1, end] and saved["max_new_tokens"] == 77
    path.unlink()  # none: made, from config.json's stop ids
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eos_token_id": end + 1}))
    assert "-> [" in tokens.add_end_of_turn(model)
    assert end in json.loads(path.read_text())["eos_token_id"]


def test_the_end_of_turn_is_the_assistants_where_a_user_turn_ends_with_another(tokenizer):
    """A template whose user turn closes with a token of its own: the probe reads the
    markup after the assistant's message, not the user's."""
    from snaketune.data.chat import ChatRenderer

    tok = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|u|>", "<|u_end|>", "<|a|>", "<|a_end|>"]}
    )
    template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|u|>{{ m['content'] }}<|u_end|>"
        "{% else %}<|a|>{{ m['content'] }}<|a_end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|a|>{% endif %}"
    )
    end = tokens.end_of_turn_id(tok, ChatRenderer(tok, template))
    assert tok.convert_ids_to_tokens(end) == "<|a_end|>"


def test_the_end_of_turn_is_added_from_local_files_only(tiny_model, tmp_path, monkeypatch):
    """A compute node has no network: the export's tokenizer and generation config are read
    from its folder alone."""
    from transformers import AutoTokenizer, GenerationConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [7]}))
    asked = []
    for cls in (AutoTokenizer, GenerationConfig):
        real = cls.from_pretrained

        def local(path, *args, _real=real, **kwargs):
            asked.append(kwargs.get("local_files_only"))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", local)
    assert tokens.add_end_of_turn(model) and asked == [True, True]
