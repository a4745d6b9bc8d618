"""RLOO (method: rloo): TRL's RLOOTrainer on the planned prompts, with GRPO's rewards.

The per-step oracle: each step's gradient norm equals the paper's RLOO gradient (leave-one-
out baselines over every rank's completions, TRL's KL penalty on the reward) written out
with plain torch on the completions the ranks generated (their rollouts log) under the
model the step trained; the loss's value is 0 (one pass per generation: the ratio is 1, and
a micro batch's advantages, whole groups, sum to 0), so the gradient is the figure.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import (
    RLOO_CHAINED,
    ROOT,
    defaults_spec,
    kill_two_steps_on,
    launch_train,
    read_jsonl,
    train_as_planned,
)
from oracles import planned_steps, rloo_grad_norm
from test_tokenize import run_tokenize

from snaketune.core.errors import ConfigError
from snaketune.plan.config import load_yaml, validate_config

STEPS = 6
GENERATIONS = 2
# A reward of the user's kind that varies on a random model's text: the distinct words.
USER_REWARD = """\
def distinct(prompts, completions, **kwargs):
    return [len(set(c.split())) / 4 for c in completions]
"""


@pytest.fixture(scope="module")
def arith_prompts(tmp_path_factory, tiny_model, fixtures_dir):
    """The demo's arithmetic questions tokenized (as resources/datasets/arith, where a
    user's reward function reads their columns from) and planned for 2 nodes x 1 device,
    2 prompts a rank and step (micro_batch_size 4 = 2 prompts x 2 generations)."""
    import subprocess
    import sys

    from conftest import ENV

    work = tmp_path_factory.mktemp("arith_prompts")
    spec = load_yaml(ROOT / "config/config.yaml")["datasets"]["arith"]
    spec = {k: v for k, v in spec.items() if k not in ("source", "path")}
    run_tokenize(work / "resources/datasets", "arith", spec,
                 fixtures_dir / "arith-demo/train.jsonl", tiny_model, max_length=128)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(work / "resources/datasets/arith.tok.parquet"), "--nodes", "2",
                    "--gpus-per-node", "1", "--micro-batch-size", "2",
                    "--gradient-accumulation-steps", "1", "--seed", "3", "--no-packing", "--out",
                    str(work / "shards")], check=True, env=ENV, capture_output=True)  # fmt: skip
    (work / "rewards").mkdir()
    (work / "rewards/words.py").write_text(USER_REWARD)
    return work


def rewards_of(prompts: Path) -> dict[str, float]:
    """The built-in correctness and the user's function above (its file in ``prompts``)."""
    return {"correctness": 1.0, f"{prompts}/rewards/words.py:distinct": 0.5}


def rloo_spec(prompts: Path, **rloo) -> dict:
    """A LoRA RLOO run as a user's config writes it (the schema's defaults), with the
    settings these tests need: 2 generations, short completions, the rewards above, no
    adapter dropout (the oracle cannot draw TRL's dropout masks), fp32, a checkpoint a step."""
    spec = defaults_spec("rloo", lora={"dropout": 0.0}, max_steps=STEPS,
                         rloo={"num_generations": GENERATIONS, "max_completion_length": 8,
                               "rewards": rewards_of(prompts), **rloo})  # fmt: skip
    spec.update(gradient_accumulation_steps=1, save_steps=1, save_total_limit=STEPS,
                learning_rate=5e-2, precision="fp32",
                checkpoints={**spec["checkpoints"], "optimizer": "all"})  # fmt: skip
    spec.pop("eval", None)
    return spec


def rollouts_of(ids: Path, ranks: int) -> dict[int, list[dict]]:
    """Each step's rollouts, by rank, from the ranks' logs."""
    out: dict[int, list[dict]] = {}
    for q in range(ranks):
        for line in (ids / f"rank-{q}.rollouts.jsonl").read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], []).append(record)
    return out


def test_the_rloo_block_s_defaults_and_its_checks():
    spec = defaults_spec("rloo", micro_batch_size=8)
    assert spec["rloo"]["beta"] == 0.05 and spec["rloo"]["num_generations"] == 8
    assert spec["rloo"]["normalize_advantages"] is False
    assert spec["rloo"]["rewards"] == {"correctness": 1.0, "format": 0.2}
    with pytest.raises(ConfigError, match=r"runs\.x\.rloo\.num_generations: 8 does not divide "
                                          r"micro_batch_size 4"):  # fmt: skip
        defaults_spec("rloo")


@pytest.fixture(scope="module")
def rloo_run(arith_prompts, tiny_model, tmp_path_factory) -> dict:
    """LoRA RLOO on 2 nodes over the arithmetic prompts (their lengths differ), a checkpoint
    a step, each rank logging its rollouts: what the oracle test reads, and the run the
    kill-and-resume test continues."""
    w = tmp_path_factory.mktemp("rloo_run")
    (w / "resources").symlink_to(arith_prompts / "resources")
    spec = rloo_spec(arith_prompts)
    plan = planned_steps(arith_prompts / "shards", STEPS)
    metrics = train_as_planned(w, spec, arith_prompts / "shards", tiny_model, plan)
    rollouts = rollouts_of(w / "ids", 2)
    assert sorted(rollouts) == list(range(1, STEPS + 1))
    return {"spec": spec, "plan": plan, "metrics": metrics, "rollouts": rollouts,
            "ckpts": w / "results/x/train/checkpoints"}  # fmt: skip


@pytest.mark.slow
def test_rloo_on_two_nodes_equals_the_oracle(rloo_run, arith_prompts, tiny_model):
    """The 2-node RLOO run (rloo_run): each rank trains the prompts the plan gave it; every
    step from the second (the first's adapter is TRL's random init, which only checkpoint-1
    shows) has the grad_norm of the oracle's gradient (oracles.rloo_grad_norm) under the
    previous step's saved adapter with the base as the reference (beta, the schema's 0.05:
    the KL enters once the adapter moves), a loss of 0, and the reward the mean of the
    logged rewards; the user's function's values are its own on the decoded completions,
    and the prompts are the tokens before each row's first label."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec, plan, metrics = rloo_run["spec"], rloo_run["plan"], rloo_run["metrics"]
    rollouts, ckpts = rloo_run["rollouts"], rloo_run["ckpts"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = {r["example_id"]: r for r in pq.read_table(
        arith_prompts / "resources/datasets/arith.tok.parquet").to_pylist()}  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    names = list(rollouts[1][0]["rewards"])
    weights = dict(zip(names, rewards_of(arith_prompts).values(), strict=True))
    for m in metrics:
        k, ranks = m["step"], rollouts[m["step"]]
        for q, rank in enumerate(ranks):
            planned = [r["example_id"] for r in plan[k - 1][q]]
            assert rank["example_ids"] == [e for e in planned for _ in range(GENERATIONS)]
            for e, prompt in zip(rank["example_ids"], rank["prompt_ids"], strict=True):
                labels = rows[e]["labels"]
                first = next(i for i, x in enumerate(labels) if x != -100)
                assert prompt == rows[e]["input_ids"][:first], e
            texts = tokenizer.batch_decode(rank["completion_ids"], skip_special_tokens=True)
            assert rank["rewards"][names[1]] == [len(set(t.split())) / 4 for t in texts]
        given = [sum(weights[n] * r["rewards"][n][i] for n in names)
                 for r in ranks for i in range(len(r["completion_ids"]))]  # fmt: skip
        assert m["reward"] == pytest.approx(sum(given) / len(given), rel=1e-5)
        assert abs(m["loss"]) < 1e-6, m
        if k == 1:
            continue
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        model = PeftModel.from_pretrained(fresh, str(ckpts / f"checkpoint-{k - 1}"),
                                          is_trainable=True).eval()  # fmt: skip
        want = rloo_grad_norm(model, base, ranks, weights, spec["rloo"]["beta"], GENERATIONS)
        assert want > 0 and m["grad_norm"] == pytest.approx(want, rel=1e-4), (k, m)
    assert any(m["kl"] != 0 for m in metrics[1:]), metrics  # the KL term entered


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_rloo_run_resumes_exactly(rloo_run, arith_prompts, tiny_model, tmp_path):
    """The 2-node RLOO run again from its checkpoint-3, its launcher killed two steps on (no
    orphan), rerun: it resumes, logs each step once, and its rollouts and figures are the
    uninterrupted run's (each chain's own kill-and-resume: the extended tier)."""
    spec, metrics, rollouts, ckpts = (rloo_run[k] for k in ("spec", "metrics", "rollouts", "ckpts"))
    b = tmp_path / "b"
    shutil.copytree(ckpts, b / "results/x/train/checkpoints")
    (b / "resources").symlink_to(arith_prompts / "resources")
    for k in range(4, STEPS + 1):
        shutil.rmtree(b / f"results/x/train/checkpoints/checkpoint-{k}")
    live = b / "results/x/train/checkpoints/metrics.jsonl"
    proc = launch_train(b, spec, arith_prompts / "shards", tiny_model, "zero2")
    reached = kill_two_steps_on(proc, live, 3, STEPS)  # no orphan worker
    first = (b / "results/x/train/logs/attempt-1.log").read_text()
    assert "resuming from checkpoint-3" in first and reached, first[-3000:]
    out, _ = launch_train(b, spec, arith_prompts / "shards", tiny_model, "zero2",
                          "--log-example-ids", str(b / "ids")).communicate(timeout=600)  # fmt: skip
    assert re.search(r"resuming from checkpoint-[3-5]\b", out), out[-3000:]
    resumed = read_jsonl(b / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))  # each step once
    for got, want in zip(resumed, metrics, strict=True):
        for key in ("grad_norm", "reward", "kl"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (got["step"], key)
    again = rollouts_of(b / "ids", 2)
    for k, ranks in again.items():
        assert [r["completion_ids"] for r in ranks] == [r["completion_ids"] for r in
                                                        rollouts[k]], k  # fmt: skip
    assert not math.isnan(resumed[-1]["grad_norm"])


def test_a_model_reward_names_a_reward_run_for_rloo_too():
    """The `model:<run>` rewards are the rollout methods' alike: one line for a run that
    trains no reward model, under the RLOO block's name."""
    config = load_yaml(ROOT / "config/config.yaml")
    config["runs"]["rl"] = {**{k: config["runs"]["demo"][k] for k in ("model", "dataset")},
                            "method": "rloo", "nodes": 1, "gpus_per_node": 1,
                            "max_length": 128, "micro_batch_size": 8, "max_steps": 2,
                            "learning_rate": 1e-4, "rloo": {"rewards": {"model:demo": 1.0}}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"runs\.rl\.rloo\.rewards: 'model:demo'"):
        validate_config(config, ROOT)


@pytest.mark.slow
def test_rloo_after_sft_reaches_evaluation_with_its_headline(grpo_chain):
    """The chain SFT -> RLOO from one config through the pipeline (the GRPO run's rollouts
    and rewards, the user's function among them, as method rloo): each step's reward
    figures, its held-out evaluation against its start (the SFT run's merged model) led by
    exact match, its merged model, the reward panel of its training plot."""
    from snaketune.app.plots import training_svg

    w = grpo_chain
    metrics = read_jsonl(w / "results/rloo_demo/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, RLOO_CHAINED["max_steps"] + 1))
    mine = "reward_config/rewards/arith.py:sum_from_question_mean"
    for m in metrics:
        for key in ("loss", "grad_norm", "reward", "reward_std", "reward_correctness_mean",
                    "reward_format_mean", mine, "kl", "completion_length"):  # fmt: skip
            assert key in m, (key, m)
    cfg = json.loads((w / "results/rloo_demo/train/run_config.json").read_text())
    assert cfg["method"] == "rloo" and cfg["init_from"] == "sft_demo"
    assert set(cfg["code_sha256"]) == {"config/rewards/arith.py:sum_from_question"}
    sft = json.loads((w / "results/sft_demo/eval/metrics.json").read_text())
    got = json.loads((w / "results/rloo_demo/eval/metrics.json").read_text())
    assert got["headline"][0] == "exact_match" and 0 <= got["exact_match"] <= 1
    assert got["base"]["exact_match"] == sft["exact_match"]  # its start: the SFT run
    assert (w / "results/rloo_demo/merged_model/config.json").is_file()
    log = (w / "logs/train/rloo_demo.log").read_text()
    assert "RLOO: " in log and "x 8 generations" in log, log[-2000:]
    from snaketune.methods import method_named

    assert 'id="reward"' in training_svg(metrics, "rloo_demo", None,
                                         panel=method_named("rloo").panel)  # fmt: skip
