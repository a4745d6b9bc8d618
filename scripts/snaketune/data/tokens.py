"""A model's tokenizer as tokenize reads it: the tokenizer itself (fast, local files), its
vocabulary size, the token a chat template ends an assistant turn with and what the model's
generation config stops on (and the exports' fix when the two differ), and the token a
character of a rendered text falls in.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from snaketune.core.errors import DataError
from snaketune.data.chat import ChatRenderer, _sentinel


def renderer_for(model_dir: Path, template: str | None):
    """The ChatRenderer tokenize builds for a model (its tokenizer, ``template`` or its own,
    its stop token)."""
    tokenizer = load_tokenizer(model_dir)
    stops = stop_ids(model_dir)
    stop = tokenizer.convert_ids_to_tokens(stops[0]) if stops else None
    return ChatRenderer(tokenizer, template, stop=stop)


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


def load_tokenizer(model_dir: str | Path):
    """The model's fast tokenizer (local files only)."""
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
