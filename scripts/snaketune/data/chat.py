"""Chat templates as tokenize reads them: a conversation rendered with the model's chat
template, with the character spans of its assistant turns (``ChatRenderer``); the token a
template ends an assistant turn with, and what the model's generation config stops on;
the model's tokenizer and vocabulary size.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

from snaketune.core.errors import DataError

log = logging.getLogger(__name__)


Turn = tuple[str, str]  # (role, content)

# Contents used to check that a template inserts message contents verbatim: padding,
# blank lines, markup and template syntax must all come out unchanged.
_PROBES = ("", " lead and trail \n", "a\n\nb\t", "<think>x</think>y", "{{ x }} {% y %}", "&<>'\"")


def _sentinel(i: int) -> str:
    return f"\ue000{i}\ue001"


class ChatRenderer:
    """Render conversations with a tokenizer's chat template and find the assistant spans.

    Rendering every row through jinja costs more than encoding it. Most templates insert
    message contents verbatim between fixed pieces of markup, so for each conversation
    shape (its sequence of roles) the renderer derives those pieces once, from a render
    with placeholder contents, checks them against real renders of probe contents, and
    then builds each row by concatenation. Templates that transform contents (trim,
    escape, drop reasoning) fail the check and every row is rendered by jinja.
    """

    def __init__(self, tokenizer, template: str | None = None):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = template or tokenizer.chat_template
        if not template:
            raise DataError(
                "the tokenizer has no chat template; "
                "set `chat_template:` (a Jinja file) on the model"
            )
        if isinstance(template, dict):  # named templates: use the default one
            template = template.get("default") or next(iter(template.values()))
        self.template = template
        self._compiled = _compile_jinja_template(template)
        # Template.render() copies the environment's globals into a new context on every
        # call; merge them once and hand jinja a ready context (what render() does next).
        self._base = {**self._compiled.globals, **tokenizer.special_tokens_map}
        self._layouts: dict[tuple[str, ...], tuple | None] = {}

    def render(
        self, turns: list[Turn] | tuple[Turn, ...], add_generation_prompt: bool = False
    ) -> str:
        """The template's text for ``turns`` (what apply_chat_template(tokenize=False) gives)."""
        messages = [{"role": r, "content": c} for r, c in turns]
        ctx = self._compiled.new_context(
            {**self._base, "messages": messages, "add_generation_prompt": add_generation_prompt},
            shared=True,
        )
        return self._compiled.environment.concat(self._compiled.root_render_func(ctx))

    def spans_slow(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """Text and assistant spans, by rendering every prefix through jinja."""
        text = self.render(turns)
        spans = []
        for i, (role, _) in enumerate(turns):
            if role != "assistant":
                continue
            gen = self.render(turns[:i], add_generation_prompt=True)
            through = self.render(turns[: i + 1]) if i + 1 < len(turns) else text
            if not (text.startswith(gen) and text.startswith(through) and len(gen) <= len(through)):
                raise DataError(
                    "the chat template renders a conversation differently from its prefixes, "
                    "so prompt tokens cannot be masked; use another template (`chat_template:`)"
                )
            spans.append((len(gen), len(through)))
        return text, spans

    def _pieces(self, roles: tuple[str, ...], gen: bool) -> list[str] | None:
        turns = [(r, _sentinel(i)) for i, r in enumerate(roles)]
        text = self.render(turns, add_generation_prompt=gen)
        pieces = []
        for i in range(len(roles)):
            head, sep, text = text.partition(_sentinel(i))
            if not sep or _sentinel(i) in text:
                return None
            pieces.append(head)
        return [*pieces, text]

    def _layout(self, roles: tuple[str, ...]) -> tuple | None:
        """Markup pieces of ``roles`` and of each assistant turn's prefixes, or None."""
        if roles in self._layouts:
            return self._layouts[roles]
        full = self._pieces(roles, gen=False)
        marks = []  # per assistant turn: (markup before its content, markup through its end)
        for i, role in enumerate(roles):
            if role == "assistant" and full is not None:
                gen = self._pieces(roles[:i], gen=True)
                through = self._pieces(roles[: i + 1], gen=False)
                if gen is None or through is None:
                    full = None
                    break
                marks.append((len("".join(gen)), len("".join(through)), i))
        layout = None if full is None else (full, marks)
        if layout is not None:
            for k, probe in enumerate(_PROBES):
                turns = tuple((r, f"{probe}{k}{j}") for j, r in enumerate(roles))
                if self._spans_fast(turns, layout) != self.spans_slow(turns):
                    layout = None
                    break
        self._layouts[roles] = layout
        return layout

    @staticmethod
    def _spans_fast(turns: tuple[Turn, ...], layout: tuple) -> tuple[str, list[tuple[int, int]]]:
        full, marks = layout
        parts = [full[0]]
        lengths = [0]
        for (_, content), piece in zip(turns, full[1:], strict=True):
            parts.append(content)
            parts.append(piece)
            lengths.append(lengths[-1] + len(content))
        spans = [(gen + lengths[i], through + lengths[i + 1]) for gen, through, i in marks]
        return "".join(parts), spans

    def spans(self, turns: tuple[Turn, ...]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans [start, end) of its assistant turns."""
        layout = self._layout(tuple(r for r, _ in turns))
        return self.spans_slow(turns) if layout is None else self._spans_fast(turns, layout)

    def check(self, turns: tuple[Turn, ...]) -> None:
        """Compare the fast path with jinja on one real conversation (a spot check per batch)."""
        layout = self._layout(tuple(r for r, _ in turns))
        if layout is not None and self._spans_fast(turns, layout) != self.spans_slow(turns):
            self._layouts[tuple(r for r, _ in turns)] = None
            log.warning(
                "chat template is not verbatim for this data; rendering every row with jinja"
            )


def end_of_turn_id(tokenizer, renderer: ChatRenderer) -> int | None:
    """The special token the chat template closes an assistant turn with (Qwen's and the
    demo's ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the first special token of the markup
    after an assistant message, within its turn. None when that markup has none."""
    turns = (("user", _sentinel(0)), ("assistant", _sentinel(1)))
    try:
        text, spans = renderer.spans_slow(turns)
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
    config = (GenerationConfig.from_pretrained(model_dir, local_files_only=True)
              if path.is_file() else GenerationConfig())  # fmt: skip
    config.eos_token_id = [*ids, end]
    config.save_pretrained(model_dir)
    name = tokenizer.convert_ids_to_tokens(end)
    return (f"generation_config eos_token_id {ids} -> {[*ids, end]}: {name}, which the chat "
            "template ends an assistant turn with, now stops generation")  # fmt: skip


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
