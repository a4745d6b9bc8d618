"""KTO on labelled responses (a dataset of format ``labelled``: prompt, completion, label):
their tokens, their reference log-probs from the reference stage, and KTO's loss on them
written out by hand. KTO on preference pairs, its 2-node runs and its chain are in
tests/test_dpo.py."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT
from oracles import kto_loss, summed_logp
from test_tokenize import oracle, run_tokenize

from snaketune.core.errors import ConfigError, DataError
from snaketune.plan.config import validate_config

SPEC = {"format": "labelled"}
LABELLED = [
    {"prompt": "What is 2 + 3?", "completion": "2 + 3 = 5.\n#### 5", "label": True},
    {"prompt": "What is 2 + 3?", "completion": "#### 6", "label": False},
    {"prompt": "Name a colour.", "completion": "Blue, like a clear sky at noon.", "label": True},
    {"prompt": "Count to three.", "completion": "one, two", "label": False},
    {"prompt": "Say hi.", "completion": "Hi there!", "label": True},
]


def test_labelled_responses_tokenize_with_their_label_and_only_the_completion_labelled(
    tmp_path, tiny_model, tokenizer
):
    """Each row is one response: rendered with the chat template as apply_chat_template
    renders it, labels on the completion only, its label in ``desirable``; the text hash
    tells the same text with another label apart. Messages work as TRL's conversational
    form (prompt and completion as lists of turns)."""
    rows, stats = run_tokenize(tmp_path, "lab", SPEC, LABELLED, tiny_model)
    assert stats.rows == len(LABELLED) == len(rows)
    assert [r["desirable"] for r in rows] == [x["label"] for x in LABELLED]
    for row, x in zip(rows, LABELLED, strict=True):
        ids, labels = oracle(tokenizer, [("user", x["prompt"]), ("assistant", x["completion"])])
        assert row["input_ids"] == ids and row["labels"] == labels
    assert len({r["text_sha"] for r in rows}) == len(rows)
    turns = [{"prompt": [{"role": "user", "content": x["prompt"]}],
              "completion": [{"role": "assistant", "content": x["completion"]}],
              "label": x["label"]} for x in LABELLED]  # fmt: skip
    again, _ = run_tokenize(tmp_path, "turns", SPEC, turns, tiny_model)
    assert [(r["input_ids"], r["labels"], r["desirable"]) for r in again] == [
        (r["input_ids"], r["labels"], r["desirable"]) for r in rows
    ]


def test_a_label_that_is_not_true_or_false_is_one_line(tmp_path, tiny_model):
    rows = [{**LABELLED[0], "label": "yes"}]
    with pytest.raises(DataError) as exc:
        run_tokenize(tmp_path, "bad", SPEC, rows, tiny_model)
    assert str(exc.value) == (
        "datasets.bad row 0: column 'label' must be true or false (got 'yes'); clean the data "
        "or filter the row out"
    )


def test_a_labelled_dataset_is_kto_s_and_refused_for_a_method_on_pairs():
    """A run of KTO on a labelled dataset validates; DPO on it is refused in one line naming
    the method that reads it."""
    from test_dpo import dpo_config

    config = dpo_config()
    config["datasets"]["lab"] = {"source": "local", "path": "x.jsonl", "format": "labelled"}
    kto = {**config["runs"]["p"], "method": "kto", "dataset": "lab"}
    del kto["dpo"]
    validate_config({**config, "runs": {**config["runs"], "p": kto}}, ROOT)
    config["runs"]["p"]["dataset"] = "lab"
    with pytest.raises(ConfigError) as exc:
        validate_config(config, ROOT)
    assert ("runs.p.dataset: 'lab' is a labelled dataset (labelled responses), which only "
            "method kto train and evaluate on; set method: kto") in str(exc.value)  # fmt: skip


def test_kto_on_labelled_responses_equals_the_paper_s_loss_with_the_stage_s_reference(
    tmp_path, tiny_model, fixtures_dir
):
    """Labelled responses of different lengths, more desirable than not (the fixture's
    pairs' chosen answers, and some of their rejected ones): the reference stage scores
    each response once (its log-prob equals plain transformers' sum over the completion,
    1e-5); KTO on micro batches of 4 and 2 responses, a LoRA policy whose adapter is not
    zero, that reference and the KL sequences' from the base with the adapter off, equals
    KTO's loss written out (oracles.kto_loss, float64, weights 1 and 1.5)."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig

    from snaketune.evaluation.logps import compute_parts, merge, read_reference
    from snaketune.methods.kto import KTOCollator, trainer_class

    pairs = [json.loads(line) for line in
             (fixtures_dir / "gsm8k-demo/pairs-train.jsonl").read_text().splitlines()[:4]]  # fmt: skip
    made = [{"prompt": p["question"], "completion": p["chosen"], "label": True} for p in pairs]
    made += [{"prompt": p["question"], "completion": p["rejected"], "label": False}
             for p in pairs[:2]]  # fmt: skip
    rows, _ = run_tokenize(tmp_path, "lab", SPEC, made, tiny_model)
    tokenized = tmp_path / "lab.tok.parquet"
    assert compute_parts(tokenized, tiny_model, tmp_path / "parts", 0, 1, 4, "fp32", "sdpa") > 0
    merge(tokenized, tmp_path / "parts", tmp_path / "ref.parquet")
    assert pq.read_table(tmp_path / "ref.parquet").column_names == ["example_id", "ref_logps"]
    reference = read_reference(tmp_path / "ref.parquet")
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for r in rows:
        want = summed_logp(base, r["input_ids"], r["labels"])
        assert reference[r["example_id"]][0] == pytest.approx(want, rel=1e-5)

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear",
                                      init_lora_weights=False)).eval()  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tiny_model)
    beta, wd, wu = 0.5, 1.0, 1.5
    args = KTOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=beta,
                     desirable_weight=wd, undesirable_weight=wu, precompute_ref_log_probs=True,
                     per_device_train_batch_size=4, max_length=None, report_to=[],
                     gradient_checkpointing=False)  # fmt: skip
    table = datasets.Dataset.from_list(rows)
    collate = KTOCollator(table, tok.pad_token_id, reference, None)
    trainer = trainer_class()(model=model, args=args, processing_class=tok, train_dataset=table,
                              data_collator=collate, planned=None,
                              run={"micro_batch_size": 3})  # fmt: skip
    assert trainer.sequences == 1  # a labelled response is one example

    def loss_of(micro):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, collate(micro)).item()

    def partner(p):
        return rows[(rows.index(p) + 1) % len(rows)]

    split = [[rows[0], rows[4], rows[1], rows[2]], [rows[3], rows[5]]]  # 4 + 2: a step of 6
    want = kto_loss(model, base, [[m] for m in split], partner, beta, wd, wu)
    assert sum(loss_of(m) for m in split) / 2 == pytest.approx(want, rel=1e-5)
    assert kto_loss(model, base, [[m] for m in split], partner, beta) != pytest.approx(
        want, rel=1e-3)  # fmt: skip
