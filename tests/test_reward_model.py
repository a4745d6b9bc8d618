"""Reward models (method reward): the score head, TRL's RewardTrainer on planned pairs
against a loss written out by hand, the evaluation of the held-out pairs, the config's
refusals, the model card; and the demo chain (config/reward_demo.yaml): a reward model
trained from the SFT run on 2 emulated nodes, exported, evaluated, published, resumed.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import numpy as np
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
    pipeline_spec,
    read_jsonl,
    snakemake,
    train_as_planned,
)
from oracles import planned_steps, reward_pair_loss, sequence_score
from test_tokenize import run_tokenize

from snaketune.core.errors import ConfigError
from snaketune.evaluation import heads
from snaketune.plan.config import load_yaml, validate_config

OVERLAY = ROOT / "config" / "reward_demo.yaml"
GSM8K_PAIRS = {"format": "preference", "columns": {"prompt": "question"}}


def reward_config(**run) -> dict:
    """config/config.yaml with the reward demo's datasets and its run as ``p`` (from the
    tiny model, not from the demo run)."""
    config = load_yaml(ROOT / "config" / "config.yaml")
    overlay = load_yaml(OVERLAY)
    config["datasets"].update(copy.deepcopy(overlay["datasets"]))
    p = copy.deepcopy(overlay["runs"]["rm_demo"])
    del p["init_from"]
    config["runs"]["p"] = {**p, "model": "tiny", **run}
    return config


def test_a_new_score_head_is_drawn_from_the_seed_and_reads_the_pad_id(tiny_model):
    """The head a causal model gets is the same for the same seed (every rank, the
    evaluation of the start, a rerun), another for another seed; its config carries the
    tokenizer's pad id, where transformers reads the score; a saved reward model loads with
    its own head."""
    from transformers import AutoTokenizer

    a = heads.load(tiny_model, "score", 7, dtype=torch.float32)
    b = heads.load(tiny_model, "score", 7, dtype=torch.float32)
    c = heads.load(tiny_model, "score", 8, dtype=torch.float32)
    assert torch.equal(a.score.weight, b.score.weight)
    assert not torch.equal(a.score.weight, c.score.weight)
    assert a.config.num_labels == 1
    assert a.config.pad_token_id == AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    assert heads.head_of(tiny_model) == "lm"


def test_a_saved_reward_model_keeps_its_head(tiny_model, tmp_path):
    import shutil

    model = heads.load(tiny_model, "score", 7, dtype=torch.float32)
    model.save_pretrained(tmp_path / "rm")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / f, tmp_path / "rm" / f)
    assert heads.head_of(tmp_path / "rm") == "score"
    again = heads.load(tmp_path / "rm", "score", 99, dtype=torch.float32)
    assert torch.equal(again.score.weight, model.score.weight)


def test_the_score_is_read_at_the_last_real_token_of_a_padded_batch(tiny_model):
    """Two sequences of different lengths in one right-padded batch (pair_batch) score as
    each does alone: the score sits at the last token that is not padding."""
    from snaketune.data.pairs import pair_batch
    from snaketune.evaluation.reward_eval import pair_scores

    model = heads.load(tiny_model, "score", 3, dtype=torch.float32).eval()
    rows = [{"example_id": "a", "input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100] * 3 + [8, 9, 10],
             "rejected_input_ids": [5, 6, 7, 11], "rejected_labels": [-100] * 3 + [11]},
            {"example_id": "b", "input_ids": [5, 12], "labels": [-100, 12],
             "rejected_input_ids": [5, 13, 14, 15, 16, 17, 18, 19], "rejected_labels":
             [-100] + [13, 14, 15, 16, 17, 18, 19]}]  # fmt: skip
    assert pair_batch(rows, model.config.pad_token_id)["attention_mask"].sum() < 4 * 8
    got = pair_scores(model, rows, 2, model.config.pad_token_id)
    for (c, r), row in zip(got, rows, strict=True):
        assert c == pytest.approx(sequence_score(model, row["input_ids"]), abs=1e-5)
        assert r == pytest.approx(sequence_score(model, row["rejected_input_ids"]), abs=1e-5)


def test_pair_figures_written_out_by_hand():
    from snaketune.evaluation.reward_eval import figures

    got = figures([(1.0, 0.0), (0.0, 2.0), (3.0, 1.0), (-1.0, -1.5)])
    margins = [1.0, -2.0, 2.0, 0.5]
    assert got["preference_accuracy"] == 0.75
    assert got["reward_margin"] == pytest.approx(0.375)
    assert got["reward_chosen"] == pytest.approx(0.75)
    assert got["reward_rejected"] == pytest.approx(0.375)
    want = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / 4
    assert got["pairwise_loss"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"eval_steps": 10}, "runs.p.eval_steps: a reward model is not scored while it trains"),
        ({"lora": {"r": 8, "alpha": 16, "modules_to_save": ["lm_head"]}},
         "runs.p.lora.modules_to_save: a reward model has no lm_head"),
        ({"dataset": "arith"}, "runs.p.dataset: 'arith' (format prompt_response) has no pairs"),
        ({"reward": {"center_rewards_coefficient": -1}}, "runs.p.reward.center_rewards_coefficient"),
        ({"reward": {"margn": "x"}}, "runs.p.reward.margn: unknown key; did you mean 'margin'?"),
    ],
)  # fmt: skip
def test_bad_reward_configs_get_one_line(change, line):
    config = reward_config()
    config["runs"]["p"].update(change)
    with pytest.raises(ConfigError) as err:
        validate_config(config, ROOT)
    assert str(err.value).startswith(line), str(err.value)
    assert "\n" not in str(err.value)


def test_a_reward_run_scores_its_own_start_and_shares_no_base_evaluation():
    """Its start (the model and the new head) is evaluated by rule evaluate_start with the
    run's seed; no base evaluation of the tiny model is planned for it."""
    from snaketune.evaluation import settings as evaluations
    from snaketune.methods import method_of
    from snaketune.plan import stages

    config = validate_config(reward_config(seed=5), ROOT)
    assert stages.base_metrics(config, "p", lambda: "") == "results/p/start_eval/metrics.json"
    assert all(e["run"] != "p" for e in stages.base_evaluations(config).values())
    run = config["runs"]["p"]
    args = evaluations.eval_args(run["eval"], "reward", method_of(run).eval_settings(run))
    assert "--method reward" in args and "--seed 5" in args


def test_a_reward_models_evaluations_are_planned_on_one_gpu_whatever_eval_asks():
    """evaluate.py scores a reward model in one process: the plan (the evaluate jobs'
    resources) says so, not the eval block's 2 x 2."""
    from snaketune.budget.evalplan import eval_layout

    config = reward_config(eval={"max_new_tokens": 16, "batch_size": 64, "nodes": 2,
                                 "gpus_per_node": 2})  # fmt: skip
    run = validate_config(config, ROOT)["runs"]["p"]
    for final in (False, True):
        layout = eval_layout(run, None, None, final)
        assert (layout.nodes, layout.gpus_per_node) == (1, 1), layout


def test_the_card_of_a_reward_model_says_how_to_score(tmp_path):
    from snaketune.evaluation.figures import headline, table
    from snaketune.export.hub import card_text

    spec = validate_config(reward_config(), ROOT)["runs"]["p"]
    metrics = {"head": "score", "preference": {"preference_accuracy": 0.93, "reward_margin": 2.1}}
    metrics["figures"] = table(
        metrics, headline(("preference_accuracy", "reward_margin"), None, (), generates=False)
    )  # as reward_eval writes
    text = card_text("p", spec, {"base": {"id": "tiny"}, "datasets": []}, metrics, "0" * 64,
                     "apache-2.0", "me/rm")  # fmt: skip
    assert "pipeline_tag: text-classification" in text and "reward-model" in text
    assert 'AutoModelForSequenceClassification.from_pretrained("me/rm")' in text
    assert "| preference accuracy (chosen ranked first) | 0.93 |" in text


# --------------------------------------------------------------- against the oracle


def test_margins_and_centring_of_unequal_micro_batches_give_the_global_batch_mean(
    tmp_path, tiny_model, fixtures_dir, monkeypatch
):
    """A step of 4 pairs on 2 ranks whose plan gave one rank 3 pairs and the other 1
    (micro_batch_size 2), each pair with a margin read from its dataset's column (by the
    example id's row) and centring on: the ranks' losses averaged (as DeepSpeed averages
    their gradients) are the loss of the 4 pairs written out by hand from plain
    transformers scores. Unweighted, the mean is off."""
    import datasets
    import pyarrow as pa
    from transformers import AutoTokenizer
    from trl import RewardConfig

    from snaketune.methods.reward_model import ScorePairCollator, margins_of, trainer_class

    path = fixtures_dir / "gsm8k-demo/pairs-train.jsonl"
    rows, _ = run_tokenize(tmp_path, "gsm8k_pairs", GSM8K_PAIRS, path, tiny_model)
    pairs = sorted({r["length"]: r for r in rows}.values(), key=lambda r: -r["length"])[:4]
    source = tmp_path / "resources/datasets/gsm8k_pairs"
    source.mkdir(parents=True)
    count = 1 + max(int(r["example_id"].split(":")[1]) for r in rows)
    pq.write_table(pa.table({"gap": [0.25 * (i % 7) - 0.5 for i in range(count)]}),
                   source / "data.parquet")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    margins = margins_of("gap", [p["example_id"] for p in pairs])
    assert len(set(margins.values())) > 1
    model = heads.load(tiny_model, "score", 11, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    args = RewardConfig(output_dir=str(tmp_path / "o"), use_cpu=True, bf16=False, report_to=[],
                        center_rewards_coefficient=0.05, max_length=None)  # fmt: skip
    trainer = trainer_class()(model=model, args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_list(pairs), planned=None,
                              run=RUN_OF_TWO)  # fmt: skip
    collate = ScorePairCollator(tok.pad_token_id, margins, None)

    def loss_of(micro):
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, collate(micro)).item()

    want = reward_pair_loss(model, pairs, 0.05, margins)
    assert sum([loss_of(pairs[:3]), loss_of(pairs[3:])]) / 2 == pytest.approx(want, rel=1e-5)
    assert sum([loss_of(pairs[:2]), loss_of(pairs[2:])]) / 2 == pytest.approx(want, rel=1e-5)
    assert reward_pair_loss(model, pairs, 0.05) != pytest.approx(want, rel=1e-3)  # margins count


def test_a_margin_column_that_is_missing_or_not_a_number_stops_the_job(tmp_path, monkeypatch):
    import pyarrow as pa

    from snaketune.core.errors import DataError
    from snaketune.methods.reward_model import margins_of

    source = tmp_path / "resources/datasets/p"
    source.mkdir(parents=True)
    pq.write_table(pa.table({"gap": [1.0, None], "label": ["a", "b"]}), source / "data.parquet")
    monkeypatch.chdir(tmp_path)
    assert margins_of("gap", ["p:0"]) == {"p:0": 1.0}
    with pytest.raises(DataError, match=r"^reward.margin: the dataset of 'p' has no column 'gp'"):
        margins_of("gp", ["p:0"])
    with pytest.raises(DataError, match=r"^reward.margin: pair p:1 has margin None"):
        margins_of("gap", ["p:0", "p:1"])


@pytest.fixture(scope="module")
def gsm8k_reward_pairs(tmp_path_factory, tiny_model, fixtures_dir):
    """The fixture's GSM8K-style pairs (sides of widely different lengths) tokenized and
    planned for 2 nodes x 1 device with micro_batch_size 2 (token-balanced: some steps give
    the ranks 1 and 3 pairs)."""
    work = tmp_path_factory.mktemp("reward_pairs")
    run_tokenize(work, "pairs", GSM8K_PAIRS, fixtures_dir / "gsm8k-demo/pairs-train.jsonl",
                 tiny_model)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(work / "pairs.tok.parquet"), "--nodes", "2", "--gpus-per-node", "1",
                    "--micro-batch-size", "2", "--gradient-accumulation-steps", "1", "--seed",
                    "28", "--packing", "--out", str(work / "shards")],
                   check=True, env=ENV, capture_output=True)  # fmt: skip
    return work


STEPS = 6


@pytest.mark.slow
def test_a_reward_model_on_two_nodes_with_unequal_pairs_per_rank_equals_the_oracle(
    gsm8k_reward_pairs, tiny_model, tmp_path
):
    """Every weight and a new score head on 2 nodes: the token-balanced plan gives the ranks
    unequal pair counts, and every step's loss equals the pairwise loss with centring of
    that step's 4 pairs written out by hand: plain transformers scores (each side alone,
    unpadded) of the model the previous step saved (step 1: the tiny model with the head
    transformers draws after seeding with the run's seed). Measured 2e-7 relative at
    worst; bound 1e-5. Each rank trained the pairs its plan gave it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    plan = planned_steps(gsm8k_reward_pairs / "shards", STEPS)
    counts = [tuple(len(r) for r in step) for step in plan]
    assert any(a != b for a, b in counts), counts  # unequal pair counts per rank
    spec = validate_config(reward_config(), ROOT)["runs"]["p"]
    spec.update(micro_batch_size=2, gradient_accumulation_steps=1, max_steps=STEPS,
                save_steps=1, save_total_limit=STEPS, learning_rate=1e-3, precision="fp32",
                warmup_ratio=0.0)  # fmt: skip
    spec.pop("eval", None)
    metrics = train_as_planned(tmp_path, spec, gsm8k_reward_pairs / "shards", tiny_model, plan)
    pad = AutoTokenizer.from_pretrained(tiny_model).pad_token_id
    set_seed(spec["seed"])
    start = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1,
                                                               dtype=torch.float32)  # fmt: skip
    start.config.pad_token_id = pad
    ckpts = tmp_path / "results/x/train/checkpoints"
    centre = spec["reward"]["center_rewards_coefficient"]
    assert centre, "the demo's run centres its rewards: the oracle checks that term too"
    for m, step in zip(metrics, plan, strict=True):
        k = m["step"]
        model = start.eval()
        if k > 1:
            model = AutoModelForSequenceClassification.from_pretrained(
                ckpts / f"checkpoint-{k - 1}", dtype=torch.float32).eval()  # fmt: skip
        want = reward_pair_loss(model, step[0] + step[1], centre)
        assert m["loss"] == pytest.approx(want, rel=1e-5), (k, counts[k - 1])
        assert 0.0 <= m["reward_accuracy"] <= 1.0


# ----------------------------------------------------------------------------- the chain


def chain_config() -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    overlay = load_yaml(OVERLAY)
    config["datasets"].update(copy.deepcopy(overlay["datasets"]))
    config["runs"].update(copy.deepcopy(overlay["runs"]))
    return validate_config(config, ROOT)


# a LoRA reward model beside the demo's, briefly: its adapter carries the score head, and
# the merge writes a sequence classifier
LORA_RUN = {"lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
            "max_steps": 16, "learning_rate": 3.0e-3, "save_steps": 8}  # fmt: skip


# GRPO from the demo's model scored by the demo's reward model (and correctness), briefly,
# on 2 emulated nodes; hot sampling, so a group's completions differ (the demo's model gives
# one answer at temperature 1: no advantage, no update, an adapter the merge refuses)
GRPO_RUN = {"init_from": "demo", "dataset": "arith", "method": "grpo",
            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
            "grpo": {"num_generations": 4, "max_completion_length": 8, "temperature": 2.0,
                     "rewards": {"model:rm_demo": 1.0, "correctness": 0.5}},
            "deepspeed": "zero2", "nodes": 2, "gpus_per_node": 1, "max_length": 256,
            "micro_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 3,
            "learning_rate": 1.0e-3, "save_steps": 100}  # fmt: skip


@pytest.fixture(scope="session")
def reward_chain(demo, tmp_path_factory):
    """A copy of the finished demo (the reward run's start), then `snakemake all publish`
    with the reward overlay (the reward run's checkpoints kept whole: a test resumes from
    the older one), a LoRA reward run and a GRPO run that scores with the reward model."""
    workdir = tmp_path_factory.mktemp("reward") / "w"
    subprocess.run(["cp", "-a", str(demo), str(workdir)], check=True)
    overlay = load_yaml(OVERLAY)
    lora = {**copy.deepcopy(overlay["runs"]["rm_demo"]), **LORA_RUN}
    del lora["publish"]
    # the LoRA reward run in the extended tier only (its merge test is there)
    extra = {"runs": {"grpo_rm": GRPO_RUN} if ci_tier() else {"rm_lora": lora, "grpo_rm": GRPO_RUN}}
    (workdir / "extra.yaml").write_text(yaml.safe_dump(extra))
    proc = snakemake("all", "publish", "--configfile", str(ROOT / "config/config.yaml"),
                     str(OVERLAY), str(workdir / "extra.yaml"), "--directory", str(workdir),
                     "--config", chain_runs(whole=("rm_demo",)))  # fmt: skip
    (workdir / "reward.out").write_text(proc.stdout + proc.stderr)
    return workdir


def oracle_figures(model, rows: list[dict]) -> tuple[float, float]:
    """Pairwise accuracy and mean margin of ``rows`` (tokenized pairs), each side scored
    alone by plain transformers."""
    margins = [sequence_score(model, r["input_ids"]) - sequence_score(model, r["rejected_input_ids"])
               for r in rows]  # fmt: skip
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


@pytest.mark.extended
@pytest.mark.slow
def test_the_demo_reward_model_ranks_held_out_pairs_it_started_at_chance_on(reward_chain):
    """The demo's reward model (every weight of the demo's model and a new score head, 2
    emulated nodes): held-out pairwise accuracy >= 0.9, from its start's near 0.5 (the
    demo's model with the head drawn from the run's seed). Both figures, and the mean margins,
    equal plain transformers' scores of each held-out side alone: the exported model loaded
    with AutoModelForSequenceClassification, and the start made as transformers makes it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    w = reward_chain
    metrics = json.loads((w / "results/rm_demo/eval/metrics.json").read_text())
    start = json.loads((w / "results/rm_demo/start_eval/metrics.json").read_text())
    got, began = metrics["preference"], start["preference"]
    assert got["preference_accuracy"] >= 0.9, got
    assert 0.3 <= began["preference_accuracy"] <= 0.7, began
    assert metrics["gain"]["preference_accuracy"] == pytest.approx(
        got["preference_accuracy"] - began["preference_accuracy"])  # fmt: skip
    rows = pq.read_table(next((w / "results/tokenized").glob("arith_pairs_test__*/data.parquet"))
                         ).to_pylist()  # fmt: skip
    assert got["pairs"] == len(rows) == 64
    trained = AutoModelForSequenceClassification.from_pretrained(
        w / "results/rm_demo/hf", dtype=torch.float32).eval()  # fmt: skip
    accuracy, margin = oracle_figures(trained, rows)
    assert got["preference_accuracy"] == accuracy
    assert got["reward_margin"] == pytest.approx(margin, rel=1e-4, abs=1e-5)
    base = w / "results/demo/merged_model"
    set_seed(chain_config()["runs"]["rm_demo"]["seed"])
    first = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1,
                                                               dtype=torch.float32)  # fmt: skip
    first.config.pad_token_id = AutoTokenizer.from_pretrained(base).pad_token_id
    accuracy, margin = oracle_figures(first.eval(), rows)
    assert began["preference_accuracy"] == accuracy
    assert began["reward_margin"] == pytest.approx(margin, rel=1e-4, abs=1e-5)
    train = read_jsonl(w / "results/rm_demo/train/metrics.jsonl")
    assert all("reward_accuracy" in m and "reward_margin" in m for m in train if "loss" in m)
    summary = (w / "results/summary.tsv").read_text().splitlines()
    header, row = summary[0].split("\t"), next(r for r in summary if r.startswith("rm_demo\t"))
    values = dict(zip(header, row.split("\t"), strict=True))
    assert float(values["preference_accuracy"]) == pytest.approx(got["preference_accuracy"])
    assert float(values["gain_preference_accuracy"]) > 0.2
    html = (w / "results/summary.html").read_text()  # the report: pairs, not generations
    assert "preference accuracy (chosen ranked first)" in html
    assert "ranked right: the chosen response scored higher" in html


@pytest.mark.slow
def test_the_published_reward_model_loads_and_scores_as_evaluated(reward_chain):
    """`snakemake publish`: the folder holds the exported reward model, loads with
    AutoModelForSequenceClassification, scores a held-out pair as the evaluation did, and
    its card says so (text-classification, the held-out pair figures, how to score)."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForSequenceClassification

    w = reward_chain
    folder = w / "results/rm_demo/publish"
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32)
    sample = json.loads((w / "results/rm_demo/eval/samples.jsonl").read_text().splitlines()[0])
    rows = pq.read_table(next((w / "results/tokenized").glob("arith_pairs_test__*/data.parquet"))
                         ).to_pylist()  # fmt: skip
    row = next(r for r in rows if r["example_id"] == sample["example_id"])
    assert sequence_score(model.eval(), row["input_ids"]) == pytest.approx(
        sample["chosen_score"], abs=1e-4)  # fmt: skip
    card = ModelCard.load(folder / "README.md")
    assert card.data.pipeline_tag == "text-classification" and "reward-model" in card.data.tags
    figures = {r.metric_type: r.metric_value for r in card.data.eval_results}
    metrics = json.loads((w / "results/rm_demo/eval/metrics.json").read_text())
    assert figures["preference_accuracy"] == pytest.approx(
        metrics["preference"]["preference_accuracy"])  # fmt: skip
    assert "## How to score" in card.text and str(w) not in card.text


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_reward_model_run_resumes_to_the_same_losses(reward_chain, tmp_path):
    """The pipeline's reward run again from its next-to-last checkpoint: the launcher
    killed two steps later (no orphan), the rerun resumes there, and every step after it
    logs the losses, accuracies and margins of the uninterrupted run."""
    w = reward_chain
    spec = pipeline_spec(w / "results/rm_demo/train", tmp_path)
    shards, model = w / "results/rm_demo/shards", w / "results/demo/merged_model"
    start, resumed = kill_and_resume(w / "results/rm_demo/train", tmp_path, spec, shards, model)
    reference = read_jsonl(w / "results/rm_demo/train/metrics.jsonl")
    for a, b in zip(resumed[start:], reference[start:], strict=True):
        for key in ("loss", "reward_accuracy", "reward_margin", "reward_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.extended
@pytest.mark.slow
def test_a_lora_reward_model_merges_into_the_sequence_classifier_it_trained(reward_chain):
    """A LoRA reward run: its adapter (peft's SEQ_CLS) carries the score head whole; the
    merged model is a sequence classifier with that head and no LM head, and scores every
    held-out side as the adapter on its base does (peft), which its evaluation reports."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    w = reward_chain
    adapter = w / "results/rm_lora/lora_adapters"
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    merged = w / "results/rm_lora/merged_model"
    config = json.loads((merged / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    with safe_open(merged / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "score.weight" in names and not any(n.startswith("lm_head.") for n in names)
    model = AutoModelForSequenceClassification.from_pretrained(merged, dtype=torch.float32)
    base = heads.load(w / "results/demo/merged_model", "score", 0, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    rows = pq.read_table(next((w / "results/tokenized").glob("arith_pairs_test__*/data.parquet"))
                         ).to_pylist()[:16]  # fmt: skip
    for r in rows:
        for ids in (r["input_ids"], r["rejected_input_ids"]):
            assert sequence_score(model.eval(), ids) == pytest.approx(
                sequence_score(peft, ids), abs=1e-4)  # fmt: skip
    metrics = json.loads((w / "results/rm_lora/eval/metrics.json").read_text())
    accuracy, _ = oracle_figures(model.eval(), pq.read_table(
        next((w / "results/tokenized").glob("arith_pairs_test__*/data.parquet"))).to_pylist())  # fmt: skip
    assert metrics["preference"]["preference_accuracy"] == accuracy


@pytest.mark.slow
def test_grpo_scores_its_completions_with_a_reward_run_s_model(reward_chain, monkeypatch):
    """GRPO with "model:rm_demo" on 2 emulated nodes: every step logs the reward model's
    mean score beside correctness's, and the step's reward is their weighted sum. The
    reward model as the job loads and calls it (the train job's own spec) scores each
    prompt and completion as plain transformers does (the prompt's turns from the source
    row and the completion in the reward model's chat template, each sequence alone), and
    ranks right sums above wrong ones."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from snaketune.evaluation import model_rewards

    w = reward_chain
    metrics = read_jsonl(w / "results/grpo_rm/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3], (w / "reward.out").read_text()[-3000:]
    for m in metrics:
        rm = m["reward_model:rm_demo_mean"]
        assert math.isfinite(rm) and "reward_model:rm_demo_std" in m
        assert m["reward"] == pytest.approx(0.5 * m["reward_correctness_mean"] + rm, abs=1e-5)
    spec = json.loads((w / "results/grpo_rm/train/run_config.json").read_text())
    assert spec["grpo"]["reward_models"]["models"]["rm_demo"]["path"] == "results/rm_demo/hf"
    monkeypatch.chdir(w)
    rows = pq.read_table("resources/datasets/arith/data.parquet").to_pylist()[:16]
    ids = [f"arith:{i}" for i in range(len(rows))]
    scorer = model_rewards.scorers(spec["grpo"], ids, torch.float32, 0)["model:rm_demo"]
    right = [r["answer"] for r in rows]
    wrong = [f"#### {int(r['answer'].split()[-1]) - 1}" for r in rows]  # as its pairs' are
    got = scorer(prompts=[""] * 32, completions=right + wrong, example_id=ids + ids)
    tokenizer = AutoTokenizer.from_pretrained(w / "results/rm_demo/hf")
    model = AutoModelForSequenceClassification.from_pretrained(w / "results/rm_demo/hf",
                                                               dtype=torch.float32).eval()  # fmt: skip
    want = []
    for row, completion in zip(rows + rows, right + wrong, strict=True):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]},
                                              {"role": "assistant", "content": completion}],
                                             tokenize=False)  # fmt: skip
        one = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            want.append(model(input_ids=one).logits[0, 0].item())
    assert got == pytest.approx(want, abs=1e-4)
    if not ci_tier():  # trained its documented 192 steps (the CI tier's 24 do not rank yet)
        assert sum(a > b for a, b in zip(got[:16], got[16:], strict=True)) >= 15, got
    # reward_model_normalization: group, each prompt's pair (right, wrong) as a group of 2
    scorer.normalization, scorer.group = "group", 2
    pairs = [c for pair in zip(right, wrong, strict=True) for c in pair]
    z = scorer(prompts=[""] * 32, completions=pairs, example_id=[e for e in ids for _ in "rw"])
    raw = np.array([s for pair in zip(got[:16], got[16:], strict=True) for s in pair])
    for k in range(0, 32, 2):
        g = raw[k : k + 2]
        assert z[k : k + 2] == pytest.approx(((g - g.mean()) / (g.std(ddof=1) + 1e-4)).tolist(),
                                             abs=1e-4)  # fmt: skip
