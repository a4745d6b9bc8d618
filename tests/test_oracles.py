"""Figures checked against independent computations (tests/oracles.py: plain transformers
on the tokenized rows, one example at a time): the held-out loss of the evaluate stage and
of the pass while training, on the demo's exported model and on a small set whose examples
have very different numbers of labelled tokens (so a mean over examples differs from the
mean over tokens)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch
from oracles import mean_nll, planned_steps
from test_tokenize import run_tokenize

# Measured on this machine (fp32 model; the product sums float32 cross entropies, the oracle
# float64 log-probs): relative differences of 1e-7 or less. The bound leaves room for another
# BLAS, and is far below what a changed divisor or a lost token moves (> 1e-2 here).
REL = 1e-5

# answers of 1 to 40 words: 3 to 100+ labelled tokens each
VARIED = [{"question": f"Say {i} words.", "answer": " ".join(["word"] * (1 + (i * 7) % 40))}
          for i in range(24)]  # fmt: skip
SPEC = {"format": "prompt_response", "columns": {"prompt": "question", "response": "answer"}}


@pytest.fixture(scope="module")
def varied_eval(tmp_path_factory, tiny_model):
    where = tmp_path_factory.mktemp("varied")
    rows, _ = run_tokenize(where, "varied", SPEC, VARIED, tiny_model)
    counts = {sum(lab != -100 for lab in r["labels"]) for r in rows}
    assert len(counts) > 10, counts  # the examples' token counts really differ
    return rows, where / "varied.tok.parquet"


def test_evaluate_stage_loss_is_the_token_mean_of_the_label_nll(tiny_model, varied_eval):
    from transformers import AutoModelForCausalLM

    from snaketune.evaluation.evaluate import heldout_loss

    rows, _ = varied_eval
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    want, tokens = mean_nll(model, rows)
    got = heldout_loss(model, rows, 5, pad_id=0)  # batches of 5: padding in most
    assert got["response_tokens"] == tokens
    assert got["loss"] == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("world", [1, 3])
def test_heldout_pass_loss_is_the_token_mean_of_the_label_nll(tiny_model, tokenizer, varied_eval,
                                                              world):  # fmt: skip
    """The pass while training (heldout_pass.HeldOut): each rank's share scored, then the
    ranks' sums added before dividing. Ranks are played here one after the other, their
    shares' sums combined by hand as the all-gather does."""
    from unittest import mock

    from transformers import AutoModelForCausalLM

    from snaketune.evaluation import heldout_pass

    rows, path = varied_eval
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    spec = {"path": str(path), "limit": None, "metric": "loss", "batch_size": 4,
            "max_new_tokens": 8, "answers": False}  # fmt: skip
    sums = []

    def gather(values, how):  # this rank's values now; all ranks' once each has run
        sums.append(values)
        return [sum(v[i] for v in sums) for i in range(len(values))]

    with mock.patch("snaketune.core.collective.gather_combined", gather):
        for rank in range(world):
            got = heldout_pass.HeldOut(spec, 42, rank, world, tokenizer).run(model)
    want, tokens = mean_nll(model, rows)
    assert got["response_tokens"] == tokens and got["examples"] == len(VARIED)
    assert got["loss"] == pytest.approx(want, rel=REL)


def test_the_demo_eval_loss_is_the_oracle_on_the_exported_model(demo):
    """The evaluate stage's held-out loss of the demo (tuned and base) against plain
    transformers on the eval set's tokenized labels, with the exported merged model."""
    from transformers import AutoModelForCausalLM

    metrics = json.loads((demo / "results/demo/eval/metrics.json").read_text())
    rows = pq.read_table(next((demo / "results/tokenized").glob("arith_test__*/data.parquet")))
    rows = rows.to_pylist()
    for model_dir, figure in ((demo / "results/demo/merged_model", metrics["loss"]),
                              (demo / "resources/models/tiny", metrics["base"]["loss"])):  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want, _ = mean_nll(model, rows)
        assert figure == pytest.approx(want, rel=REL), model_dir


# ----------------------------------------------------------------------------- SFT, 2 ranks

SFT_STEPS = 8


@pytest.mark.slow
def test_packed_sft_on_two_ranks_of_unequal_counts_equals_the_oracle(tmp_path, tiny_model,
                                                                     fixtures_dir):  # fmt: skip
    """The demo's packed LoRA run on 2 nodes, micro batch 2 x accumulation 2, over the
    chosen answers of the fixture's GSM8K-style pairs (57 to 331 tokens): the token-balanced
    plan gives the ranks 3 and 5 examples in two of the first 8 steps (counted from the
    shards; seed 2). Every step's loss equals the token mean of the NLL of that step's
    labelled tokens over both ranks, computed example by example, unpacked, under the
    previous step's saved adapter (peft). Measured 9e-8 relative at worst; bound 1e-4."""
    import subprocess
    import sys

    from conftest import ENV, ROOT, launch_train, read_jsonl, run_spec
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "chosen"}}
    run_tokenize(tmp_path, "chosen", spec, fixtures_dir / "gsm8k-demo/pairs-train.jsonl",
                 tiny_model)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(tmp_path / "chosen.tok.parquet"), "--nodes", "2", "--gpus-per-node", "1",
                    "--micro-batch-size", "2", "--gradient-accumulation-steps", "2", "--seed",
                    "2", "--packing", "--out", str(tmp_path / "shards")], check=True, env=ENV,
                   capture_output=True)  # fmt: skip
    plan = planned_steps(tmp_path / "shards", SFT_STEPS)
    counts = [tuple(len(r) for r in step) for step in plan]
    assert sum(a != b for a, b in counts) >= 2, counts
    run = run_spec(micro_batch_size=2, gradient_accumulation_steps=2, max_steps=SFT_STEPS,
                   save_steps=1, save_total_limit=SFT_STEPS, precision="fp32")  # fmt: skip
    proc = launch_train(tmp_path, run, tmp_path / "shards", tiny_model, "zero2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    metrics = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, SFT_STEPS + 1))
    ckpts = tmp_path / "results/x/train/checkpoints"
    for m, step in zip(metrics, plan, strict=True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        if m["step"] > 1:
            model = PeftModel.from_pretrained(model, str(ckpts / f"checkpoint-{m['step'] - 1}"))
        want, _ = mean_nll(model.eval(), step[0] + step[1])
        assert m["loss"] == pytest.approx(want, rel=1e-4), (m["step"], counts[m["step"] - 1])
