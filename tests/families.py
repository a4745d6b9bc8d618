"""The model families users fine-tune now, at tiny size: each built from transformers' own
config class (random weights, 2 layers, 64 wide; a vision-language family saved whole, its
vision tower included) and saved with its real chat template as the Hub publishes it, on a
byte-level tokenizer that holds the template's own special tokens.

Adding a family is one line of ``FAMILIES``: its model_type, its template (a copy under
tests/templates/, its source in tests/templates/SOURCES.md), the tokens its generation
config stops on, and the config fields that make it tiny.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parent / "templates"
# Every family: 2 layers, 64 wide, 4 heads of 16 (2 KV heads).
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
LINEAR = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],
}
EXPERTS = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"


@dataclass(frozen=True)
class Family:
    """One family: ``model_type``, its template file, the tokens its generation config stops
    on, the fields that make it tiny (a VLM's under ``text_config``/``vision_config``)."""

    model_type: str
    template: str
    stops: tuple[str, ...]
    fields: dict[str, Any] = field(default_factory=dict)
    thinking: bool = False  # the template renders a row's reasoning
    # a vision-language family's image processor (its PIL build: torchvision, which the
    # full processors need, has no CPU build here), saved beside the model, and its settings
    # for the tiny vision tower
    processor: str | None = None
    image_settings: dict[str, Any] = field(default_factory=dict)
    # the tokenizer's model-specific tokens its processor reads (Gemma 4's boi/eoi/image)
    model_tokens: dict[str, str] = field(default_factory=dict)
    # config.json's picture token ids, by the token they name
    token_ids: dict[str, str] = field(default_factory=dict)
    # the family's whole processor and its video processor (which needs torchvision)
    processor_class: str | None = None
    video_processor: str | None = None

    @property
    def vlm(self) -> bool:
        return "vision_config" in self.fields


FAMILIES = {
    "qwen3.5": Family("qwen3_5", "qwen3_5_think.jinja", ("<|im_end|>",), {
        "text_config": {**TEXT, **LINEAR},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "out_hidden_size": 64, "patch_size": 4, "num_position_embeddings": 64}},
        thinking=True, processor="Qwen2VLImageProcessorPil",
        image_settings={"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
                        "min_pixels": 16 * 16, "max_pixels": 32 * 32},
        token_ids={"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                   "vision_start_token_id": "<|vision_start|>",
                   "vision_end_token_id": "<|vision_end|>"},
        processor_class="Qwen3VLProcessor", video_processor="Qwen3VLVideoProcessor"),
    "gemma4": Family("gemma4", "gemma4_v5.jinja", ("<turn|>",), {
        "text_config": {**TEXT, "layer_types": ["sliding_attention", "full_attention"],
                        "sliding_window": 16, "hidden_size_per_layer_input": 8,
                        "global_head_dim": 16},
        "vision_config": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                          "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16},
        "audio_config": None}, thinking=True, processor="Gemma4ImageProcessorPil",
        image_settings={"patch_size": 16, "max_soft_tokens": 70, "pooling_kernel_size": 3},
        # as Gemma 4's tokenizer_config.json names them (its processor reads the audio ones
        # even for pictures)
        model_tokens={"image_token": "<|image|>", "boi_token": "<|image>",
                      "eoi_token": "<image|>", "video_token": "<|video|>",
                      "audio_token": "<|audio|>", "boa_token": "<|audio>",
                      "eoa_token": "<audio|>"},
        token_ids={"image_token_id": "<|image|>", "boi_token_id": "<|image>",
                   "eoi_token_id": "<image|>", "video_token_id": "<|video|>"},
        processor_class="Gemma4Processor", video_processor="Gemma4VideoProcessor"),
    "gpt-oss": Family("gpt_oss", "gptoss.jinja", ("<|return|>", "<|call|>"), {
        **TEXT, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"]}, thinking=True),
    "deepseek-v3": Family("deepseek_v3", "deepseekv3.jinja", ("<｜end▁of▁sentence｜>",), {
        **TEXT, **EXPERTS, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_group": 2,
        "topk_group": 1}),
    "qwen3-next": Family("qwen3_next", "qwen3_5_think.jinja", ("<|im_end|>",), {
        **TEXT, **EXPERTS, **LINEAR, "num_experts": 4, "shared_expert_intermediate_size": 32},
        thinking=True),
    "glm-4.5": Family("glm4_moe", "glm4moe.jinja", ("<|user|>", "<|observation|>"), {
        **TEXT, **EXPERTS, "n_routed_experts": 4, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}, thinking=True),
    "smollm3": Family("smollm3", "smollm3.jinja", ("<|im_end|>",), dict(TEXT)),
    "llama3": Family("llama", "llama3_2.jinja", ("<|eot_id|>",), dict(TEXT)),
}  # fmt: skip

# The template's own markup tokens: <|x|>, <|x>, <x|>, <｜x｜>, <x> and [gMASK]. Those with a
# bar are special (as the families' tokenizers mark them); <think>, <sop> and [gMASK] are not.
_TOKEN = re.compile(
    r"<[|｜][^<>\s'\"]{0,40}?[|｜]?>|<[^<>\s'\"|]{1,30}\|>|</?[a-z_]{2,20}>|\[gMASK\]"
)


def template_tokens(template: str) -> tuple[list[str], list[str]]:
    """(special, plain) markup tokens a template writes."""
    found = sorted(set(_TOKEN.findall(template)))
    special = [t for t in found if "|" in t or "｜" in t]
    return special, [t for t in found if t not in special]


def build_tokenizer(template: str, corpus: list[str]):
    """The demo's byte-level BPE tokenizer (snaketune.app.fixtures: digits split) holding
    ``template``'s markup tokens, with the template as its chat template."""
    from snaketune.app.fixtures import build_tokenizer as bpe

    special, plain = template_tokens(template)
    return bpe(corpus, 600, template, (BOS, EOS, PAD, special), plain)


def build(name: str, corpus: list[str], out: Path, seed: int = 0) -> Path:
    """Family ``name`` at tiny size, saved at ``out`` as the Hub ships it (config.json,
    generation_config.json, safetensors, tokenizer files with the chat template)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    family = FAMILIES[name]
    template = (TEMPLATES / family.template).read_text(encoding="utf-8")
    tokenizer = build_tokenizer(template, corpus)
    if family.model_tokens:
        tokenizer = with_model_tokens(tokenizer, family.model_tokens)
    vocab = len(tokenizer)
    fields = json.loads(json.dumps(family.fields))
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    text = fields["text_config"] if family.vlm else fields
    text.update(vocab_size=vocab, initializer_range=0.1, **ids)
    fields.update({k: tokenizer.convert_tokens_to_ids(t) for k, t in family.token_ids.items()})
    if "vocab_size_per_layer_input" in AutoConfig.for_model(family.model_type).to_dict().get(
        "text_config", {}
    ):
        text["vocab_size_per_layer_input"] = vocab
    config = AutoConfig.for_model(family.model_type, **fields)
    torch.manual_seed(seed)
    if family.vlm:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    stops = [tokenizer.convert_tokens_to_ids(t) for t in family.stops]
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, *stops],
        do_sample=False,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family.processor:
        import transformers

        getattr(transformers, family.processor)(**family.image_settings).save_pretrained(out)
    return out


def with_model_tokens(tokenizer, tokens: dict[str, str]):
    """``tokenizer`` holding ``tokens`` (special, added where missing) as its model-specific
    tokens (``tokenizer.boi_token``...), as a family's published tokenizer does."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    backend.add_special_tokens([t for t in tokens.values() if t not in tokenizer.get_vocab()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        chat_template=tokenizer.chat_template,
        model_max_length=tokenizer.model_max_length,
        model_specific_special_tokens=tokens,
    )


def processor(name: str, model_dir: Path, video: bool = True):
    """Family ``name``'s whole processor for the model saved at ``model_dir`` (its image
    processor and tokenizer, the template), with its video processor (torchvision: a GPU
    machine's) or, ``video`` false, without one (``no_video_check`` must be in force)."""
    import transformers
    from transformers import AutoTokenizer

    family = FAMILIES[name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parts = {
        "image_processor": getattr(transformers, family.processor).from_pretrained(model_dir),
        "tokenizer": tokenizer,
        "video_processor": getattr(transformers, family.video_processor)() if video else None,
    }
    if family.processor_class == "Gemma4Processor":  # its audio part: numpy only
        parts["feature_extractor"] = transformers.Gemma4AudioFeatureExtractor()
    return getattr(transformers, family.processor_class)(
        **parts, chat_template=tokenizer.chat_template
    )


def no_video_check(monkeypatch) -> None:
    """Let a processor be made without its video processor (whose class needs torchvision,
    which has no CPU build here): transformers checks each part's class, even an absent
    one's."""
    from transformers import processing_utils

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    monkeypatch.setattr(
        processing_utils.ProcessorMixin,
        "check_argument_for_proper_class",
        lambda self, name, arg: None if arg is None else check(self, name, arg),
    )


def chat_rows(questions: list[dict], reasoning: bool) -> list[dict]:
    """Two-exchange chat rows (system, user, assistant, user, assistant) from the demo's
    arithmetic questions; the assistant turns carry ``reasoning_content`` when ``reasoning``
    (on every other row)."""
    rows = []
    for i in range(0, len(questions) - 1, 2):
        a, b = questions[i], questions[i + 1]
        think = reasoning and (i // 2) % 2 == 0
        turns = [{"role": "system", "content": "Answer with the sum."}]
        for q in (a, b):
            turns.append({"role": "user", "content": q["question"]})
            answer = {"role": "assistant", "content": q["answer"]}
            if think:
                answer["reasoning_content"] = "Add the two numbers."
            turns.append(answer)
        rows.append({"messages": turns})
    return rows
