"""GRPO after SFT (config/grpo_demo.yaml over the demo's config) and publishing.

One pipeline for the slow tests (the `grpo_chain` fixture): on a copy of the finished demo and
its short SFT run (the `sft_demo` fixture, shared with the DPO chain), `snakemake publish`
trains GRPO from the SFT run's merged model on 2 emulated
nodes, converts, merges and evaluates both, and writes the dry-run publish folder."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import yaml
from conftest import (
    ENV,
    FAKE_SECRETS,
    ROOT,
    chain_runs,
    kill_and_resume,
    launch_train,
    leaked_secrets,
    pipeline_spec,
    read_jsonl,
)

from snaketune.app.plots import training_svg
from snaketune.app.summary import summary_row
from snaketune.core.heldout import split_rows
from snaketune.data.batches import PlanBatches
from snaketune.evaluation.rewards import correctness, format_reward
from snaketune.methods import method_named
from snaketune.methods.rollout_trainer import group_batches
from snaketune.methods.rollouts import step_fields
from snaketune.plan import stages, trainjob
from snaketune.plan.config import load_yaml, validate_config

OVERLAY = ROOT / "config" / "grpo_demo.yaml"


def chain_config() -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    config["runs"].update(copy.deepcopy(load_yaml(OVERLAY)["runs"]))
    return validate_config(config, ROOT)


def rl_spec(w, workdir, *drop: str) -> dict:
    """rl_demo's train spec as the chain's pipeline gave it (its reward code's digest
    included), for a training started in ``workdir``, which gets the chain's resources/
    (the source dataset the user's reward function reads its columns from)."""
    run = chain_config()["runs"]["rl_demo"]
    spec = {k: v for k, v in json.loads(trainjob.train_spec(run)).items() if k not in drop}
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "resources").symlink_to(w / "resources")
    return spec


# ----------------------------------------------------------------------------- units


def test_correctness_reward_checks_the_final_answer_against_the_reference():
    got = correctness(["#### 46", "#### 47", "so 46", "#### 46.0", ""], ["#### 46"] * 5)
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0]
    # GSM8K references: the worked answer, then "#### N"
    assert correctness(["She has 72 now.\n#### 72"], ["48/2 = <<48/2=24>>24\n#### 72"]) == [1.0]


def test_format_reward_wants_a_final_number_line():
    got = format_reward(["#### 46", "x\n#### 1,234", "#### 46 apples", "46", "#### 4\nmore"])
    assert got == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_step_record_names_each_reward():
    logs = {"loss": 0.1, "reward": 1.1, "reward_std": 0.2, "kl": 0.01,
            "completions/mean_length": 5.0, "rewards/correctness/mean": 0.9,
            "rewards/correctness/std": 0.3, "rewards/format/mean": 1.0,
            "rewards/format/std": 0.0, "entropy": 0.5}  # fmt: skip
    assert step_fields(logs) == {
        "reward": 1.1, "reward_std": 0.2, "kl": 0.01, "completion_length": 5.0,
        "reward_correctness_mean": 0.9, "reward_correctness_std": 0.3,
        "reward_format_mean": 1.0, "reward_format_std": 0.0,
    }  # fmt: skip


def test_group_batches_repeat_each_planned_prompt_in_a_row():
    import numpy as np

    # 3 steps x 2 micro batches of 1 prompt (rows 0..5), 2 generations each
    plan = PlanBatches(np.array([0, 0, 1, 1, 2, 2]), np.array([0, 1, 0, 1, 0, 1]), 3, 2, seed=7)
    sampler = group_batches(plan, 2)
    first = list(sampler)
    # a step's prompts, each twice in a row, given once per accumulation pass
    assert first == [[0, 0, 1, 1]] * 2 + [[2, 2, 3, 3]] * 2 + [[4, 4, 5, 5]] * 2
    assert len(sampler) == 6
    second = list(sampler)  # the next epoch: the same steps, permuted
    assert sorted(map(tuple, second)) == sorted(map(tuple, first)) and second != first


# ----------------------------------------------------------------------------- the chain


def quarter_means(values: list[float]) -> tuple[float, float]:
    n = len(values) // 4
    return sum(values[:n]) / n, sum(values[-n:]) / n


@pytest.mark.extended
@pytest.mark.slow
def test_grpo_after_sft_learns_on_two_nodes(grpo_chain):
    w = grpo_chain
    metrics, held = split_rows(read_jsonl(w / "results/rl_demo/train/metrics.jsonl"))
    steps = chain_config()["runs"]["rl_demo"]["max_steps"]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:  # what a GRPO step logs
        for key in ("loss", "reward", "reward_std", "reward_correctness_mean",
                    "reward_correctness_std", "reward_format_mean", "reward_format_std",
                    "kl", "completion_length", "tokens_per_s"):  # fmt: skip
            assert key in m, (key, m)
    # "learns": the mean reward rises by a margin. Measured (docs/benchmarks.md, "GRPO after
    # SFT"): first quarter 0.594 -> last 1.059 (+0.47); about half of that is asked.
    first, last = quarter_means([m["reward"] for m in metrics])
    assert last >= first + 0.25, (first, last)
    # the user's function (config/rewards/arith.py, reading the dataset's question column)
    # is logged by its key and rises with the rest; summary.tsv names its quarters
    mine = "reward_config/rewards/arith.py:sum_from_question_mean"
    first_mine, last_mine = quarter_means([m[mine] for m in metrics])
    assert last_mine >= first_mine + 0.15, (first_mine, last_mine)
    row = summary_row(
        "rl_demo", chain_config()["runs"]["rl_demo"], w / "results/rl_demo/train", None, None
    )  # summary.tsv's row (publish stops before the report)
    column = "reward_last_quarter:config/rewards/arith.py:sum_from_question"
    assert float(row[column]) == pytest.approx(last_mine, abs=1e-3)
    provenance = json.loads((w / "results/rl_demo/train/provenance.json").read_text())
    assert set(provenance["config"]["code_sha256"]) == {"config/rewards/arith.py:sum_from_question"}
    log = (w / "logs/train/rl_demo.log").read_text()
    assert re.search(r"\bx 1 devices x 2 nodes x accumulation", log), log[-2000:]
    sft = json.loads((w / "results/sft_demo/eval/metrics.json").read_text())
    rl = json.loads((w / "results/rl_demo/eval/metrics.json").read_text())
    # held-out exact match gains: measured 20.3% -> 57.8% (before the user reward, over three
    # seeds: 50.0%, 56.3%, 62.5%), at least +29.7 points; asked: +15 points (about 10 of the
    # 64 questions)
    assert rl["exact_match"] >= sft["exact_match"] + 0.15, (sft["exact_match"], rl["exact_match"])
    # the base of a GRPO run is the run it started from: the gain is what RL added
    assert rl["base"]["exact_match"] == sft["exact_match"]
    assert rl["gain"]["exact_match"] == pytest.approx(rl["exact_match"] - sft["exact_match"])
    # held-out exact match while training (eval_steps 80): before the first step it is the
    # SFT model's, at the last the GRPO model's, as the evaluate stage scored them (greedy
    # generations of the same examples, split across the 2 ranks)
    assert [m["step"] for m in held] == [0, 80, 160, 240, 320]
    assert held[0]["heldout_exact_match"] == pytest.approx(sft["exact_match"], abs=1e-9)
    assert held[-1]["heldout_exact_match"] == pytest.approx(rl["exact_match"], abs=1e-9)
    # ... and the report draws them over the reward curve (GRPO's panel, as scripts/report.py)
    assert 'id="heldout_exact_match"' in training_svg(
        read_jsonl(w / "results/rl_demo/train/metrics.jsonl"), "rl_demo", None,
        panel=method_named("grpo").panel)  # fmt: skip
    # the GRPO run trained from the SFT run's merged model, and made its own
    assert (w / "results/rl_demo/lora_adapters").is_dir()
    assert (w / "results/rl_demo/merged_model/config.json").is_file()
    cfg = json.loads((w / "results/rl_demo/train/run_config.json").read_text())
    assert cfg["method"] == "grpo" and cfg["init_from"] == "sft_demo"


@pytest.mark.extended
@pytest.mark.slow
def test_killed_grpo_run_resumes_to_the_same_rewards_and_losses(grpo_chain, tmp_path):
    """The pipeline's GRPO run again from its next-to-last checkpoint (its checkpoints
    directory copied, the last checkpoint left out): the launcher is killed two steps later
    (no orphan), the rerun resumes from that checkpoint again, and the steps after it log
    the rewards and losses of the uninterrupted pipeline run: the rollouts after a resume
    are the same samples."""
    w = grpo_chain
    spec = pipeline_spec(w / "results/rl_demo/train", tmp_path)  # its held-out passes too
    shards, model = w / "results/rl_demo/shards", w / "results/sft_demo/merged_model"
    start, resumed = kill_and_resume(w / "results/rl_demo/train", tmp_path, spec, shards, model)
    reference = read_jsonl(w / "results/rl_demo/train/metrics.jsonl")
    resumed, reference = split_rows(resumed)[0], split_rows(reference)[0]
    for a, b in zip(resumed[start:], reference[start:], strict=True):
        for key in ("loss", "reward", "reward_correctness_mean", "reward_format_mean", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


@pytest.mark.slow
def test_publish_dry_run_writes_the_folder_with_a_model_card(grpo_chain):
    from huggingface_hub import ModelCard

    w = grpo_chain
    folder = w / "results/rl_demo/publish"
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in names and "config.json" in names, names
    assert "tokenizer.json" in names and "README.md" in names, names
    assert not any(n.startswith(("training_args", "provenance", "optimizer")) for n in names)
    receipt = json.loads((w / "results/rl_demo/publish.json").read_text())
    assert receipt["dry_run"] is True and receipt["private"] is True
    assert "url" not in receipt  # nothing uploaded
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "apache-2.0"
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    rl = json.loads((w / "results/rl_demo/eval/metrics.json").read_text())
    assert results["exact_match"] == pytest.approx(rl["exact_match"])
    assert results["math_verify"] == pytest.approx(rl["math_verify"])
    assert "model-index" in (folder / "README.md").read_text()
    text = card.text
    assert "sft_demo" in text and "grpo" in text and "num_generations" in text
    prov = w / "results/rl_demo/merged_model/provenance.json"
    import hashlib

    assert hashlib.sha256(prov.read_bytes()).hexdigest() in text
    # the fake HF_TOKEN of the test environment is nowhere in what the pipeline wrote
    assert ENV["HF_TOKEN"] == FAKE_SECRETS["HF_TOKEN"]
    assert leaked_secrets(w) == []


def test_publish_without_a_license_says_how_to_set_one(tmp_path):
    """The tiny base model's card names no license: without publish.license, one line."""
    from snaketune.core.errors import UserError
    from snaketune.export.hub import build_folder

    (tmp_path / "model").mkdir()
    (tmp_path / "model/provenance.json").write_text("{}")
    spec = {"model": "tiny", "method": "lora", "dataset_sources": []}
    with pytest.raises(
        UserError, match=r"runs.x.publish.license: the base model's card names no license"
    ):
        build_folder("x", spec, tmp_path / "model", None, tmp_path / "resources",
                     {"repo_id": "a/b"}, tmp_path / "out")  # fmt: skip


def test_grpo_overlay_is_a_valid_chain():
    config = chain_config()
    rl = config["runs"]["rl_demo"]
    assert rl["model"] == "tiny" and rl["packing"] is False
    assert rl["grpo"]["beta"] == 0.04  # our default (TRL's is 0)
    assert yaml.safe_load(OVERLAY.read_text())["runs"]["rl_demo"]["publish"]["dry_run"] is True


def test_upload_creates_a_private_repo_and_needs_a_token(tmp_path, monkeypatch):
    """upload() with huggingface_hub's HfApi replaced: the repo is created private unless
    told, the folder is uploaded as it is; without a token, one line and no call."""
    import huggingface_hub

    from snaketune.core.errors import UserError
    from snaketune.export import hub as publish

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw["repo_id"], kw["folder_path"]))
            return type("Info", (), {"oid": "abc123"})()

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_x")
    done = publish.upload(tmp_path, "me/model", private=True)
    assert done == {"url": "https://huggingface.co/me/model", "commit": "abc123"}
    assert calls == [
        ("create_repo", "me/model", {"private": True, "exist_ok": True, "repo_type": "model"}),
        ("upload_folder", "me/model", str(tmp_path)),
    ]
    calls.clear()
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(UserError, match="no Hugging Face token; export HF_TOKEN"):
        publish.upload(tmp_path, "me/model", private=False)
    assert calls == []


@pytest.mark.slow
def test_a_reward_function_that_raises_fails_the_first_step_in_one_line(grpo_chain, tmp_path):
    """A user's function that raises on some completions: the job fails at its first step
    with one line naming the file, the function, the completion and the fix (the launcher's
    last line, from checkpoints/health/fatal.json); no step is logged."""
    w = grpo_chain
    (tmp_path / "bad.py").write_text(
        "def picky(prompts, completions, **kwargs):\n"
        "    return [1.0 / (len(c) % 3) for c in completions]\n"
    )
    spec = rl_spec(w, tmp_path, "eval_steps")
    spec.update(max_steps=2, save_steps=100)
    spec["grpo"] = {**spec["grpo"], "rewards": {"correctness": 1.0, "bad.py:picky": 1.0}}
    del spec["code_sha256"]  # a function the pipeline never saw
    shards, model = w / "results/rl_demo/shards", w / "results/sft_demo/merged_model"
    proc = launch_train(tmp_path, spec, shards, model, "zero2")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0, log[-3000:]
    line = re.search(r"reward bad\.py:picky raised ZeroDivisionError: float division by zero "
                     r"on completion \d+ of this step \(32 completions\) \(step 1\); fix the function "
                     r"\(docs/rewards.md\) and run snakemake again", log)  # fmt: skip
    assert line, log[-4000:]
    live = tmp_path / "results/x/train/checkpoints/metrics.jsonl"
    assert not live.exists() or not live.read_text().strip(), live.read_text()


@pytest.mark.slow
def test_a_grpo_run_whose_rewards_never_fire_warns_in_its_first_steps(grpo_chain, tmp_path):
    """Rewards that never vary within a group (a user's function scoring every completion 0)
    and completions of one token, never finished: within the first 5 steps the train
    log warns once, naming reward_std and the clipped completions and what to change, and
    warnings.jsonl keeps it for the summary, the report and `snaketune status`."""
    w = grpo_chain
    (tmp_path / "never.py").write_text(
        "def never(prompts, completions, **kwargs):\n    return [0.0 for _ in completions]\n"
    )
    spec = rl_spec(w, tmp_path, "eval_steps")
    spec.update(max_steps=6, save_steps=100)
    spec["grpo"] = {**spec["grpo"], "rewards": {"never.py:never": 1.0},
                    "max_completion_length": 1}  # fmt: skip
    del spec["code_sha256"]  # a function the pipeline never saw
    shards, model = w / "results/rl_demo/shards", w / "results/sft_demo/merged_model"
    proc = launch_train(tmp_path, spec, shards, model, "zero2")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    warned = [ln for ln in log.splitlines() if "no learning signal: reward_std 0" in ln]
    assert len(warned) == 1, log[-4000:]
    rows = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    assert all(r["reward_std"] == 0 and r["completion_clipped"] == 1 for r in rows[:5]), rows
    assert "every completion is cut at grpo.max_completion_length (1) (completion_clipped " in (
        warned[0])  # fmt: skip
    steps = [r["step"] for r in rows]
    (kept,) = read_jsonl(tmp_path / "results/x/train/warnings.jsonl")
    assert kept["check"] == "reward_std" and kept["step"] <= 5 and steps[-1] == 6


@pytest.mark.slow
def test_an_edited_reward_function_retrains_the_grpo_run_alone(grpo_chain):
    """The finished chain, dry run as the fixture ran it: nothing to train. Then the user
    edits the reward function's file (a copy in the working directory, found before the
    project's): the GRPO run's training is due again (its code digest is in the train
    job's params), the SFT run's is not."""
    from conftest import snakemake

    w = grpo_chain
    args = ("publish", "-n", "--configfile", str(ROOT / "config/config.yaml"),
            str(OVERLAY), "--directory", str(w), "--config",
            chain_runs("sft_demo", whole=("rl_demo",)))  # fmt: skip
    trains = re.compile(r"(?m)^rule train:\n(?:    .*\n)*?    wildcards: run=(\w+)")
    assert trains.findall(snakemake(*args).stdout) == []
    assert not (w / "config").exists()
    mine = w / "config/rewards/arith.py"
    mine.parent.mkdir(parents=True)
    try:
        mine.write_text((ROOT / "config/rewards/arith.py").read_text() + "\n# edited\n")
        proc = snakemake(*args)
    finally:
        shutil.rmtree(w / "config")
    assert trains.findall(proc.stdout) == ["rl_demo"], proc.stdout[-3000:]


@pytest.mark.extended
@pytest.mark.slow
def test_grpo_on_a_4bit_base(grpo_chain, tmp_path):
    """rl_demo on a 4-bit base (lora.quantize): 4-bit in the worker (read from its modules),
    and its KL reference is that same 4-bit base with the adapter off, so the first step's KL
    is 0 (the adapter starts as the identity); the adapter and its quantization record are
    written."""
    from snaketune.core import qlora

    w = grpo_chain
    spec = rl_spec(w, tmp_path)
    spec.update(max_steps=6, save_steps=100)
    spec["lora"] = {**spec["lora"], "quantize": "4bit"}
    shards, model = w / "results/rl_demo/shards", w / "results/sft_demo/merged_model"
    proc = launch_train(tmp_path, spec, shards, model, "zero2")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    assert "4-bit base: 14 linear layers in nf4" in log, log[-3000:]
    rows = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert abs(rows[0]["kl"]) < 1e-6, rows[0]
    assert all(r["loss"] == r["loss"] and r["reward"] == r["reward"] for r in rows)  # no NaN
    assert qlora.read_record(tmp_path / "results/x/train/model")["modules"]


def test_grpo_plans_as_many_prompts_on_every_rank_whatever_their_lengths():
    """TRL's GRPOTrainer slices each rank's completions out of the gathered ones by equal
    counts, so a GRPO plan never balances by tokens: on prompts of 10 to 400 tokens every
    rank gets the same number of prompts in every step (an SFT or DPO plan of the same
    lengths gives unequal counts; the ragged gather serves those)."""
    import numpy as np

    from snaketune.data.shard import Layout, plan

    config = chain_config()
    job = stages.shard_job(config, "rl_demo")
    assert job["packing"] == "--no-packing"
    lengths = np.random.default_rng(0).integers(10, 400, size=512)
    for balance, equal in ((False, True), (True, False)):
        p = plan(lengths, Layout(2, 2, 4, 2), 42, balance)
        counts = {tuple(np.bincount(p.rank[p.step == k], minlength=4)) for k in range(p.steps)}
        assert (counts == {(8, 8, 8, 8)}) is equal, counts
