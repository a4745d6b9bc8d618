"""Preference tuning (method dpo): pair tokenization, the loss against TRL's and a hand
computation, the reference log-probs stage, and the demo chain (config/dpo_demo.yaml).

The slow tests share one pipeline (the ``dpo_chain`` fixture): on a copy of the demo and its
sft_demo (the ``sft_demo`` fixture, shared with the GRPO chain), DPO from it on 2 emulated nodes with its evaluation, and a
two-member beta sweep that reads the same reference log-probs."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import (
    ENV,
    ROOT,
    RUN_OF_TWO,
    chain_runs,
    ci_tier,
    kill_and_resume,
    kill_two_steps_on,
    launch_train,
    leaked_secrets,
    pipeline_spec,
    read_jsonl,
    snakemake,
    started,
    train_as_planned,
    write_jsonl,
)
from oracles import (
    dpo_sigmoid_loss,
    kto_loss,
    mean_nll,
    orpo_loss,
    planned_steps,
    simpo_loss,
    summed_logp,
)
from test_tokenize import oracle, run_tokenize

from snaketune.core.errors import ConfigError
from snaketune.core.rows import IGNORE_INDEX
from snaketune.plan.config import load_yaml, validate_config

OVERLAY = ROOT / "config" / "dpo_demo.yaml"
PAIRS = [
    {"question": f"What is {i} + 1?", "good": f"#### {i + 1}", "bad": f"#### {i + 2}"}
    for i in range(12)
]
SPEC = {"format": "preference",
        "columns": {"prompt": "question", "chosen": "good", "rejected": "bad"}}  # fmt: skip
# the fixture's pairs from GSM8K-style worked answers (snaketune.app.fixtures.make_gsm8k_pairs)
GSM8K_PAIRS = {"format": "preference", "columns": {"prompt": "question"}}


def chain_config() -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    overlay = load_yaml(OVERLAY)
    config["datasets"].update(copy.deepcopy(overlay["datasets"]))
    config["runs"].update(copy.deepcopy(overlay["runs"]))
    return validate_config(config, ROOT)


# ----------------------------------------------------------------------------- tokenization


def labelled(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]


def test_pair_tokens_share_the_prompt_and_label_each_response_only(tmp_path, tiny_model,
                                                                   tokenizer):  # fmt: skip
    rows, stats = run_tokenize(tmp_path, "pairs", SPEC, PAIRS, tiny_model)
    assert stats.rows == len(PAIRS) == len(rows)
    for row, pair in zip(rows, PAIRS, strict=True):
        # each side as apply_chat_template renders it, labels on the response's turn only
        for side, ids_key, labels_key in (("good", "input_ids", "labels"),
                                          ("bad", "rejected_input_ids", "rejected_labels")):  # fmt: skip
            ids, labels = oracle(tokenizer, [("user", pair["question"]), ("assistant", pair[side])])
            assert row[ids_key] == ids and row[labels_key] == labels
            assert tokenizer.decode(labelled(ids, labels)) == pair[side] + "<|im_end|>\n"
        # the prompt's tokens are the same on both sides and never labelled
        start = row["labels"].index(next(x for x in row["labels"] if x != IGNORE_INDEX))
        assert row["input_ids"][:start] == row["rejected_input_ids"][:start]
        assert set(row["labels"][:start]) == {IGNORE_INDEX}
        assert set(row["rejected_labels"][:start]) == {IGNORE_INDEX}
        assert row["length"] == len(row["input_ids"]) + len(row["rejected_input_ids"])


def test_conversational_pairs_in_both_of_trls_forms(tmp_path, tiny_model, tokenizer):
    """A prompt message list with assistant turns, and whole conversations sharing their
    prompt (no prompt column): the same tokens as the text form; a multi-turn prompt's own
    assistant turn is context, not labelled."""
    explicit = [{"prompt": [{"role": "user", "content": p["question"]}],
                 "chosen": [{"role": "assistant", "content": p["good"]}],
                 "rejected": [{"role": "assistant", "content": p["bad"]}]} for p in PAIRS]  # fmt: skip
    implicit = [{"chosen": e["prompt"] + e["chosen"], "rejected": e["prompt"] + e["rejected"]}
                for e in explicit]  # fmt: skip
    text, _ = run_tokenize(tmp_path, "text", SPEC, PAIRS, tiny_model)
    a, _ = run_tokenize(tmp_path, "explicit", {"format": "preference"}, explicit, tiny_model)
    b, _ = run_tokenize(tmp_path, "implicit", {"format": "preference"}, implicit, tiny_model)
    keys = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
    for x, y, z in zip(text, a, b, strict=True):
        assert [x[k] for k in keys] == [y[k] for k in keys] == [z[k] for k in keys]
    multi = [{"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "2+2?"}],
              "chosen": [{"role": "assistant", "content": "#### 4"}],
              "rejected": [{"role": "assistant", "content": "#### 5"}]}]  # fmt: skip
    (row,), _ = run_tokenize(tmp_path, "multi", {"format": "preference"}, multi, tiny_model)
    assert tokenizer.decode(labelled(row["input_ids"], row["labels"])) == "#### 4<|im_end|>\n"
    assert tokenizer.decode(labelled(row["rejected_input_ids"], row["rejected_labels"])) == (
        "#### 5<|im_end|>\n"
    )


def test_identical_empty_and_overlong_pairs_are_dropped_and_counted(tmp_path, tiny_model):
    rows = [*PAIRS[:4],
            {"question": "same?", "good": "#### 1", "bad": "#### 1"},
            {"question": "empty?", "good": "#### 1", "bad": "  "},
            # only the rejected side is long: overlong applies to the longer side
            {"question": "long?", "good": "#### 1", "bad": "#### " + "9" * 300}]  # fmt: skip
    out, stats = run_tokenize(tmp_path, "bad", SPEC, rows, tiny_model, max_length=64)
    assert [r["example_id"] for r in out] == [f"bad:{i}" for i in range(4)]
    assert (stats.dropped_identical_pair, stats.dropped_empty_pair, stats.dropped_overlong) == (
        1, 1, 1,
    )  # fmt: skip
    cut, stats = run_tokenize(tmp_path, "cut", SPEC, rows, tiny_model, max_length=64,
                              overlong="truncate")  # fmt: skip
    assert stats.truncated == 1 and len(cut) == 5
    assert max(len(r["rejected_input_ids"]) for r in cut) == 64


def test_pairs_in_the_hh_text_form_read_as_conversations(tmp_path, tiny_model, tokenizer):
    """Anthropic HH's form (whole "Human: ... Assistant: ..." strings, no prompt column): the
    turns both sides share become the prompt, as TRL's implicit prompt does; the same tokens
    as the text form, and a multi-turn row labels its last response only."""
    hh = [{"chosen": f"\n\nHuman: {p['question']}\n\nAssistant: {p['good']}",
           "rejected": f"\n\nHuman: {p['question']}\n\nAssistant: {p['bad']}"} for p in PAIRS]  # fmt: skip
    text, _ = run_tokenize(tmp_path, "text", SPEC, PAIRS, tiny_model)
    got, _ = run_tokenize(tmp_path, "hh", {"format": "preference"}, hh, tiny_model)
    keys = ("input_ids", "labels", "rejected_input_ids", "rejected_labels")
    for x, y in zip(text, got, strict=True):
        assert [x[k] for k in keys] == [y[k] for k in keys]
    multi = [{"chosen": "Human: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: #### 4",
              "rejected": "Human: hi\n\nAssistant: hello\n\nHuman: 2+2?\n\nAssistant: #### 5"}]  # fmt: skip
    (row,), _ = run_tokenize(tmp_path, "hh_multi", {"format": "preference"}, multi, tiny_model)
    ids, labels = oracle(tokenizer, [("user", "hi"), ("assistant", "hello"), ("user", "2+2?"),
                                     ("assistant", "#### 4")])  # fmt: skip
    assert row["input_ids"] == ids
    assert tokenizer.decode(labelled(row["input_ids"], row["labels"])) == "#### 4<|im_end|>\n"
    assert tokenizer.decode(labelled(row["rejected_input_ids"], row["rejected_labels"])) == (
        "#### 5<|im_end|>\n"
    )


# ----------------------------------------------------------------------------- loss


def test_pair_batch_labels_written_out_by_hand():
    """Two pairs of unequal lengths: chosen sides first, then rejected, right-padded; the
    scored tokens are each side's labelled ones, its last response token included."""
    from snaketune.data.pairs import pair_batch

    x = IGNORE_INDEX
    pairs = [{"input_ids": [5, 6, 7, 8], "labels": [x, x, 7, 8],
              "rejected_input_ids": [5, 6, 9], "rejected_labels": [x, x, 9]},
             {"input_ids": [4, 3, 2, 1, 11], "labels": [x, x, x, 1, 11],
              "rejected_input_ids": [4, 3, 2, 12, 13, 14], "rejected_labels": [x, x, x, 12, 13, 14]}]  # fmt: skip
    got = {k: v.tolist() for k, v in pair_batch(pairs, pad_token_id=0).items()}
    assert got["input_ids"] == [[5, 6, 7, 8, 0, 0], [4, 3, 2, 1, 11, 0],
                                [5, 6, 9, 0, 0, 0], [4, 3, 2, 12, 13, 14]]  # fmt: skip
    assert got["attention_mask"] == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0],
                                     [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]  # fmt: skip
    assert got["completion_mask"] == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0],
                                      [0, 0, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]]  # fmt: skip


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_dpo_loss_of_hand_computed_pairs_equals_trls(tmp_path, tiny_model, loss_type):
    """TRL's DPOTrainer on our pair batches (snaketune.data.pairs.pair_batch, the reference
    log-probs given as precomputed) against the loss written out by hand from full-logit
    log-probs: equal to 1e-6."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from snaketune.data.pairs import pair_batch

    rows, _ = run_tokenize(tmp_path, "pairs", SPEC, PAIRS, tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    batch = pair_batch(rows[:6], tok.pad_token_id)
    ref_c = torch.tensor([-3.0, -1.5, -2.0, -4.0, -0.5, -2.5])
    ref_r = torch.tensor([-2.0, -2.5, -1.0, -4.5, -3.5, -0.5])
    batch.update(ref_chosen_logps=ref_c, ref_rejected_logps=ref_r)
    beta = 0.3
    args = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=beta,
                     loss_type=[loss_type], precompute_ref_log_probs=True, max_length=None,
                     report_to=[], gradient_checkpointing=False)  # fmt: skip

    class Given(DPOTrainer):
        def _prepare_dataset(self, dataset, *a, **k):
            return dataset

        def _precompute_ref_logps(self, dataset, *a, **k):
            return dataset

    import datasets

    trainer = Given(model=model, args=args, processing_class=tok,
                    train_dataset=datasets.Dataset.from_list(rows[:6]))  # fmt: skip
    trainer.model.train()
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, batch).item()
        # each side's log-prob from its tokenized row alone (not from the batch's masks)
        c = torch.tensor([summed_logp(model, x["input_ids"], x["labels"]) for x in rows[:6]])
        r = torch.tensor([summed_logp(model, x["rejected_input_ids"], x["rejected_labels"])
                          for x in rows[:6]])  # fmt: skip
        delta = (c - ref_c) - (r - ref_r)
        if loss_type == "sigmoid":
            hand = -F.logsigmoid(beta * delta).mean()
        elif loss_type == "hinge":
            hand = torch.relu(1 - beta * delta).mean()
        else:  # ipo: per-token averages (TRL's normalisation, confirmed with the authors)
            n_c = torch.tensor([sum(x != IGNORE_INDEX for x in e["labels"]) for e in rows[:6]])
            n_r = torch.tensor([sum(x != IGNORE_INDEX for x in e["rejected_labels"])
                                for e in rows[:6]])  # fmt: skip
            d = (c - ref_c) / n_c - (r - ref_r) / n_r
            hand = ((d - 1 / (2 * beta)) ** 2).mean()
    # fp32 sums against float64 ones: measured 5.5e-7 relative at worst
    assert trl_loss == pytest.approx(hand.item(), rel=1e-6, abs=1e-7)
    assert math.isfinite(trl_loss)


def test_unequal_micro_batches_give_the_global_batch_mean(tmp_path, tiny_model, fixtures_dir):
    """A step of 4 pairs on 2 ranks whose token-balanced plan gave one rank 3 pairs and the
    other 1 (micro_batch_size 2): the ranks' losses averaged (as DeepSpeed averages their
    gradients) are the DPO loss of the 4 pairs, written out by hand from plain transformers
    log-probs (float64). Measured 1.7e-6 relative: TRL sums each side's log-probs (up to
    ~100 tokens, ~-300) in float32; bound 1e-5. Unweighted, the ranks' mean is 5e-2 off."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from snaketune.data.pairs import pair_batch
    from snaketune.methods.pair_trainer import trainer_class

    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    rows, _ = run_tokenize(tmp_path, "gsm8k_pairs", GSM8K_PAIRS, path, tiny_model)
    # four pairs of different lengths, the longest first: the plan's rank of 3 and of 1
    pairs = sorted({r["length"]: r for r in rows}.values(), key=lambda r: -r["length"])[:4]
    assert len({r["length"] for r in pairs}) == 4
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # a reference other than the model, so the margins are not 0
    ref = {p["example_id"]: (summed_logp(model, p["input_ids"], p["labels"]) + 0.5 * i,
                             summed_logp(model, p["rejected_input_ids"], p["rejected_labels"]) - i)
           for i, p in enumerate(pairs)}  # fmt: skip
    beta = 0.1
    args = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=beta,
                     loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=None,
                     report_to=[], gradient_checkpointing=False)  # fmt: skip
    trainer = trainer_class()(model=model, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(pairs), planned=None,
                              run=RUN_OF_TWO)  # fmt: skip

    def loss_of(micro):
        batch = pair_batch(micro, tok.pad_token_id)
        batch["ref_chosen_logps"] = torch.tensor([ref[p["example_id"]][0] for p in micro])
        batch["ref_rejected_logps"] = torch.tensor([ref[p["example_id"]][1] for p in micro])
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, batch).item()

    ranks = [loss_of(pairs[:3]), loss_of(pairs[3:])]
    want = dpo_sigmoid_loss(model, None, pairs, beta, ref)
    assert sum(ranks) / 2 == pytest.approx(want, rel=1e-5)
    # two micro batches of micro_batch_size pairs: TRL's own mean, unweighted
    assert sum([loss_of(pairs[:2]), loss_of(pairs[2:])]) / 2 == pytest.approx(want, rel=1e-5)


def test_simpo_of_unequal_micro_batches_equals_the_paper_s_loss(tmp_path, tiny_model,
                                                               fixtures_dir):  # fmt: skip
    """SimPO (snaketune.methods.simpo: the DPO trainer's sigmoid_norm loss, its collator's
    constant reference carrying the margin) on a step of 4 pairs of different lengths that a
    token-balanced plan split 3 and 1 between two ranks: the ranks' losses averaged (as
    DeepSpeed averages their gradients) equal SimPO's loss of the 4 pairs as the paper writes
    it, from plain transformers log-probs (oracles.simpo_loss, float64)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig

    from snaketune.methods.pair_trainer import trainer_class
    from snaketune.methods.simpo import SimPOCollator
    from snaketune.methods.simpo import step_fields as simpo_step_fields

    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    rows, _ = run_tokenize(tmp_path, "gsm8k_pairs", GSM8K_PAIRS, path, tiny_model)
    pairs = sorted({r["length"]: r for r in rows}.values(), key=lambda r: -r["length"])[:4]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    beta, gamma = 2.0, 1.0
    args = DPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=beta,
                     loss_type=["sigmoid_norm"], precompute_ref_log_probs=True,
                     max_length=None, report_to=[], gradient_checkpointing=False)  # fmt: skip
    trainer = trainer_class()(model=model, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(pairs), planned=None,
                              run=RUN_OF_TWO)  # fmt: skip
    collate = SimPOCollator(tok.pad_token_id, beta, gamma, None)

    def loss_of(micro):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, collate(micro)).item()

    want = simpo_loss(model, pairs, beta, gamma)
    assert sum([loss_of(pairs[:3]), loss_of(pairs[3:])]) / 2 == pytest.approx(want, rel=1e-5)
    # two micro batches of micro_batch_size pairs: TRL's own mean, unweighted
    assert sum([loss_of(pairs[:2]), loss_of(pairs[2:])]) / 2 == pytest.approx(want, rel=1e-5)
    # the margin and the length normalisation are in it: without either the loss differs
    assert simpo_loss(model, pairs, beta, 0.0) != pytest.approx(want, rel=1e-3)
    # its step figures: the DPO trainer's but its rewards (DPO's, not SimPO's)
    logs = {"rewards/chosen": 0.2, "rewards/accuracies": 0.5, "logps/chosen": -3.0,
            "logps/rejected": -4.0, "aux_loss": 0.1}  # fmt: skip
    assert simpo_step_fields(logs) == {"logp_chosen": -3.0, "logp_rejected": -4.0,
                                       "aux_loss": 0.1}  # fmt: skip
    summed = dpo_sigmoid_loss(model, None, pairs, beta, {p["example_id"]: (0.0, 0.0)
                                                        for p in pairs})  # fmt: skip
    assert summed != pytest.approx(want, rel=1e-3)


def test_orpo_of_unequal_micro_batches_equals_the_paper_s_loss(tmp_path, tiny_model,
                                                              fixtures_dir):  # fmt: skip
    """ORPO (snaketune.methods.orpo: trl.experimental's ORPOTrainer on the planned pairs,
    its collator ours) on a step of 4 pairs of different lengths that a token-balanced plan
    split 3 and 1 between two ranks: the ranks' weighted losses averaged (as DeepSpeed
    averages their gradients) equal ORPO's loss written out from plain transformers
    log-probs (oracles.orpo_loss, float64, TRL's NLL term over prompt and response). A TRL
    upgrade that changes the experimental trainer's loss fails here."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig

    from snaketune.methods.orpo import ORPOCollator, trainer_class
    from snaketune.methods.orpo import step_fields as orpo_step_fields

    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    rows, _ = run_tokenize(tmp_path, "gsm8k_pairs", GSM8K_PAIRS, path, tiny_model)
    pairs = sorted({r["length"]: r for r in rows}.values(), key=lambda r: -r["length"])[:4]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    lam = 0.25
    args = ORPOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=lam,
                      report_to=[], gradient_checkpointing=False, disable_dropout=True)  # fmt: skip
    collate = ORPOCollator(tok.pad_token_id, None)
    trainer = trainer_class()(model=model, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(pairs).select([]),
                              data_collator=collate, planned=None, run=RUN_OF_TWO)  # fmt: skip

    def loss_of(micro):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, collate(micro)).item()

    for split in ([pairs[:3], pairs[3:]], [pairs[:2], pairs[2:]], [pairs[1:], pairs[:1]]):
        want = orpo_loss(model, split, lam)
        assert sum(loss_of(m) for m in split) / 2 == pytest.approx(want, rel=1e-5), split
    # the odds-ratio term is in it, and the NLL term covers the prompt (TRL's choice)
    assert orpo_loss(model, [pairs[:3], pairs[3:]], 0.0) != pytest.approx(want, rel=1e-3)
    response_only = sum(mean_nll(model, m)[0] * len(m) / 4 for m in ([pairs[:3], pairs[3:]]))
    assert orpo_loss(model, [pairs[:3], pairs[3:]], 0.0) != pytest.approx(response_only, rel=1e-3)
    logs = {"rewards/accuracies": 0.5, "logps/chosen": -1.5, "nll_loss": 2.0,
            "log_odds_ratio": -0.6, "logits/chosen": 3.0}  # fmt: skip
    assert orpo_step_fields(logs) == {"reward_accuracy": 0.5, "mean_logp_chosen": -1.5,
                                      "nll_loss": 2.0, "log_odds_ratio": -0.6}  # fmt: skip


def test_kto_of_unequal_micro_batches_equals_the_paper_s_loss(tmp_path, tiny_model,
                                                             fixtures_dir):  # fmt: skip
    """KTO (snaketune.methods.kto: TRL's KTOTrainer on the planned pairs read as labelled
    responses, snaketune.data.labelled) on 4 pairs of different lengths in micro batches of
    3 and 1 pairs, a LoRA policy whose adapter is not zero, the reference its base: each
    response's reference log-probs precomputed (as rule reference_logps gives them), the KL
    sequences' from the base with the adapter off in the step. The micro batches' weighted
    losses averaged equal KTO's loss written out from plain transformers log-probs
    (oracles.kto_loss, float64: each pair's KL sequence with the next pair's response), with
    unequal desirable and undesirable weights; a micro batch of one pair still has a KL
    sequence of another prompt."""
    import datasets
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig

    from snaketune.methods.kto import KTOCollator, trainer_class

    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    rows, _ = run_tokenize(tmp_path, "gsm8k_pairs", GSM8K_PAIRS, path, tiny_model)
    pairs = sorted({r["length"]: r for r in rows}.values(), key=lambda r: -r["length"])[:4]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear",
                                      init_lora_weights=False)).eval()  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tiny_model)
    beta, wd, wu = 0.5, 1.0, 1.5
    reference = {p["example_id"]: (summed_logp(base, p["input_ids"], p["labels"]),
                                   summed_logp(base, p["rejected_input_ids"],
                                               p["rejected_labels"])) for p in pairs}  # fmt: skip
    args = KTOConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, beta=beta,
                     desirable_weight=wd, undesirable_weight=wu, precompute_ref_log_probs=True,
                     per_device_train_batch_size=4, max_length=None, report_to=[],
                     gradient_checkpointing=False)  # fmt: skip
    table = datasets.Dataset.from_list(pairs)
    collate = KTOCollator(table, tok.pad_token_id, reference, None)
    trainer = trainer_class()(model=model, args=args, processing_class=tok, train_dataset=table,
                              data_collator=collate, planned=None, run=RUN_OF_TWO)  # fmt: skip

    def loss_of(micro):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, collate(micro)).item()

    def partner(p):
        return pairs[(pairs.index(p) + 1) % len(pairs)]

    want = kto_loss(model, base, [[pairs[:3]], [pairs[3:]]], partner, beta, wd, wu)
    assert sum([loss_of(pairs[:3]), loss_of(pairs[3:])]) / 2 == pytest.approx(want, rel=1e-5)
    # the reference point and the weights are in it: without either the loss differs
    assert kto_loss(model, base, [[pairs[:3]], [pairs[3:]]], lambda p: p, beta, wd, wu
                    ) != pytest.approx(want, rel=1e-3)  # fmt: skip
    assert kto_loss(model, base, [[pairs[:3]], [pairs[3:]]], partner, beta
                    ) != pytest.approx(want, rel=1e-3)  # fmt: skip


def _ragged_worker(rank: int, port: int, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    from accelerate import PartialState
    from accelerate.utils import gather

    from snaketune.core.collective import ragged_gather

    PartialState(cpu=True)
    ragged = ragged_gather(gather)
    rows = 1 if rank == 0 else 3  # rank 0 holds 1 pair, rank 1 three
    got = {
        "rewards": ragged(torch.arange(rows, dtype=torch.float32) + 10 * rank),
        "matrix": ragged(torch.full((rows, 2), rank, dtype=torch.long)),
        "flags": ragged(torch.tensor([True] * rows)),
        "scalar": ragged(torch.tensor(float(rank + 1))),
        "equal": ragged(torch.tensor([rank, rank])),
    }
    if rank == 0:
        torch.save(got, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # else gloo may abort a rank at exit


def test_a_ragged_gather_joins_unequal_rank_counts(tmp_path):
    """accelerate's gather of per-pair tensors whose first dimension differs across two
    gloo ranks (1 and 3 rows): every rank's rows in rank order, nothing padded left in; 0-d
    and equal shapes as accelerate gathers them."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "got.pt"
    mp.spawn(_ragged_worker, args=(port, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert got["rewards"].tolist() == [0.0, 10.0, 11.0, 12.0]
    assert got["matrix"].tolist() == [[0, 0], [1, 1], [1, 1], [1, 1]]
    assert got["flags"].tolist() == [True] * 4 and got["flags"].dtype == torch.bool
    assert got["scalar"].tolist() == [1.0, 2.0]
    assert got["equal"].tolist() == [0, 0, 1, 1]


def test_reference_stage_log_probs_equal_the_full_logits(tmp_path, tiny_model):
    """compute_parts + merge (two workers, chunks of 4 pairs) give every pair's summed
    log-probs as full logits do, in the tokenized order; a rerun computes only a chunk
    that is missing."""

    from transformers import AutoModelForCausalLM

    from snaketune.evaluation import logps

    _, _ = run_tokenize(tmp_path, "pairs", SPEC, PAIRS, tiny_model)
    tokenized = tmp_path / "pairs.tok.parquet"
    parts, out = tmp_path / "ref" / "parts", tmp_path / "ref" / "logps.parquet"
    parts.mkdir(parents=True)
    assert [logps.compute_parts(tokenized, tiny_model, parts, w, 2, 3, "fp32", "sdpa",
                                chunk_pairs=4) for w in (0, 1)] == [2, 1]  # fmt: skip
    (parts / "part-000001.parquet").unlink()
    assert logps.compute_parts(tokenized, tiny_model, parts, 1, 2, 3, "fp32", "sdpa",
                               chunk_pairs=4) == 1  # fmt: skip
    table = logps.merge(tokenized, parts, out, chunk_pairs=4).to_pylist()
    rows = pq.read_table(tokenized).to_pylist()
    assert [t["example_id"] for t in table] == [r["example_id"] for r in rows]
    # plain transformers on each tokenized side alone: the sum of its labelled tokens'
    # log-probs (measured within 1.1e-7 relative of the stage's float32 figures)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for t, row in zip(table, rows, strict=True):
        want_c = summed_logp(model, row["input_ids"], row["labels"])
        want_r = summed_logp(model, row["rejected_input_ids"], row["rejected_labels"])
        assert t["ref_chosen_logps"] == pytest.approx(want_c, rel=1e-5)
        assert t["ref_rejected_logps"] == pytest.approx(want_r, rel=1e-5)


def test_each_rank_scores_only_its_share_of_the_held_out_pairs(tmp_path, tiny_model, monkeypatch):
    """The evaluate stage's pair scoring on 3 emulated ranks (no collective: the output layer
    is whole here): each rank scores its own share (pair i on rank i mod 3: 4, 4 and 3 of
    11 pairs) and rank 0's join of the shares is every pair once, in order, with plain
    transformers' summed log-probs of each side."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from snaketune.evaluation import preference
    from snaketune.evaluation.sharded import Share

    run_tokenize(tmp_path, "pairs", SPEC, PAIRS[:11], tiny_model)
    rows = pq.read_table(tmp_path / "pairs.tok.parquet").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    want = [(summed_logp(model, r["input_ids"], r["labels"]),
             summed_logp(model, r["rejected_input_ids"], r["rejected_labels"])) for r in rows]  # fmt: skip
    monkeypatch.setattr(preference, "whole_output_layer", lambda *a: contextlib.nullcontext())
    shares = [preference.logps(model, rows, 2, 0, Share(r, 3)) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 3]
    got = Share(0, 3).join(shares)
    assert len(got) == len(rows) == 11
    for (c, r), (wc, wr) in zip(got, want, strict=True):
        assert c == pytest.approx(wc, rel=1e-5) and r == pytest.approx(wr, rel=1e-5)


# ----------------------------------------------------------------------------- config


def dpo_config(**run) -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    overlay = load_yaml(OVERLAY)
    config["datasets"].update(copy.deepcopy(overlay["datasets"]))
    p = copy.deepcopy(overlay["runs"]["dpo_demo"])
    del p["init_from"]
    config["runs"]["p"] = {**p, "model": "tiny", **run}
    return config


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"datasets": {"arith_pairs": {"columns": {"prompt": "question", "rejectd": "x"}}}},
         "datasets.arith_pairs.columns.rejectd: unknown key; did you mean 'rejected'?"),
        ({"runs": {"p": {"method": "lora", "dpo": {"beta": 0.2}}}},
         "runs.p.dpo: only for method dpo; remove it or set method: dpo"),
        ({"runs": {"p": {"dpo": {"loss_type": "sigmod"}}}}, "runs.p.dpo.loss_type"),
        ({"runs": {"p": {"dataset": "arith"}}},
         "runs.p.dataset: 'arith' (format prompt_response) has no pairs to tune on"),
        ({"runs": {"p": {"dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}}}},
         "runs.p.dpo.loss_weights: 1 weights for 2 loss types"),
        ({"runs": {"p": {"dpo": {"loss_type": "exo_pair"}}}},
         "runs.p.dpo.label_smoothing: loss exo_pair needs label_smoothing > 0"),
        ({"runs": {"demo": {"eval_dataset": "arith_pairs_test"}}},
         "runs.demo.eval_dataset: 'arith_pairs_test' is a preference dataset (pairs), which "
         "only methods dpo, reward, simpo, orpo, kto train and evaluate on; set method: dpo or "
         "reward or simpo or orpo or kto"),
        ({"runs": {"demo": {"method": "full"}}},
         "runs.demo.lora: only for method lora (or grpo, dpo, reward, simpo, orpo, kto, rloo, distill, opd); remove it "
         "or set "
         "method: lora"),
        ({"runs": {"p": {"method": "kto", "dpo": None, "lora": None,
                         "kto": {"reference": "precomputed"}}}},
         "runs.p.kto.reference: precomputed needs a LoRA run (its KL term's reference is the "
         "base with the adapter off, each step); set reference: live"),
        ({"runs": {"p": {"method": "kto", "dpo": None, "dataset": "arith"}}},
         "runs.p.dataset: 'arith' (format prompt_response) has no labelled responses to tune "
         "on; method kto needs a dataset of format labelled (prompt, completion, label) or "
         "preference (each chosen response desirable, each rejected one not)"),
        ({"datasets": {"mix": {"source": "mixture", "mixture": [{"dataset": "arith_test"},
                                                                {"dataset": "arith_pairs"}]}}},
         "datasets.mix.mixture: mixes conversations and pairs (prompt_response; preference); a "
         "mixture's components are of one kind of data"),
    ],
)  # fmt: skip
def test_bad_dpo_configs_get_one_line(change, line):
    config = dpo_config()
    for section, entries in change.items():
        for name, values in entries.items():  # None: the key removed
            entry = config[section].setdefault(name, {})
            entry.update({k: v for k, v in values.items() if v is not None})
            for key in (k for k, v in values.items() if v is None):
                del entry[key]
    with pytest.raises(ConfigError) as exc:
        validate_config(config, ROOT)
    assert line in str(exc.value), str(exc.value)


def test_a_preference_set_needs_a_rejected_column(tmp_path, tiny_model):
    from snaketune.core.errors import DataError

    rows = [{"question": p["question"], "good": p["good"]} for p in PAIRS]
    with pytest.raises(DataError, match="column 'bad' not found"):
        run_tokenize(tmp_path, "norej", SPEC, rows, tiny_model)


# ----------------------------------------------------------------------------- unequal ranks


@pytest.fixture(scope="module")
def gsm8k_pairs(tmp_path_factory, tiny_model, fixtures_dir):
    """The fixture's GSM8K-style pairs (worked answer against a wrong number, a cut answer
    or a bare number) tokenized, planned for 2 nodes x 1 device with micro_batch_size 2
    (global batch 4, token-balanced as every DPO plan is), and the reference stage's
    log-probs of the starting model (the tiny model). 8 of the epoch's 64 steps give the
    ranks 1 and 3 pairs; seed 28 puts 4 of them among the first 8 steps."""
    import sys

    work = tmp_path_factory.mktemp("gsm8k_pairs")
    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    run_tokenize(work, "pairs", GSM8K_PAIRS, path, tiny_model)
    tokenized = work / "pairs.tok.parquet"
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(tokenized), "--nodes", "2", "--gpus-per-node", "1", "--micro-batch-size",
                    "2", "--gradient-accumulation-steps", "1", "--seed", "28", "--packing",
                    "--out", str(work / "shards")], check=True, env=ENV, capture_output=True)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts/reference_logps.py"), "--tokenized",
                    str(tokenized), "--model", str(tiny_model), "--nodes", "2", "--batch-pairs",
                    "4", "--precision", "fp32", "--out", str(work / "ref/logps.parquet")],
                   check=True, env=ENV, capture_output=True)  # fmt: skip
    return work


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_reference_worker_takes_the_stage_down_and_a_rerun_computes_the_rest(
    gsm8k_pairs, tiny_model, tmp_path
):
    """The reference stage starts its workers through the train job's launcher
    (snaketune.train.agents): one of its 2 workers SIGKILLed before it publishes its third part
    takes the other down (no orphan process, no output, the parts written kept, the attempt
    recorded with its exit); the rerun computes only the missing parts, and its log-probs
    are the uninterrupted stage's, bit for bit."""
    import sys

    import psutil

    tokenized = gsm8k_pairs / "pairs.tok.parquet"
    out = tmp_path / "ref/logps.parquet"
    cmd = [sys.executable, str(ROOT / "scripts/reference_logps.py"), "--tokenized",
           str(tokenized), "--model", str(tiny_model), "--nodes", "2", "--batch-pairs", "4",
           "--precision", "fp32", "--chunk-pairs", "16", "--out", str(out)]  # fmt: skip
    chunks = pq.ParquetFile(tokenized).metadata.num_rows // 16
    assert chunks == 16  # worker 0 computes the even parts, worker 1 the odd ones
    killed = subprocess.run(cmd, env={**ENV, "SNAKETUNE_KILL_BEFORE_PUBLISH": "part-000005"},
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    log = killed.stdout + killed.stderr
    assert killed.returncode != 0, log[-3000:]
    assert "stopping the others" in log, log[-3000:]  # the launcher's supervision acted
    assert not out.exists()
    left = [p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(
        p.info["cmdline"] or [])]  # fmt: skip
    assert not left, [p.info["cmdline"] for p in left]  # no orphan agent or worker
    kept = sorted(int(p.stem.split("-")[1]) for p in (out.parent / "parts").glob("part-*"))
    assert 1 in kept and 3 in kept and 5 not in kept, kept  # worker 1 died at its third
    assert len(kept) < chunks
    attempts = read_jsonl(out.parent / "logs/attempts.jsonl")
    assert [a["exit"] for a in attempts if "exit" in a] == [killed.returncode]
    assert (out.parent / "logs/attempt-1.log").is_file()

    rerun = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    log = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, log[-3000:]
    # rank 0 logs its count (the other ranks log warnings only): its parts not kept, alone
    computed = [int(n) for n in re.findall(r"worker 0: (\d+) chunks computed", log)]
    assert computed == [8 - sum(k % 2 == 0 for k in kept)], (kept, log[-3000:])
    attempts = read_jsonl(out.parent / "logs/attempts.jsonl")
    assert [a["exit"] for a in attempts if "exit" in a] == [killed.returncode, 0]
    assert pq.read_table(out).equals(pq.read_table(gsm8k_pairs / "ref/logps.parquet"))


STEPS = 8


def model_before(step: int, base, tiny_model, ckpts):
    """The model a 2-node oracle run's step ``step`` trained: the base at step 1, else the
    base with the adapter its previous step saved (peft, checkpoint-<step - 1>)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if step == 1:
        return base
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return PeftModel.from_pretrained(fresh, str(ckpts / f"checkpoint-{step - 1}")).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "reference", ["precomputed", pytest.param("live", marks=pytest.mark.extended)]
)
def test_dpo_on_two_nodes_with_unequal_pairs_per_rank_equals_the_oracle(
    gsm8k_pairs, tiny_model, tmp_path, reference
):
    """LoRA DPO on 2 nodes over pairs of widely varying lengths: the token-balanced plan gives
    the ranks unequal pair counts in several steps (counted from the shards), TRL's metric
    gathers take them, and every step's loss equals the DPO loss of that step's 4 pairs
    written out by hand: plain transformers log-probs under the previous step's saved
    adapter (peft), the reference the starting model. Measured: 3.3e-6 relative at worst
    (float32 sums of sides up to ~300 tokens), both references; bound 1e-4. Step 2 is still
    log 2: the first step's learning rate is 0 (warmup)."""
    from transformers import AutoModelForCausalLM

    plan = planned_steps(gsm8k_pairs / "shards", STEPS)
    counts = [tuple(len(r) for r in step) for step in plan]
    assert sum(a != b for a, b in counts) >= 3, counts  # unequal pair counts per rank
    spec = validate_config(dpo_config(), ROOT)["runs"]["p"]
    spec.update(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS,
                save_steps=1, save_total_limit=STEPS, learning_rate=3e-3, precision="fp32")  # fmt: skip
    spec["dpo"] = {**spec["dpo"], "loss_type": "sigmoid", "loss_weights": None, "beta": 0.1,
                   "reference": reference}  # fmt: skip
    spec.pop("eval", None)
    # each step logged once, each rank trained the pairs the plan gave it, step by step
    ref = f"reference_logps={gsm8k_pairs / 'ref/logps.parquet'}"  # the stage's output
    metrics = train_as_planned(tmp_path, spec, gsm8k_pairs / "shards", tiny_model, plan,
                               "--stage-input", ref)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ckpts = tmp_path / "results/x/train/checkpoints"
    for m, step in zip(metrics, plan, strict=True):
        k = m["step"]
        model = model_before(k, base, tiny_model, ckpts)
        want = dpo_sigmoid_loss(model, base, step[0] + step[1], 0.1)
        assert m["loss"] == pytest.approx(want, rel=1e-4), (k, counts[k - 1])
        assert math.isfinite(m["reward_margin"])


# A method without a reference model: its schema defaults, its loss written out from the
# paper for a step's micro batches (one per rank) under a model, the step figures it logs.
REFERENCE_FREE = {
    "simpo": ({"beta": 2.0, "gamma": 1.0},
              lambda model, ranks: simpo_loss(model, ranks[0] + ranks[1], 2.0, 1.0),
              {"logp_chosen", "logp_rejected"}),
    "orpo": ({"lambda": 0.1}, lambda model, ranks: orpo_loss(model, ranks, 0.1),
             {"mean_logp_chosen", "nll_loss", "log_odds_ratio", "reward_accuracy"}),
}  # fmt: skip


def rank_partners(shards: Path) -> dict[str, dict]:
    """Each planned pair's KTO partner, written out: the next pair in its rank's rows (the
    node's shard read in order, the rank's first pair after its last)."""
    by_rank: dict[int, list[dict]] = {}
    for node in sorted(shards.glob("node-*.parquet")):
        for r in pq.read_table(node).to_pylist():
            by_rank.setdefault(r["rank"], []).append(r)
    return {r["example_id"]: rows[(k + 1) % len(rows)]
            for rows in by_rank.values() for k, r in enumerate(rows)}  # fmt: skip


@pytest.fixture(scope="module", params=[*sorted(REFERENCE_FREE), "kto"])
def two_node_pair_run(request, gsm8k_pairs, tiny_model, tmp_path_factory) -> dict:
    """LoRA SimPO, ORPO or KTO from a user's config (the method, its block's schema defaults)
    on 2 nodes over pairs of varied lengths (the ranks get unequal pair counts in several
    steps), trained to STEPS with a checkpoint a step, each rank logging the pairs it
    trained: what the oracle test reads, and the run the kill-and-resume test continues."""
    method = request.param
    plan = planned_steps(gsm8k_pairs / "shards", STEPS)
    counts = [tuple(len(r) for r in step) for step in plan]
    assert sum(a != b for a, b in counts) >= 3, counts  # unequal pair counts per rank
    config = dpo_config(method=method)
    del config["runs"]["p"]["dpo"]
    spec = validate_config(config, ROOT)["runs"]["p"]
    defaults = REFERENCE_FREE[method][0] if method in REFERENCE_FREE else KTO_DEFAULTS
    assert spec[method] == defaults  # the schema's
    spec.update(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS,
                save_steps=1, save_total_limit=STEPS, learning_rate=3e-3, precision="fp32",
                checkpoints={**spec["checkpoints"], "optimizer": "all"})  # fmt: skip
    extra = []
    if method == "kto":  # a LoRA run's reference: the start's, as the stage gives it
        extra = ["--stage-input", f"reference_logps={gsm8k_pairs / 'ref/logps.parquet'}"]
    spec.pop("eval", None)
    work = tmp_path_factory.mktemp(f"pair_method_{method}")
    metrics = train_as_planned(work, spec, gsm8k_pairs / "shards", tiny_model, plan, *extra)
    return {"method": method, "spec": spec, "plan": plan, "counts": counts, "extra": extra,
            "metrics": metrics, "ckpts": work / "results/x/train/checkpoints"}  # fmt: skip


KTO_DEFAULTS = {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0,
                "reference": "auto"}  # fmt: skip


@pytest.mark.slow
def test_simpo_orpo_and_kto_on_two_nodes_equal_the_oracle(
    two_node_pair_run, gsm8k_pairs, tiny_model
):
    """Every step's loss of the 2-node run (two_node_pair_run) equals the method's loss of
    that step's pairs written out from its paper under the previous step's saved adapter
    (oracles.simpo_loss, orpo_loss; kto_loss with the reference stage's log-probs of the
    start and the KL sequences' reference point over both ranks); each rank trained the
    pairs the plan gave it (train_as_planned)."""
    from transformers import AutoModelForCausalLM

    run = two_node_pair_run
    method = run["method"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    partners = rank_partners(gsm8k_pairs / "shards")
    _, oracle, figures = REFERENCE_FREE.get(method) or (
        KTO_DEFAULTS,
        lambda model, ranks: kto_loss(model, base, [ranks], lambda p: partners[p["example_id"]],
                                      0.1),
        {"kl", "reward_chosen", "reward_rejected", "logp_chosen"})  # fmt: skip
    for m, step in zip(run["metrics"], run["plan"], strict=True):
        k = m["step"]
        want = oracle(model_before(k, base, tiny_model, run["ckpts"]), step)
        assert m["loss"] == pytest.approx(want, rel=1e-4), (k, run["counts"][k - 1])
        assert figures <= set(m) and (method == "orpo") == ("reward_accuracy" in m), m
        assert method != "kto" or m["kl"] >= 0


@pytest.mark.extended
@pytest.mark.slow
def test_simpo_orpo_and_kto_resume_exactly_after_a_kill(
    two_node_pair_run, gsm8k_pairs, tiny_model, tmp_path
):
    """The 2-node run again from its checkpoint-4, its launcher killed two steps on (no
    orphan), rerun: it resumes, logs each step once, and its losses are the uninterrupted
    run's (each chain's own kill-and-resume: the extended tier)."""
    run = two_node_pair_run
    spec, extra, metrics = run["spec"], run["extra"], run["metrics"]
    b = tmp_path / "b"
    shutil.copytree(run["ckpts"], b / "results/x/train/checkpoints")
    for k in range(5, STEPS + 1):
        shutil.rmtree(b / f"results/x/train/checkpoints/checkpoint-{k}")
    live = b / "results/x/train/checkpoints/metrics.jsonl"
    proc = launch_train(b, spec, gsm8k_pairs / "shards", tiny_model, "zero2", *extra)
    reached = kill_two_steps_on(proc, live, 4, STEPS)  # no orphan worker
    first = (b / "results/x/train/logs/attempt-1.log").read_text()
    assert "resuming from checkpoint-4" in first and reached, first[-3000:]
    out, _ = launch_train(b, spec, gsm8k_pairs / "shards", tiny_model, "zero2",
                          *extra).communicate(timeout=600)  # fmt: skip
    assert re.search(r"resuming from checkpoint-[4-7]\b", out), out[-3000:]
    resumed = read_jsonl(b / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))  # each step once
    for got, want in zip(resumed, metrics, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7), got["step"]


# ----------------------------------------------------------------------------- the chain

SWEEP = {"runs": {"dpo_sweep": {"sweep": {"dpo.beta": [0.1, 0.3]}, "max_steps": 16}}}


@pytest.fixture(scope="session")
def dpo_chain(sft_demo, tmp_path_factory):
    """A copy of the finished demo and sft_demo (the DPO run's start, shared with the GRPO
    chain: the ``sft_demo`` fixture), then the DPO overlay (the DPO run's checkpoints kept
    whole: a test resumes from the older one) with a two-member beta sweep of the same run,
    to the report and the DPO run's dry-run publish folder."""
    workdir = tmp_path_factory.mktemp("dpo") / "w"
    subprocess.run(["cp", "-a", str(sft_demo), str(workdir)], check=True)
    overlay = load_yaml(OVERLAY)
    sweep = {**copy.deepcopy(overlay["runs"]["dpo_demo"]), **SWEEP["runs"]["dpo_sweep"]}
    # the sweep's members in the extended tier only (the reference shared with them is
    # what its test there shows; the CI tier's sweeps are test_sweep.py's)
    (workdir / "sweep.yaml").write_text(yaml.safe_dump({"runs": {"dpo_sweep": sweep}}))
    sweeps = [] if ci_tier() else [str(workdir / "sweep.yaml")]
    # and KTO from the same SFT run on the same pairs (the DPO run's reference stage, its
    # own headline), SimPO and ORPO (no reference stage) in the extended tier only: the CI
    # tier has their 2-node oracles, and KTO's chain on a labelled dataset (below) for a
    # pair method's pipeline
    free = {f"{m}_demo": pair_method_run(m) for m in CHAINED if m in CI_CHAINED or not ci_tier()}
    # and KTO on a user's labelled responses (the pairs' chosen answers desirable, every
    # third pair's rejected answer not: 3 to 1), its own reference job
    pairs = read_jsonl(workdir / "resources/fixtures/arith-demo/pairs-train.jsonl")
    labelled = [{"question": p["question"], "completion": p["chosen"], "label": True}
                for p in pairs]  # fmt: skip
    labelled += [{"question": p["question"], "completion": p["rejected"], "label": False}
                 for p in pairs[::3]]  # fmt: skip
    write_jsonl(workdir / "labelled.jsonl", labelled)
    free["kto_labelled_demo"] = {**pair_method_run("kto"), "dataset": "arith_labelled"}
    (workdir / "simpo.yaml").write_text(yaml.safe_dump({"runs": free, "datasets": {
        "arith_labelled": {"source": "local", "path": "labelled.jsonl", "format": "labelled",
                           "columns": {"prompt": "question"}}}}))  # fmt: skip
    start = time.monotonic()
    proc = snakemake("all", "publish", "--configfile", str(ROOT / "config/config.yaml"), str(OVERLAY),
                     *sweeps, str(workdir / "simpo.yaml"), "--directory", str(workdir), "--config",
                     chain_runs("sft_demo", whole=("dpo_demo",)))  # fmt: skip
    (workdir / "dpo.out").write_text(proc.stdout + proc.stderr)
    (workdir / "dpo.seconds").write_text(f"{time.monotonic() - start:.0f}\n")
    return workdir


def pair_method_run(method: str) -> dict:
    """The DPO demo's run as ``method`` (SimPO, ORPO, KTO: the schema's settings), 16 steps,
    not published."""
    run = copy.deepcopy(load_yaml(OVERLAY)["runs"]["dpo_demo"])
    for key in ("dpo", "publish"):
        del run[key]
    return {**run, "method": method, "max_steps": 16}


# What the chain's run of each method logs at every step and leads its evaluation with.
CHAINED = {"simpo": ({"logp_chosen", "logp_rejected"}, "likelihood_accuracy"),
           "orpo": ({"nll_loss", "log_odds_ratio", "reward_accuracy"}, "likelihood_accuracy"),
           "kto": ({"kl", "reward_chosen", "reward_rejected"}, "preference_accuracy")}  # fmt: skip
# The chained runs of the CI tier (the rest: extended; dpo_chain): KTO on a labelled dataset
# (its own reference job, its headline, merge); on the pairs, sharing the DPO run's reference
# stage, in the extended tier (what a shared reference key is: a quick test).
CI_CHAINED = {"kto_labelled"}


def stage_inputs(w: Path, run: str) -> dict[str, str]:
    """The scoring stages' outputs a run's train job read (its job.json names them)."""
    from snaketune.budget.scoring import STAGES

    job = json.loads((w / f"results/{run}/train/job.json").read_text())
    return {s.name: job["inputs"][s.name] for s in STAGES if s.name in job["inputs"]}


def dpo_reference(w: Path) -> Path:
    """The reference log-probs the chain's DPO run read."""
    return w / stage_inputs(w, "dpo_demo")["reference_logps"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [pytest.param(m, marks=() if m in CI_CHAINED else pytest.mark.extended)
     for m in [*sorted(CHAINED), "kto_labelled"]],
)  # fmt: skip
def test_simpo_orpo_and_kto_after_sft_reach_evaluation_with_their_headline(dpo_chain, method):
    """The chains SFT -> SimPO, SFT -> ORPO and SFT -> KTO (on the pairs, and on a labelled
    dataset) from one config through the pipeline: a reference stage only for KTO (the DPO
    run's on the pairs, shared: the test below; its own on the labelled set), each
    step's figures, the held-out pairs evaluated against the start's (the SFT run's merged
    model) with the method's headline first (likelihood accuracy; KTO: the implicit
    reward's preference accuracy with its beta), in the summary and the report; the merged
    model exported."""
    import csv

    w, run = dpo_chain, f"{method}_demo"
    method = method.removesuffix("_labelled")  # KTO on a labelled dataset: the same figures
    figures, headline = CHAINED[method]
    metrics = read_jsonl(w / f"results/{run}/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 17))
    assert all({"loss", *figures} <= set(m) for m in metrics)
    read = stage_inputs(w, run)
    assert ("reference_logps" in read) == (method == "kto")
    if run == "kto_labelled_demo":  # one reference log-prob per labelled response
        table = pq.read_table(w / read["reference_logps"])
        assert table.column_names == ["example_id", "ref_logps"] and table.num_rows > 256
    got = json.loads((w / f"results/{run}/eval/metrics.json").read_text())
    pref = got["preference"]
    assert 0 <= pref["likelihood_accuracy"] <= 1 and pref["pairs"] > 0
    # an implicit reward against the start only where the method has a beta (KTO)
    assert ("preference_accuracy" in pref) == (method == "kto")
    assert got["headline"][0] == headline
    assert headline in got["base"]["preference"]  # the start's, beside it
    assert started((w / "dpo.out").read_text(), "train").count(f"run={run}") == 1
    with open(w / "results/summary.tsv") as fh:
        row = next(r for r in csv.DictReader(fh, delimiter="\t") if r["run"] == run)
    assert row["method"] == method and float(row[headline]) == pytest.approx(pref[headline])
    assert row["headline"].split()[0] == headline
    assert run in (w / "results/summary.html").read_text()
    assert (w / f"results/{run}/merged_model/config.json").is_file()


def dpo_spec(**overrides) -> dict:
    run = chain_config()["runs"]["dpo_demo"]
    spec = {k: v for k, v in run.items()
            if k not in ("eval", "eval_dataset", "export", "gpu", "skip_memory_check")}  # fmt: skip
    spec.update(overrides)
    return spec


@pytest.mark.extended
@pytest.mark.slow
def test_dpo_after_sft_learns_on_two_nodes(dpo_chain):
    w = dpo_chain
    metrics = read_jsonl(w / "results/dpo_demo/train/metrics.jsonl")
    steps = chain_config()["runs"]["dpo_demo"]["max_steps"]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:  # what a DPO step logs
        for key in ("loss", "reward_chosen", "reward_rejected", "reward_accuracy",
                    "reward_margin", "logp_chosen", "logp_rejected", "tokens_per_s"):  # fmt: skip
            assert key in m, (key, m)
    # step 1 is scored before any update, against the precomputed reference: the model it
    # starts from, so its rewards are 0 (fp32 log-probs of the same model, two batchings)
    for key in ("reward_chosen", "reward_rejected", "reward_margin"):
        assert abs(metrics[0][key]) < 1e-5, (key, metrics[0])
    log = (w / "logs/train/dpo_demo.log").read_text()
    assert "x 1 devices x 2 nodes x accumulation 1" in log, log[-2000:]
    sft = json.loads((w / "results/sft_demo/eval/metrics.json").read_text())
    dpo = json.loads((w / "results/dpo_demo/eval/metrics.json").read_text())
    # held-out pairs: the tuned model's implicit reward ranks the right sum first
    assert dpo["preference"]["pairs"] == 64
    assert dpo["preference"]["preference_accuracy"] >= 0.9, dpo["preference"]
    assert dpo["base"]["preference"]["preference_accuracy"] == 0.0
    # the chosen sides are the held-out questions' right answers: exact match rose
    assert dpo["base"]["exact_match"] == sft["exact_match"]  # the same 64 questions
    assert dpo["exact_match"] >= sft["exact_match"] + 0.2, (sft["exact_match"], dpo["exact_match"])
    summary = (w / "results/summary.tsv").read_text().splitlines()
    header, rows = summary[0].split("\t"), [dict(zip(summary[0].split("\t"), r.split("\t"), strict=True)) for r in summary[1:]]  # fmt: skip
    assert "preference_accuracy" in header and "reward_margin_last_quarter" in header
    row = next(r for r in rows if r["run"] == "dpo_demo")
    assert float(row["preference_accuracy"]) == pytest.approx(
        dpo["preference"]["preference_accuracy"]
    )
    svg = next((w / "results/loss_curves").glob("dpo_demo*.svg")).read_text()
    assert "preference" in svg and "reward accuracy" in svg


@pytest.mark.extended
@pytest.mark.slow
def test_the_reference_stage_ran_once_for_the_run_and_a_beta_sweep(dpo_chain):
    """dpo_demo, both members of the beta sweep and kto_demo start from sft_demo and train on
    the same tokenized pairs: one reference_logps job served the four."""
    w = dpo_chain
    out = (w / "dpo.out").read_text()
    # and one for kto_labelled_demo's own data
    assert len(started(out, "reference_logps")) == 2, out[-3000:]
    # the DPO run and the two members trained here; sft_demo, the same run in the GRPO
    # overlay the sft_demo fixture trained it with, was not trained again
    assert len(started(out, "train")) == 7, out[-3000:]  # and simpo, orpo, kto(_labelled)
    ref = dpo_reference(w).parent
    names = ("dpo_demo", "dpo_sweep-beta_0p1", "dpo_sweep-beta_0p3")
    members = [json.loads((w / f"results/{m}/train/run_config.json").read_text()) for m in names]
    read = {stage_inputs(w, m)["reference_logps"] for m in (*names, "kto_demo")}
    assert read == {
        f"results/reference_logps/{ref.name}/logps.parquet"
    }  # and the KTO run from the same start on the same pairs
    assert [m["dpo"]["beta"] for m in members] == [0.1, 0.1, 0.3]
    assert pq.read_table(ref / "logps.parquet").num_rows == 2048


@pytest.mark.extended
@pytest.mark.slow
def test_precomputed_and_live_references_give_the_same_losses_and_pairs_once(dpo_chain, tmp_path):
    """One epoch (32 steps) of the demo's DPO run on its shards, the reference precomputed
    and live (LoRA: the adapter off): the same losses and rewards at every step (fp32,
    relative 1e-5); every pair the plan keeps trained exactly once across the 2 nodes."""
    w = dpo_chain
    shards, model = w / "results/dpo_demo/shards", w / "results/sft_demo/merged_model"
    ref = dpo_reference(w)
    runs = {}
    for how in ("precomputed", "live"):
        work = tmp_path / how
        work.mkdir()
        spec = dpo_spec(max_steps=32, save_steps=100)
        spec["dpo"] = {**spec["dpo"], "reference": how}
        proc = launch_train(work, spec, shards, model, "zero2", "--log-example-ids",
                            str(work / "ids"), "--stage-input", f"reference_logps={ref}")  # fmt: skip
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        runs[how] = read_jsonl(work / "results/x/train/metrics.jsonl")
    for a, b in zip(runs["precomputed"], runs["live"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
        for key in ("reward_chosen", "reward_rejected", "logp_chosen"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    manifest = json.loads((shards / "manifest.json").read_text())
    planned = []
    for node in range(2):
        table = pq.read_table(shards / f"node-{node}.parquet", columns=["example_id"])
        planned += table.column("example_id").to_pylist()
    trained = []
    for rank in range(2):
        trained += (tmp_path / "live/ids" / f"rank-{rank}.txt").read_text().split()
    assert manifest["steps_per_epoch"] == 32
    assert sorted(trained) == sorted(planned)  # each kept pair once, on one rank
    assert len(set(trained)) == len(trained) == 32 * 64


@pytest.mark.slow
def test_a_dpo_run_scores_its_held_out_pairs_while_training(dpo_chain, tmp_path):
    """dpo_demo with eval_steps 2 for 2 steps: held-out rows before the first step and at
    the last, through the DPO trainer; the first is the starting model's loss on the chosen
    sides of the held-out pairs, as the evaluate stage scored it (the run's base)."""
    from snaketune.core.heldout import spec_of
    from snaketune.plan import stages

    w = dpo_chain
    config = chain_config()
    spec = dpo_spec(max_steps=2, save_steps=100, eval_steps=2)
    ref = dpo_reference(w)
    eval_set = w / stages.tokenized(config, "dpo_demo", eval_set=True)
    spec["heldout"] = spec_of(config["runs"]["dpo_demo"], str(eval_set))
    proc = launch_train(tmp_path, spec, w / "results/dpo_demo/shards",
                        w / "results/sft_demo/merged_model", "zero2",
                        "--stage-input", f"reference_logps={ref}")  # fmt: skip
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    rows = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    held = [r for r in rows if "heldout_loss" in r]
    assert [r["step"] for r in held] == [0, 2] and held[0]["heldout_examples"] == 64
    base = json.loads((w / "results/dpo_demo/eval/metrics.json").read_text())["base"]
    assert held[0]["heldout_loss"] == pytest.approx(base["loss"], rel=1e-5)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


@pytest.mark.extended
@pytest.mark.slow
def test_a_4bit_dpo_run_reads_a_4bit_reference(dpo_chain, tmp_path):
    """dpo_demo on a 4-bit base (lora.quantize): its reference is the same 4-bit base with
    the adapter off, so rule reference_logps scores the pairs in 4 bits (the run's
    settings) and the first step's rewards are 0; against the unquantized reference they
    are not."""
    import sys

    w = dpo_chain
    tokenized = next((w / "results/tokenized").glob("arith_pairs__*/data.parquet"))
    shards, model = w / "results/dpo_demo/shards", w / "results/sft_demo/merged_model"
    out = tmp_path / "ref4/logps.parquet"
    subprocess.run([sys.executable, str(ROOT / "scripts/reference_logps.py"), "--tokenized",
                    str(tokenized), "--model", str(model), "--nodes", "2", "--batch-pairs", "32",
                    "--quantize", "4bit", "--out", str(out)], check=True, env=ENV,
                   capture_output=True)  # fmt: skip
    rewards = {}
    for name, ref in (("4bit", out), ("unquantized", dpo_reference(w))):
        spec = dpo_spec(max_steps=2, save_steps=100)
        spec["lora"] = {**spec["lora"], "quantize": "4bit", "quant_type": "nf4",
                        "double_quant": True, "compute_dtype": "auto"}  # fmt: skip
        (tmp_path / name).mkdir()
        proc = launch_train(
            tmp_path / name, spec, shards, model, "zero2", "--stage-input", f"reference_logps={ref}"
        )
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-3000:]
        assert "4-bit base: 14 linear layers" in log
        rewards[name] = read_jsonl(tmp_path / name / "results/x/train/metrics.jsonl")[0]
    for key in ("reward_chosen", "reward_rejected"):
        assert abs(rewards["4bit"][key]) < 1e-5, rewards["4bit"]
    assert abs(rewards["unquantized"]["reward_chosen"]) > 1e-3, rewards["unquantized"]


@pytest.mark.extended
@pytest.mark.slow
def test_killed_dpo_run_resumes_to_the_same_losses(dpo_chain, tmp_path):
    """The pipeline's DPO run again from its next-to-last checkpoint: the launcher killed
    two steps later (no orphan), the rerun resumes there, and every step after it logs the
    losses and rewards of the uninterrupted run."""
    w = dpo_chain
    spec = pipeline_spec(w / "results/dpo_demo/train", tmp_path)  # its precomputed reference
    shards, model = w / "results/dpo_demo/shards", w / "results/sft_demo/merged_model"
    start, resumed = kill_and_resume(w / "results/dpo_demo/train", tmp_path, spec, shards, model)
    reference = read_jsonl(w / "results/dpo_demo/train/metrics.jsonl")
    for a, b in zip(resumed[start:], reference[start:], strict=True):
        for key in ("loss", "reward_chosen", "reward_rejected", "reward_margin"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.extended
@pytest.mark.slow
def test_dpo_continues_on_one_node_from_its_two_node_checkpoint(dpo_chain, tmp_path):
    """dpo_demo's training taken back to checkpoint-100 and rerun with nodes: 1 through the
    local profile: its pairs resharded (not tokenized again), the reference's log-probs
    reused (they do not depend on the layout), the accumulation adapted (global batch 64
    kept), and the steps after 100 log the uninterrupted 2-node run's losses and rewards."""
    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(dpo_chain), str(work)], check=True)
    train_dir = work / "results/dpo_demo/train"
    for p in train_dir.iterdir():
        if p.name != "checkpoints":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    shutil.rmtree(train_dir / "checkpoints/checkpoint-128")
    proc = snakemake("results/dpo_demo/train/metrics.jsonl", "--configfile",
                     str(ROOT / "config/config.yaml"), str(OVERLAY), "--directory", str(work),
                     "--config", chain_runs("sft_demo", whole=("dpo_demo",),
                                            dpo_demo={"nodes": 1}))  # fmt: skip
    out = proc.stdout + proc.stderr
    assert started(out, "shard_dataset") and not started(out, "tokenize_dataset"), out[-3000:]
    assert not started(out, "reference_logps"), out[-3000:]  # the layout is not in its key
    assert "gradient_accumulation_steps 1 -> 2 on 1 node x 1 GPU" in out, out[-3000:]
    log = (work / "logs/train/dpo_demo.log").read_text()
    assert "continuing dpo_demo at step 100 on 1 node x 1 GPU" in log, log[-3000:]
    assert "resuming from checkpoint-100" in log and "starting fresh" not in log
    got = read_jsonl(train_dir / "metrics.jsonl")
    want = read_jsonl(dpo_chain / "results/dpo_demo/train/metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got[100:], want[100:], strict=True):  # measured: 2e-7 relative at most
        for key in ("loss", "reward_chosen", "reward_rejected", "reward_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.slow
def test_publish_dry_run_of_the_dpo_model(dpo_chain):
    """`snakemake publish` with the DPO overlay: the merged DPO model's folder, its card with
    the DPO keys and the held-out preference figures, nothing uploaded, no secret."""
    from huggingface_hub import ModelCard

    w = dpo_chain
    folder = w / "results/dpo_demo/publish"
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names, names
    receipt = json.loads((w / "results/dpo_demo/publish.json").read_text())
    assert receipt["dry_run"] is True and "url" not in receipt
    merged = w / "results/dpo_demo/merged_model/model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == merged.read_bytes()
    card = ModelCard.load(folder / "README.md")
    figures = {r.metric_type: r.metric_value for r in card.data.eval_results}
    dpo = json.loads((w / "results/dpo_demo/eval/metrics.json").read_text())
    assert figures["preference_accuracy"] == pytest.approx(dpo["preference"]["preference_accuracy"])
    assert figures["reward_margin"] == pytest.approx(dpo["preference"]["reward_margin"])
    assert figures["exact_match"] == pytest.approx(dpo["exact_match"])
    assert "dpo" in card.data.tags
    text = card.text
    assert "continuing run `sft_demo`" in text and '"loss_type": [' in text, text
    assert "reference_logps" not in text and str(w) not in text  # no local path
    assert leaked_secrets(w) == []


def test_reference_key_is_shared_by_what_it_depends_on_only():
    from snaketune.plan.trainjob import reference_jobs, reference_key

    config = dpo_config()
    config["runs"]["q"] = {**copy.deepcopy(config["runs"]["p"]), "dpo": {"beta": 0.5},
                           "learning_rate": 1e-4}  # fmt: skip
    config["runs"]["other_data"] = {**copy.deepcopy(config["runs"]["p"]),
                                    "dataset": "arith_pairs_test", "eval_dataset": "arith_test"}  # fmt: skip
    config["runs"]["live"] = {**copy.deepcopy(config["runs"]["p"]), "dpo": {"reference": "live"}}
    config = validate_config(config, ROOT)
    keys = {run: reference_key(config, run) for run in ("p", "q", "other_data", "live")}
    assert keys["p"] == keys["q"]  # beta and the learning rate leave the reference as it is
    assert keys["other_data"] not in (None, keys["p"])
    assert keys["live"] is None
    assert reference_jobs(config) == {keys["p"]: "p", keys["other_data"]: "other_data"}


def test_memory_plan_counts_pairs_and_a_live_full_reference():
    from snaketune.budget.fit import setup_of

    ds = {"zero_optimization": {"stage": 2}}
    run = validate_config(dpo_config(), ROOT)["runs"]["p"]
    lora = setup_of(run, ds)
    assert lora.micro_batch_size == 2 * run["micro_batch_size"]  # chosen and rejected
    assert not lora.reference  # LoRA: the adapter off
    full = {k: v for k, v in run.items() if k != "lora"}
    assert not setup_of(full, ds).reference  # precomputed: no copy in training
    assert setup_of({**full, "dpo": {**run["dpo"], "reference": "live"}}, ds).reference
