"""What a model outputs: next-token logits (a causal language model, head ``lm``) or one
score per sequence (a reward model, head ``score``: transformers' sequence-classification
head with one label, ``method: reward``), and the transformers class that loads each.

A reward model reads its score at the last real token of each sequence: transformers finds
it as the last token that is not ``config.pad_token_id``, so the config of every model
with a score head carries the tokenizer's pad id (its eos where it has no pad token, as
TRL's RewardTrainer does), set here when the head is made and saved with the model.
A causal model loaded as a reward model gets a new head, drawn from the run's seed, so the
training job, its evaluation of the starting model and a rerun all start from one head.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCORE_ARCHITECTURE = "ForSequenceClassification"  # the suffix of a score head's class name


def head_of(model_dir: Path) -> str:
    """``score`` when the saved model's class is a sequence classifier, else ``lm``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    names = config.get("architectures") or []
    return "score" if any(n.endswith(SCORE_ARCHITECTURE) for n in names) else "lm"


def generates(head: str) -> bool:
    """Whether a model with ``head`` generates text (``lm``; ``score``: one figure a sequence)."""
    return head == "lm"


def auto_class(head: str, model_dir: Path | None = None):
    """transformers' auto class that loads a model with ``head``: a vision-language base
    (its config.json has a ``vision_config``) as the whole model it is, vision tower and
    all (AutoModelForImageTextToText), which trains and generates on text alone."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if head == "score":
        return AutoModelForSequenceClassification
    if model_dir is not None and is_vision_language(model_dir):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def is_vision_language(model_dir: Path) -> bool:
    """Whether the saved model is a vision-language model (a ``vision_config`` beside its
    text model's)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def load(model_dir: Path, head: str, seed: int | None = None, **kwargs: Any):
    """``model_dir`` loaded with ``head`` (transformers' from_pretrained ``kwargs``). A
    score head on a causal model is new: drawn after seeding with ``seed``, its config
    given the pad id of the model's tokenizer (where the score is read; a saved reward
    model keeps its own)."""
    if head != "score":
        return auto_class(head, model_dir).from_pretrained(model_dir, **kwargs)
    from transformers import set_seed
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    new_head = head_of(model_dir) != "score"
    if new_head and seed is not None:
        set_seed(seed)
    with suppress_seqcls_warning():  # the causal model's lm_head unused, the score head new
        model = auto_class(head).from_pretrained(model_dir, num_labels=1, **kwargs)
    text = model.config.get_text_config()
    if new_head or text.pad_token_id is None:
        text.pad_token_id = pad_id_of(model_dir)
        if text.pad_token_id in eos_ids(text):
            log.info(
                "%s: the pad id is the eos id (%d): a sequence ending in it is scored at "
                "the token before it, in training and wherever the model is loaded",
                model_dir,
                text.pad_token_id,
            )
    if text.pad_token_id is None:
        raise ValueError(
            f"{model_dir}: a score head needs a pad token id (where the score is "
            "read); its tokenizer has neither a pad nor an eos token"
        )
    return model


def eos_ids(config) -> set[int]:
    """The eos ids of a model's config (one id or a list)."""
    ids = getattr(config, "eos_token_id", None)
    return set() if ids is None else {ids} if isinstance(ids, int) else set(ids)


def pad_id_of(model_dir: Path) -> int | None:
    """The pad id of the tokenizer saved in ``model_dir`` (its eos where it has no pad)."""
    from transformers import AutoTokenizer

    from snaketune.core.rows import pad_id

    return pad_id(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))


def adapter_head(adapter_config: dict[str, Any]) -> str:
    """The head a peft adapter was trained on: ``score`` for peft's SEQ_CLS task."""
    return "score" if adapter_config.get("task_type") == "SEQ_CLS" else "lm"


def added_shapes(head: str, model_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The weights a head adds to a causal model's (the score head's: one label by the
    hidden size); by the name the head's model gives them."""
    if head != "score":
        return {}
    text = model_config.get("text_config", model_config)
    return {"score.weight": (1, text["hidden_size"])}


def as_scorer(config, pad_token_id: int):
    """A causal model's config turned into its reward model's (in place): the sequence
    classifier's class, one label, the pad id the score is read at."""
    config.architectures = [
        a.replace("ForCausalLM", SCORE_ARCHITECTURE) for a in (config.architectures or [])
    ]
    config.num_labels = 1
    config.get_text_config().pad_token_id = pad_token_id
    return config
