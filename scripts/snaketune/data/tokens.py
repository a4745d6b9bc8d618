"""A model's tokenizer as tokenize reads it: the tokenizer itself (fast, local files), its
vocabulary size, the token a chat template ends an assistant turn with and what the model's
generation config stops on (and the exports' fix when the two differ), the token a
character of a rendered text falls in; and a tokenize pass's result checked against them.
"""

from __future__ import annotations

import bisect
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError
from snaketune.data.chat import TEMPLATE_DATE, ChatRenderer, _sentinel, prints_date
from snaketune.data.kinds import kind_of_source

log = logging.getLogger(__name__)


def renderer_for(model_dir: Path, template: str | None, date: str = TEMPLATE_DATE):
    """The ChatRenderer tokenize builds for a model (its tokenizer, ``template`` or its own,
    its stop token, the day a dated template prints)."""
    tokenizer = load_tokenizer(model_dir)
    stops = stop_ids(model_dir)
    stop = tokenizer.convert_ids_to_tokens(stops[0]) if stops else None
    return ChatRenderer(tokenizer, template, stop=stop, date=date)


def tokenizer_for(
    sources: Sequence[Any],
    model_dir: str | Path,
    chat_template: str | None,
    model_name: str,
    stats: Any,
    date: str = TEMPLATE_DATE,
) -> tuple[ChatRenderer | None, Any]:
    """The renderer and the tokenizer of a tokenize pass over ``sources``
    (snaketune.data.conversations.Source), the template's end-of-turn token noted in
    ``stats``, and the day it prints where it prints one (``date``). The renderer is None
    where every source is documents: they need no chat template (a base model has none)."""
    try:
        if any(kind_of_source(s.spec).chat for s in sources):
            renderer = renderer_for(model_dir, chat_template, date)
            tokenizer = renderer.tokenizer
        else:
            renderer, tokenizer = None, load_tokenizer(model_dir)
    except DataError as exc:
        raise DataError(f"models.{model_name}: {exc}") from None
    if renderer is not None:
        if prints_date(renderer.template):
            stats.template_date = date
        stats.end_of_turn_id = end_of_turn_id(tokenizer, renderer)
        renderer.full_rows = renderer.stopped_rows = 0  # the probe's row is not the data's
    if stats.end_of_turn_id is not None:
        stats.end_of_turn = tokenizer.convert_ids_to_tokens(stats.end_of_turn_id)
        stats.model_stops_at_end_of_turn = stats.end_of_turn_id in stop_ids(model_dir)
    return renderer, tokenizer


def end_of_turn_id(tokenizer, renderer: ChatRenderer) -> int | None:
    """The special token the chat template closes an assistant turn with (Qwen's and the
    demo's ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the first special token of the markup
    after an assistant message, within its turn. None when that markup has none."""
    turns = (("user", _sentinel(0)), ("assistant", _sentinel(1)))
    try:
        text, spans = renderer.spans(turns)
    except Exception:  # noqa: BLE001 -- a template this probe cannot render: no check
        return None
    start, end = spans[0]
    after = text.find(_sentinel(1), start) + len(_sentinel(1))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for token in tokenizer.backend_tokenizer.encode(text[after:end], add_special_tokens=False).ids:
        if token in special:
            return token
    return None


def stop_ids(model_dir: str | Path) -> list[int]:
    """The ids plain ``generate`` stops on: generation_config.json's eos_token_id (else
    config.json's)."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            if value is not None:
                return [value] if isinstance(value, int) else list(value)
    return []


def add_end_of_turn(model_dir: Path) -> str | None:
    """Make plain ``generate`` of an exported model stop where its chat template ends an
    assistant turn: add that token to generation_config.json's eos_token_id when missing.
    Returns what was done, in words (None: nothing to do)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not tokenizer.chat_template:
        return None
    end = end_of_turn_id(tokenizer, ChatRenderer(tokenizer))
    ids = stop_ids(model_dir)
    if end is None or end in ids:
        return None
    path = model_dir / "generation_config.json"
    config = (
        GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        if path.is_file()
        else GenerationConfig()
    )
    config.eos_token_id = [*ids, end]
    config.save_pretrained(model_dir)
    name = tokenizer.convert_ids_to_tokens(end)
    return (
        f"generation_config eos_token_id {ids} -> {[*ids, end]}: {name}, which the chat "
        "template ends an assistant turn with, now stops generation"
    )


# tokenizer_config.json's classes that are transformers' plain fast tokenizer, the class
# AutoTokenizer makes of them: loaded as that class directly, which imports no torch
# (AutoTokenizer's module imports the model configs, and they torch)
PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str | Path):
    """The model's fast tokenizer (local files only), the class AutoTokenizer makes: a
    plain fast tokenizer without importing torch (a tokenize job has no use for it)."""
    try:
        named = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        named = {}
    if named.get("tokenizer_class") in PLAIN_FAST:
        from transformers import PreTrainedTokenizerFast as AutoTokenizer
    else:
        from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"{model_dir}: cannot load its tokenizer ({reason[:200]}); the model directory "
            "needs the tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from exc
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"{model_dir}: the tokenizer has no fast (Rust) version; snaketune needs one"
        )
    return tok


def model_vocab_size(model_dir: str | Path) -> int | None:
    """``vocab_size`` from a model's config.json (its text model's, for multimodal ones)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text(encoding="utf-8"))
    return cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def first_token_at(enc, char: int, n_tokens: int, text_len: int) -> int:
    """Index of the first token that starts at or after character ``char``."""
    if char >= text_len:
        return n_tokens
    tok = enc.char_to_token(char)
    if tok is None:  # a character no token covers: look at every offset
        return bisect.bisect_left([o[0] for o in enc.offsets], char)
    return tok + 1 if enc.token_to_chars(tok)[0] < char else tok


# ----------------------------------------------------------------------------- a pass's checks


def check_end_of_turn(stats: Any, model_dir: str | Path, model_name: str) -> None:
    """One warning line each: examples whose assistant turn does not end with the
    template's end-of-turn token (a model trained on them learns not to stop), and a model
    whose generation_config does not stop on that token (the exports add it)."""
    if stats.end_of_turn is None:
        return
    if stats.rows_without_end_of_turn:
        log.warning(
            "%d of %d examples' assistant turns do not end with %s (cut by max_length with "
            "overlong: truncate): the model learns less of when to stop; raise max_length or "
            "set overlong: drop",
            stats.rows_without_end_of_turn,
            stats.rows,
            stats.end_of_turn,
        )
    if not stats.model_stops_at_end_of_turn:
        log.warning(
            "models.%s: the chat template ends an assistant turn with %s (id %d), but the "
            "model's generation_config stops only on %s: a tuned model would run on to "
            "max_new_tokens; the exported models get %d added to eos_token_id",
            model_name,
            stats.end_of_turn,
            stats.end_of_turn_id,
            stop_ids(model_dir),
            stats.end_of_turn_id,
        )


def check_result(
    stats: Any,
    max_length: int,
    overlong: str,
    model_dir: str | Path,
    model_name: str,
    whole: bool = True,
) -> None:
    """After the pass, one line (DataError) for a result training cannot use: overlong
    examples under ``overlong: error``, nothing left (``whole``: of the set; a part may
    hold none: its set's index checks the parts together), token ids past the model's
    vocabulary."""
    if overlong == "error" and stats.dropped_overlong:
        tokens, example = stats.longest_overlong
        raise DataError(
            f"{stats.dropped_overlong} examples are longer than max_length {max_length} "
            f"(overlong: error; the longest, {example}, has {tokens} tokens); raise max_length "
            f"to {tokens} or set overlong: drop (leave them out) or truncate (cut them)"
        )
    if stats.rows == 0 and whole:
        raise DataError(
            f"no example left after tokenizing: {stats.rows_read} rows read, "
            f"{stats.rows_filtered_out} filtered out, {stats.dropped_overlong} longer than "
            f"max_length {max_length}, {stats.dropped_no_response} without response tokens; "
            "check filters, raise max_length or set overlong: truncate"
        )
    vocab = model_vocab_size(model_dir)
    if vocab is not None and stats.max_token_id >= vocab:
        raise DataError(
            f"models.{model_name}: the tokenizer makes token id {stats.max_token_id} but the "
            f"model's vocab_size is {vocab} (config.json), so training would index past the "
            "embeddings; use the tokenizer that belongs to the model, or resize its embeddings"
        )
