"""Sweeps (snaketune.plan.sweep): a run's `sweep` expanded into members, validated before any
job, the best member selected; through the workflow, shared stages run once."""

from __future__ import annotations

import copy
import itertools
import json
import re
import subprocess

import pytest
import yaml
from conftest import (
    ROOT,
    STOP_SWEEP,
    STOP_SWEEP_STEPS,
    ci_tier,
    read_jsonl,
    snakemake,
    started,
)

from snaketune.app.selection import select
from snaketune.core.errors import ConfigError
from snaketune.plan.config import load_yaml, validate_config
from snaketune.plan.sweep import member_name

GRID = {"learning_rate": [0.003, 0.006], "lora.r": [4, 8]}
MEMBERS = ["demo-learning_rate_0p003-r_4", "demo-learning_rate_0p003-r_8",
           "demo-learning_rate_0p006-r_4", "demo-learning_rate_0p006-r_8"]  # fmt: skip


def demo_with(sweep=None, **run) -> dict:
    config = load_yaml(ROOT / "config/config.yaml")
    if sweep is not None:
        config["runs"]["demo"]["sweep"] = sweep
    config["runs"]["demo"].update(run)
    return config


def test_a_grid_expands_into_named_members_with_their_values():
    config = validate_config(demo_with(GRID), ROOT)
    assert list(config["runs"]) == MEMBERS
    member = config["runs"]["demo-learning_rate_0p006-r_4"]
    assert member["learning_rate"] == 0.006 and member["lora"]["r"] == 4
    assert member["lora"]["alpha"] == 16  # the rest of the run as it was
    assert member["sweep_of"] == {"run": "demo", "values": {"learning_rate": 0.006, "lora.r": 4},
                                  "select": {"metric": "auto"}}  # fmt: skip
    assert "sweep" not in member and "sweep_select" not in member


def test_member_names_are_safe_short_and_readable():
    assert member_name("demo", [("learning_rate", 2e-05), ("dataset", "gsm8k/main")]) == (
        "demo-learning_rate_2e-05-dataset_gsm8k_main"
    )
    assert member_name("x", [("lora.r", 8), ("grpo.r", 2), ("packing", True)]) == (
        "x-lora_r_8-grpo_r_2-packing_true"
    )
    long = member_name("a_rather_long_run_name", [("learning_rate", 0.000123456789),
                                                  ("dataset", "a_long_dataset_name")])  # fmt: skip
    assert len(long) == 64 and re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", long)
    assert re.fullmatch(r"a_rather_long_run_name-learning_rate_0p000123456789-dat-[0-9a-f]{8}",
                        long)  # fmt: skip


@pytest.mark.parametrize(
    ("sweep", "select_rule", "message"),
    [
        ({"lora.rr": [4]}, None, "runs.demo.sweep: a run has no key 'lora.rr'; did you mean lora.r?"),
        ({"learning_rat": [1.0]}, None,
         "runs.demo.sweep: a run has no key 'learning_rat'; did you mean learning_rate?"),
        ({"learning_rate": []}, None,
         "runs.demo.sweep.learning_rate: give a non-empty list of values (got [])"),
        ({"learning_rate": [0.1, "fast"]}, None, "runs.demo-learning_rate_fast.learning_rate: "),
        ({"seed": list(range(9)), "learning_rate": [0.1 * i for i in range(1, 9)]}, None,
         "runs.demo.sweep: 9 x 8 = 72 members, more than max_sweep_runs (64)"),
        (GRID, {"metric": "exactmatch"},
         "runs.demo.sweep_select.metric: 'exactmatch' is not a figure of the evaluation"),
    ],
    ids=["closest-nested", "closest", "empty", "bad-value", "too-many", "metric"],
)  # fmt: skip
def test_bad_sweeps_are_one_line_before_any_job(sweep, select_rule, message):
    config = demo_with(sweep, **({"sweep_select": select_rule} if select_rule else {}))
    with pytest.raises(ConfigError) as err:
        validate_config(config, ROOT)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("metric", ["heldout_kl", "teacher_loss", "chrf", "stop_rate"])
def test_every_figure_the_evaluation_describes_selects_a_sweep(metric):
    """The selectable figures are the evaluation's own description of its figures
    (snaketune.evaluation.figures), each in its direction: distillation's headline,
    heldout_kl, selects the member with the lowest."""
    config = validate_config(demo_with(GRID, sweep_select={"metric": metric}), ROOT)
    selects = [r["sweep_of"]["select"] for r in config["runs"].values() if "sweep_of" in r]
    lower = metric in ("heldout_kl", "teacher_loss")
    assert selects and all(
        s == {"metric": metric, "mode": "min" if lower else "max"} for s in selects
    )


def test_the_best_member_by_any_figure_and_either_direction():
    members = {
        "a": {"values": {"lr": 1}, "figures": {"exact_match": 0.5, "loss": 1.2,
                                               "lm_eval:arith:exact_match,none": 0.7}},
        "b": {"values": {"lr": 2}, "figures": {"exact_match": 0.6, "loss": 1.4,
                                               "lm_eval:arith:exact_match,none": 0.6}},
    }  # fmt: skip
    assert select(members, {"metric": "exact_match", "mode": "max"})["best"] == "b"
    assert select(members, {"metric": "loss", "mode": "min"})["best"] == "a"
    best = select(members, {"metric": "lm_eval:arith:exact_match,none", "mode": "max"})
    assert best["best"] == "a" and best["values"] == {"lr": 1} and best["value"] == 0.7
    assert [m["run"] for m in best["members"]] == ["a", "b"]
    with pytest.raises(ConfigError, match="stop_rate is not in the metrics of a"):
        select(members, {"metric": "stop_rate", "mode": "max"})


def test_validate_lists_the_members_and_the_dry_run_shares_the_data_stages(tmp_path, capsys):
    from snaketune.app.cli import main

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(demo_with(copy.deepcopy(GRID))))
    assert main(["validate", str(path), "--root", str(ROOT)]) == 0
    assert json.loads(capsys.readouterr().out)["runs"] == MEMBERS
    proc = snakemake("-n", "--configfile", str(path), "--directory", str(tmp_path / "w"))
    jobs = dict(re.findall(r"(?m)^([a-z_]+)\s+(\d+)$", proc.stdout))
    assert jobs["train"] == "4" and jobs["evaluate"] == "4" and jobs["select_sweep"] == "1"
    # one tokenized training set and one eval set, one shard plan: the members differ only
    # in what training does with them
    assert jobs["tokenize_dataset"] == "2" and jobs["shard_dataset"] == "1", jobs


def test_auto_selects_on_the_first_figure_of_the_members_headline():
    """Chat data (free-text references): the headline the evaluation wrote leads with the
    held-out loss, so auto picks the lowest, and says why; GSM8K-style references lead with
    exact match (max); a DPO run's headline with its preference accuracy (max); members
    without a headline (evaluations from before it) fall back to the loss."""
    from snaketune.evaluation.figures import headline

    members = {m: {"values": {"lr": i}, "headline": headline((), "text", ()),
                   "figures": {"chrf": [30.0, 20.0, 10.0][i], "loss": [1.5, 1.1, 1.3][i],
                               "exact_match": 0.0, "preference_accuracy": [0.5, 0.6, 0.7][i]}}
               for i, m in enumerate(("a", "b", "c"))}  # fmt: skip
    best = select(members, {"metric": "auto"})
    assert (best["metric"], best["mode"], best["best"]) == ("loss", "min", "b")
    assert "headline" in best["metric_chosen"] and "tied" not in best
    for info in members.values():  # GSM8K-style references: exact match, as before
        info["headline"] = headline((), "numeric", ())
    best = select(members, {"metric": "auto"})
    assert (best["metric"], best["mode"]) == ("exact_match", "max")
    for info in members.values():  # DPO: its own figure first
        info["headline"] = headline(("preference_accuracy",), "text", ())
    best = select(members, {"metric": "auto"})
    assert (best["metric"], best["mode"], best["best"]) == ("preference_accuracy", "max", "c")
    for info in members.values():
        info["headline"] = None
    assert select(members, {"metric": "auto"})["metric"] == "loss"


def test_a_tie_is_named_and_broken_by_the_heldout_loss():
    members = {"a": {"values": {}, "figures": {"exact_match": 0.5, "loss": 1.4}},
               "b": {"values": {}, "figures": {"exact_match": 0.5, "loss": 1.2}},
               "c": {"values": {}, "figures": {"exact_match": 0.25, "loss": 0.9}}}  # fmt: skip
    best = select(members, {"metric": "exact_match", "mode": "max"})
    # by name, "a" would win the tie; the held-out loss says "b"
    assert best["best"] == "b" and best["tied"] == ["a", "b"]
    assert best["tie_broken_by"] == "loss"
    untied = select(members, {"metric": "loss", "mode": "min"})
    assert untied["best"] == "c" and "tied" not in untied


def test_select_sweep_writes_best_json(tmp_path):
    config = validate_config(demo_with(copy.deepcopy(GRID)), ROOT)
    members = {m: config["runs"][m] for m in MEMBERS}
    for i, m in enumerate(MEMBERS):
        (tmp_path / m / "train").mkdir(parents=True)
        (tmp_path / m / "eval").mkdir()
        (tmp_path / m / "train/metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0 - i})
                                                          + "\n")  # fmt: skip
        (tmp_path / m / "eval/metrics.json").write_text(json.dumps(
            {"exact_match": [0.2, 0.5, 0.4, 0.1][i], "loss": 1.0, "perplexity": 2.7,
             "headline": ["exact_match", "math_verify", "loss"]}))  # fmt: skip
    out = tmp_path / "demo/best.json"
    proc = subprocess.run(
        ["python", str(ROOT / "scripts/select_sweep.py"), "--sweep", "demo", "--members",
         json.dumps(members), "--results", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    best = json.loads(out.read_text())
    assert best["sweep"] == "demo" and best["best"] == "demo-learning_rate_0p003-r_8"
    assert best["values"] == {"learning_rate": 0.003, "lora.r": 8} and best["value"] == 0.5
    assert best["figures"]["train_loss"] == 1.0 and len(best["members"]) == 4


# ----------------------------------------------------------------------------- end to end

STOP_MEMBERS = ["stops-learning_rate_0p002-r_8", "stops-learning_rate_0p006-r_8"]


def stop_values(member: str) -> dict:
    """The swept values of a member of conftest's stop_sweep, by its name's place."""
    grid = itertools.product(STOP_SWEEP["learning_rate"], STOP_SWEEP["lora.r"])
    lr, r = dict(zip(STOP_MEMBERS, grid, strict=True))[member]
    return {"learning_rate": lr, "lora.r": r}


@pytest.mark.slow
def test_a_sweep_runs_its_members_and_picks_the_best(stop_sweep):
    """2 members, each trained, exported and evaluated on its own; the data stages once;
    best.json; a summary row per member with the swept values; the report's sweep section
    renders in Chromium and fits 1280 px."""
    import csv
    import shutil

    w = stop_sweep
    assert sorted(p.name for p in (w / "logs/train").glob("*.log")) == [
        f"{m}.log" for m in STOP_MEMBERS
    ]
    assert len(list((w / "logs/tokenize_dataset").glob("*.log"))) == 2  # train and eval set
    assert len(list((w / "logs/shard_dataset").glob("*.log"))) == 1
    for m in STOP_MEMBERS:
        steps = [json.loads(x)["step"] for x in (w / f"results/{m}/train/metrics.jsonl").open()]
        assert steps == list(range(1, STOP_SWEEP_STEPS["ci" if ci_tier() else "documented"] + 1)), m
        spec = json.loads((w / f"results/{m}/train/provenance.json").read_text())["config"]
        assert {"learning_rate": spec["learning_rate"], "lora.r": spec["lora"]["r"]} == (
            stop_values(m)
        ), m
    best = json.loads((w / "results/stops/best.json").read_text())
    evals = {m: json.loads((w / f"results/{m}/eval/metrics.json").read_text())
             for m in STOP_MEMBERS}  # fmt: skip
    top = max(evals[m]["exact_match"] for m in STOP_MEMBERS)
    assert best["metric"] == "exact_match" and best["value"] == top
    assert evals[best["best"]]["exact_match"] == top and best["best"] in STOP_MEMBERS
    assert best["values"] == stop_values(best["best"])
    with open(w / "results/summary.tsv") as fh:
        rows = {r["run"]: r for r in csv.DictReader(fh, delimiter="\t")}
    assert sorted(rows) == STOP_MEMBERS
    row = rows["stops-learning_rate_0p006-r_8"]
    assert (row["sweep"], row["sweep:learning_rate"], row["sweep:lora.r"]) == (
        "stops",
        "0.006",
        "8",
    )
    html = (w / "results/summary.html").read_text()
    section = html.split('<section id="sweep-stops">')[1].split("</section>")[0]
    assert section.count("<tr") == 3 and "★ best" in section and "<svg" in section
    chromium = shutil.which("chromium")
    assert chromium, "chromium is needed (scripts/setup_env.sh installs it)"
    probe = w / "results/width-probe.html"
    probe.write_text(html.replace(
        "</body>", "<script>document.title = 'W' + document.documentElement.scrollWidth + "
        "'/' + window.innerWidth;</script></body>"))  # fmt: skip
    measured = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={w / '.chromium'}", "--window-size=1280,900", "--dump-dom",
         probe.as_uri()], capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    assert 'id="sweep-stops"' in measured and "★ best" in measured
    scroll, inner = map(int, re.search(r"<title>W(\d+)/(\d+)</title>", measured).groups())
    assert inner == 1280 and scroll <= inner, f"the page is {scroll} px wide at {inner} px"


@pytest.mark.extended
@pytest.mark.slow
def test_a_tuned_qwen_like_model_stops_and_the_summary_says_so(stop_sweep, demo):
    """The base model stops on <|endoftext|>, its template ends a turn with <|im_end|>:
    tokenize warns, every merged model's generation_config stops on both, every
    member's generations stop (plain generate, no argument), and the evaluation records
    the stop rate of base and tuned; the demo's summary has both columns too."""
    import csv

    import torch
    from conftest import BASE_EOS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = stop_sweep
    eos = AutoTokenizer.from_pretrained(w / "qwen-like-base").convert_tokens_to_ids(BASE_EOS)
    logs = "".join(p.read_text() for p in (w / "logs/tokenize_dataset").glob("*.log"))
    assert (f"models.qwen_like: the chat template ends an assistant turn with <|im_end|> (id 2), "
            f"but the model's generation_config stops only on [{eos}]") in logs  # fmt: skip
    for m in STOP_MEMBERS:
        merged = w / f"results/{m}/merged_model"
        assert json.loads((merged / "generation_config.json").read_text())["eos_token_id"] == [
            eos, 2]  # fmt: skip
        ev = json.loads((w / f"results/{m}/eval/metrics.json").read_text())
        assert ev["stop_ids"] == [eos, 2] and ev["base"]["stop_rate"] < 0.5, ev
        samples = [json.loads(x) for x in (w / f"results/{m}/eval/samples.jsonl").open()]
        assert sum(s["stopped"] for s in samples) == round(ev["stop_rate"] * len(samples))
        assert ev["stop_rate"] >= 0.9, (m, ev)
    merged = w / "results/stops-learning_rate_0p006-r_8/merged_model"
    tok = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tina has 43 clips. She buys "
                                       "5 more. How many clips does she have now?"}],
                                     add_generation_prompt=True, return_tensors="pt")  # fmt: skip
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1] :]
    assert out[-1].item() == 2 and len(out) < 48, tok.decode(out)
    assert not torch.isin(out[:-1], torch.tensor([2, eos])).any()
    # the summary's columns are each run's evaluation figures (the TSV keeps full precision)
    for root in (w, demo):
        with open(root / "results/summary.tsv") as fh:
            rows = list(csv.DictReader(fh, delimiter="\t"))
        evaluated = [r for r in rows if (root / f"results/{r['run']}/eval/metrics.json").is_file()]
        assert evaluated, rows
        for row in evaluated:
            ev = json.loads((root / f"results/{row['run']}/eval/metrics.json").read_text())
            assert float(row["stop_rate"]) == pytest.approx(ev["stop_rate"], abs=1e-12), row
            assert float(row["base_stop_rate"]) == pytest.approx(ev["base"]["stop_rate"],
                                                                 abs=1e-12), row  # fmt: skip


@pytest.mark.extended
@pytest.mark.slow
def test_a_failing_member_fails_alone_and_the_fixed_one_runs_alone(stop_sweep, tmp_path):
    """A second sweep beside the finished one, 2 members of 2 steps, one of them with LoRA
    targets the model does not have (only its train job finds out): that member's training
    fails, the other completes (--keep-going), the first sweep's members are not rerun; with the
    value fixed, the next invocation trains only the fixed member. (Training is the stage a
    member runs alone; the exports and evaluations after it are per member the same way.)"""
    import shutil

    w = tmp_path / "w"
    shutil.copytree(stop_sweep, w, symlinks=True)
    cfg = yaml.safe_load((w / "config.yaml").read_text())
    fails = copy.deepcopy(cfg["runs"]["stops"])
    modules = [["q_proj", "v_proj"], ["bogus_proj"]]
    fails.update(max_steps=2, sweep={"lora.target_modules": modules})
    cfg["runs"]["fails"] = fails
    (w / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    trained = {p: p.stat().st_mtime for p in (w / "results").glob("stops-*/train/metrics.jsonl")}

    def train(*members: str) -> subprocess.CompletedProcess:  # every run's training
        targets = [f"results/{m}/train/metrics.jsonl" for m in members]
        return snakemake("--configfile", str(w / "config.yaml"), "--directory", str(w),
                         "--keep-going", *targets, check=False)  # fmt: skip

    good = ["fails-target_modules_q_proj_v_proj"]
    bad = "fails-target_modules_bogus_proj"
    proc = train(*STOP_MEMBERS, *good, bad)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert set(re.findall(r"Error in rule (\w+):", out)) == {"train"}, out[-4000:]
    assert bad in out.split("Error in rule train:")[1][:2000]
    for member in good:
        assert len(read_jsonl(w / f"results/{member}/train/metrics.jsonl")) == 2, member
    assert not (w / f"results/{bad}/train/metrics.jsonl").exists()
    assert {p: p.stat().st_mtime for p in trained} == trained  # the first sweep: not rerun
    done = {m: (w / f"results/{m}/train/metrics.jsonl").stat().st_mtime for m in good}

    modules[1] = ["k_proj"]
    (w / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = train(*STOP_MEMBERS, *good, "fails-target_modules_k_proj")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert started(out, "train") == ["run=fails-target_modules_k_proj"], out[-4000:]
    assert {m: (w / f"results/{m}/train/metrics.jsonl").stat().st_mtime for m in good} == done


@pytest.mark.extended
@pytest.mark.slow
def test_grpo_from_a_sweeps_best_member_on_its_own_eval_set_and_the_sweep_published(
    stop_sweep, tmp_path
):
    """Chains without hand edits, through the local profile on a copy of the finished sweep:
    a GRPO run with `init_from: stops` (the sweep) trains from the best member's merged
    model once select_sweep (a checkpoint) has chosen it, is scored on its own eval set
    (GSM8K-shaped, not the sweep's arithmetic) against the starting model scored on that
    set (evaluate_start), and `publish` on the sweep publishes its best member. The
    sweep's members are not trained again."""
    import shutil

    w = tmp_path / "w"
    shutil.copytree(stop_sweep, w, symlinks=True)
    cfg = yaml.safe_load((w / "config.yaml").read_text())
    cfg["runs"]["stops"]["publish"] = {"repo_id": "me/stops-best", "dry_run": True,
                                       "license": "apache-2.0"}  # fmt: skip
    cfg["runs"]["rl"] = {
        "init_from": "stops", "dataset": "gsm8k_demo", "eval_dataset": "gsm8k_demo_test",
        "method": "grpo", "lora": {"r": 4, "alpha": 8, "target_modules": "all-linear"},
        "grpo": {"num_generations": 4, "max_completion_length": 8},
        "deepspeed": "zero2", "nodes": 1, "gpus_per_node": 1, "max_length": 256,
        "micro_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 2,
        "learning_rate": 1.0e-3, "save_steps": 2,
        "eval": {"limit": 8, "max_new_tokens": 8, "batch_size": 8},
    }  # fmt: skip
    (w / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    trained = {p: p.stat().st_mtime for p in (w / "results").glob("stops-*/train/metrics.jsonl")}
    proc = snakemake("--configfile", str(w / "config.yaml"), "--directory", str(w), "all",
                     "publish", check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert {p: p.stat().st_mtime for p in trained} == trained  # the members: not retrained
    best = json.loads((w / "results/stops/best.json").read_text())["best"]
    assert best in STOP_MEMBERS
    # the GRPO run trained from the best member's merged model
    train = json.loads((w / "results/rl/train/provenance.json").read_text())
    assert train["inputs"]["model"]["path"] == f"results/{best}/merged_model"
    assert len(read_jsonl(w / "results/rl/train/metrics.jsonl")) == 2
    # scored on its own eval set, against the starting model on that set
    start = json.loads((w / "results/rl/start_eval/metrics.json").read_text())
    tuned = json.loads((w / "results/rl/eval/metrics.json").read_text())
    assert start["model"] == f"results/{best}/merged_model" and start["examples"] == 8
    assert start["reference_answers"] == 8  # GSM8K-shaped: every reference has an answer
    assert tuned["base"]["exact_match"] == start["exact_match"]
    assert tuned["base"]["loss"] == start["loss"]
    sweep_eval = json.loads((w / f"results/{best}/eval/metrics.json").read_text())
    assert start["loss"] != sweep_eval["loss"]  # another eval set than the sweep's
    # the sweep published as its best member (dry run: the folder, no upload)
    receipt = json.loads((w / "results/stops/publish.json").read_text())
    assert receipt["run"] == best and receipt["repo_id"] == "me/stops-best"
    card = (w / "results/stops/publish/README.md").read_text()
    assert f"run `{best}`" in card
