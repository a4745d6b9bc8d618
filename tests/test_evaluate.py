"""Evaluation and report: answer parsing, the train/eval overlap check, and the demo's
metrics, samples, summary table and HTML report."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, read_jsonl, snakemake

from snaketune.core.errors import DataError
from snaketune.data.tokenization import OUTPUT_SCHEMA
from snaketune.evaluation.answers import (
    final_answer,
    math_verify_match,
    normalise_number,
    parse_answer,
)
from snaketune.evaluation.evaluate import check_overlap, evaluate


@pytest.mark.parametrize(
    ("text", "answer"),
    [("so 3 + 4 = 7\n#### 7", "7"), ("#### 1,234", "1234"), ("#### 5.0", "5"), ("#### $12.50.", "12.5"),
     ("#### -3", "-3"), ("x #### 2 #### 9 apples", "9"), ("no marker 42", None), ("####", None)],
)  # fmt: skip
def test_parse_answer_normalises_numbers(text, answer):
    assert parse_answer(text) == answer


@pytest.mark.parametrize(
    "generation",
    ["The total is\n#### $1,000", "#### 1,000.00", "so the answer is \\boxed{1000}.",
     "She pays 1000 dollars.", "#### 1000 dollars", "#### \\$1,000", "x = \\boxed{\\frac{2000}{2}}",
     "first 12, then 7, finally 1000"],
)  # fmt: skip
def test_math_verify_matches_the_ways_a_number_is_written(generation):
    assert math_verify_match("1000", final_answer(generation)), final_answer(generation)


@pytest.mark.parametrize(
    "generation",
    ["#### 1001", "#### 100", "\\boxed{999}", "1000 apples then 10 left", "#### 1000.5",
     "#### -1000", "no number at all", "####", "#### 10,00"],
)  # fmt: skip
def test_math_verify_never_matches_a_wrong_number(generation):
    assert not math_verify_match("1000", final_answer(generation)), final_answer(generation)


def test_final_answer_prefers_the_marker_then_boxed_then_the_last_number():
    assert final_answer("\\boxed{3} and later\n#### 4") == "4"
    assert final_answer("2 then \\boxed{x+{1}} then 5") == "\\boxed{x+{1}}"
    assert final_answer("2 then 5.5") == "5.5"
    assert final_answer("nothing") is None
    assert not math_verify_match(None, "5") and not math_verify_match("5", None)


def test_normalise_number():
    assert normalise_number(" 1,000.00 ") == "1000"
    assert normalise_number("7.") == "7"


def _tokenized(path, ids, shas):
    n = len(ids)
    table = pa.table({"example_id": ids, "input_ids": [[1, 2]] * n, "labels": [[-100, 2]] * n,
                      "length": [2] * n, "text_sha": shas}, schema=OUTPUT_SCHEMA)  # fmt: skip
    pq.write_table(table, path)
    return path


def test_overlap_by_text_or_id_is_refused(tmp_path):
    train = _tokenized(tmp_path / "t.parquet", ["a:0", "a:1"], ["s0", "s1"])
    check_overlap(train, _tokenized(tmp_path / "ok.parquet", ["b:0"], ["s9"]))
    with pytest.raises(
        DataError, match=r"shares 1 examples with the training set \(same text, e.g. s1\)"
    ):
        check_overlap(train, _tokenized(tmp_path / "e.parquet", ["b:0"], ["s1"]))
    with pytest.raises(DataError, match=r"\(same example id, e.g. a:1\)"):
        check_overlap(train, _tokenized(tmp_path / "f.parquet", ["a:1"], ["s7"]))


@pytest.mark.slow
def test_training_data_as_eval_set_fails_before_loading_a_model(demo, tmp_path):
    train = next(p for p in (demo / "results/tokenized").glob("arith__*/data.parquet"))
    with pytest.raises(DataError, match="shares 2048 examples with the training set"):
        evaluate(tmp_path / "no-model-needed", train, train, tmp_path / "eval", None, 8, 8)
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_demo_learns_and_goes_all_the_way_to_the_report(demo, tmp_path):
    demo_dir = demo
    metrics = json.loads((demo / "results/demo/eval/metrics.json").read_text())
    # the demo visibly learns: the random base model answers almost nothing of the 64
    # held-out questions (their number pairs are never trained on), the tuned model most
    assert metrics["examples"] == 64
    assert metrics["base"]["exact_match"] <= 0.05 and metrics["exact_match"] >= 0.5
    assert metrics["perplexity"] == pytest.approx(2.718281828 ** metrics["loss"], rel=1e-6)
    assert set(metrics["base"]) == {
        "loss",
        "perplexity",
        "exact_match",
        "math_verify",
        "stop_rate",
        "model",
    }  # the model it ran on (the report's column names it)
    assert metrics["base"]["model"].endswith("resources/models/tiny")
    # stop rates: the share of each model's samples that ended on a stop token, counted
    # here from the samples (measured: base 0 of 64, the random model never ends a turn;
    # tuned 64 of 64)
    base_samples = read_jsonl(next((demo / "results/base_eval").iterdir()) / "samples.jsonl")
    tuned_samples = read_jsonl(demo / "results/demo/eval/samples.jsonl")
    for figure, rows in ((metrics["base"]["stop_rate"], base_samples),
                         (metrics["stop_rate"], tuned_samples)):  # fmt: skip
        assert figure == sum(r["stopped"] for r in rows) / len(rows) and len(rows) == 64
    assert metrics["stop_rate"] >= 0.9  # it stops
    # one sign for every gain (docs/evaluation.md): tuned - base, the figures' too
    assert metrics["gain"]["loss"] == pytest.approx(metrics["loss"] - metrics["base"]["loss"])
    assert metrics["gain"]["loss"] == pytest.approx(metrics["figures"]["loss"]["gain"])
    assert metrics["math_verify"] >= metrics["exact_match"]  # what #### matches, it verifies
    assert metrics["gain"]["math_verify"] == pytest.approx(
        metrics["math_verify"] - metrics["base"]["math_verify"]
    )
    assert metrics["gain"]["loss"] < 0  # training lowered the held-out loss
    # lm-eval ran the project's own task over the local file, offline, on both models; its
    # exact match is the same question as ours, so the figures agree: measured equal
    # (0.765625 both, 49 of 64); one question (1/64) allowed for lm-eval's own batching of
    # the greedy generations
    (figure,) = metrics["lm_eval"]["arith_demo"].values()
    assert set(figure) == {"value", "stderr", "base", "gain"}
    assert figure["value"] == pytest.approx(metrics["exact_match"], abs=1 / 64 + 1e-9)
    assert figure["base"] <= 0.05 and figure["gain"] == pytest.approx(
        figure["value"] - figure["base"]
    )
    assert 0 < figure["stderr"] < 0.2
    samples = read_jsonl(demo / "results/demo/eval/samples.jsonl")
    assert len(samples) == 64
    assert set(samples[0]) >= {"prompt", "reference", "generation", "parsed_answer", "correct"}
    assert samples[0]["reference_answer"] == parse_answer(samples[0]["reference"]) is not None
    assert {"final_answer", "math_verify"} <= set(samples[0])
    # the pipeline ended with one line: where the report is, and the run's headline result
    (line,) = [ln for ln in (demo / "snakemake.out").read_text().splitlines()
               if ln.startswith("report: ")]  # fmt: skip
    assert f"report: {demo / 'results/summary.html'}" in line
    assert "| demo: exact_match " in line and "math_verify " in line and "(base " in line
    base = next((demo / "results/base_eval").iterdir())
    base_metrics = json.loads((base / "metrics.json").read_text())
    assert base_metrics["model"].endswith("resources/models/tiny")
    assert base_metrics["lm_eval"]["arith_demo"]  # evaluate_base ran the tasks too

    with open(demo / "results/summary.tsv") as fh:
        (row,) = list(csv.DictReader(fh, delimiter="\t"))
    assert (row["run"], row["method"], row["nodes_x_devices"], row["steps"]) == (
        "demo",
        "lora",
        "2x1",
        "192",
    )
    assert float(row["gain_loss"]) < 0 and float(row["wall_time_s"]) > 0 and row["gpu_hours"] == ""
    assert row["jobs"] == "1" and 0 < float(row["outside_training_s"]) < float(row["wall_time_s"])
    assert float(row["tokens_per_s"]) > 0 and 0 <= float(row["padding"]) < 0.35
    assert row["mfu"] == ""  # CPU: no MFU
    key = "lm_eval:arith_demo:exact_match,strict-match"
    assert float(row[key]) == pytest.approx(figure["value"])
    assert float(row[f"gain_{key}"]) == pytest.approx(figure["gain"])
    assert float(row[f"base_{key}"]) == pytest.approx(figure["base"])
    svg = (demo / "results/loss_curves/demo.svg").read_text()
    assert svg.startswith("<svg") and 'id="loss"' in svg

    # what follows writes (Snakemake's report, the browser's files, a screenshot): into a
    # copy, so the shared demo stays as other tests read it (test_secrets scans every file)
    demo = tmp_path / "demo"
    subprocess.run(["cp", "-a", str(demo_dir), str(demo)], check=True)
    snakemake("--configfile", str(ROOT / "config/config.yaml"), "--directory", str(demo),
              "--report", str(demo / "report.html"))  # fmt: skip
    html = (demo / "report.html").read_text()
    for needle in ("summary.tsv", "demo.svg", "samples.jsonl"):
        assert needle in html, needle
    # it renders: headless Chromium runs the report's script and lists the three sections
    chromium = shutil.which("chromium")
    assert chromium, (
        "chromium is needed to check the report renders (scripts/setup_env.sh installs it)"
    )
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / '.chromium'}"]  # fmt: skip
    dom = subprocess.run(
        [*flags, "--virtual-time-budget=15000", "--dump-dom", (demo / "report.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    for section in ("Summary", "Loss curves", "Evaluation samples"):
        assert f"<span>{section}</span>" in dom, section
    assert dom.count("<table") > 0 and dom.count("<svg") > 0

    # the summary page: self-contained (nothing fetched), the table with readable numbers,
    # per run the plots, base versus tuned for every metric, samples marked right or wrong
    page_html = (demo / "results/summary.html").read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page_html), "fetches from the web"
    page = subprocess.run(
        [*flags, "--dump-dom", (demo / "results/summary.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    table = page.split('<table id="summary">')[1].split("</table>")[0]
    assert '<td class="name"><span class="run">demo</span><br><small>tiny</small></td>' in table
    assert '<td class="name">lora</td>' in table
    # the results column leads with the run's headline: exact match, base then tuned
    shown = f"{100 * metrics['base']['exact_match']:.1f}% → {100 * metrics['exact_match']:.1f}%"
    assert f"exact_match: {shown}" in table
    assert f"{100 * metrics['exact_match']:.1f}%" in table  # a share, not 0.765625
    assert not re.search(r"\d\.\d{5}", table), "numbers with too many digits"
    run_section = page.split('<section id="run-demo">')[1]
    for title in ("loss", "learning rate", "throughput"):  # matplotlib plots, with tick labels
        assert f">{title}" in run_section or f"{title}</text>" in run_section, title
    assert run_section.count("<svg") == 2  # training plots, base-versus-tuned chart
    assert "optimizer step" in run_section and "real tokens / s" in run_section
    comparison = run_section.split('<table class="comparison">')[1].split("</table>")[0]
    for metric in ("exact match", "math_verify", "held-out loss", "perplexity",
                   "lm-eval arith_demo exact_match [strict-match]"):  # fmt: skip
        assert metric in comparison, metric
    rows = run_section.split('<table class="samples">')[1].split("</table>")[0]
    marks = re.findall(r'<tr class="(right|wrong)">', rows)
    assert len(marks) == 8 and rows.count("✓ right") == marks.count("right")
    assert marks.count("right") == sum(s["correct"] for s in samples[:8])
    # at 1280 px wide nothing runs off the page: the page measures itself in Chromium
    probe = demo / "results/width-probe.html"
    probe.write_text(page_html.replace(
        "</body>", "<script>document.title = 'W' + document.documentElement.scrollWidth + "
        "'/' + window.innerWidth;</script></body>"))  # fmt: skip
    measured = subprocess.run(
        [*flags, "--window-size=1280,900", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    scroll, inner = map(int, re.search(r"<title>W(\d+)/(\d+)</title>", measured).groups())
    assert inner == 1280 and scroll <= inner, f"the page is {scroll} px wide at {inner} px"
    shot = demo / "results/summary-1280.png"
    subprocess.run([*flags, "--window-size=1280,2400", "--hide-scrollbars",
                    f"--screenshot={shot}", (demo / "results/summary.html").as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_lm_eval_tasks_run_without_torch_s_environment_report(demo, monkeypatch):
    """run_tasks keeps lm-eval's results and skips the environment report lm-eval adds to
    them (torch's collect_env: pip list, nvidia-smi, ... in subprocesses): the demo's merged
    model scores on its task what the pipeline's evaluation recorded, the report is never
    made, and lm-eval's own step is back in place afterwards."""
    from lm_eval import evaluator
    from torch.utils import collect_env
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from snaketune.evaluation.lmeval import run_tasks

    made = []
    monkeypatch.setattr(collect_env, "get_pretty_env_info", lambda: made.append(1) or "")
    monkeypatch.chdir(demo)  # the task's data file is relative to the workflow's directory
    merged = demo / "results/demo/merged_model"
    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    settings = {"tasks": ["arith_demo"], "include_path": str(ROOT / "config/lm_eval_tasks"),
                "num_fewshot": 0, "batch_size": 64, "apply_chat_template": True}  # fmt: skip
    real = evaluator.add_env_info
    figures = run_tasks(model, AutoTokenizer.from_pretrained(merged), settings)
    recorded = json.loads((demo / "results/demo/eval/metrics.json").read_text())["lm_eval"]
    key = "exact_match,strict-match"
    assert figures["arith_demo"][key]["value"] == recorded["arith_demo"][key]["value"]
    assert made == [] and evaluator.add_env_info is real


def test_lm_eval_task_names_are_looked_up_again_only_when_their_files_change(tmp_path, monkeypatch):
    """Planning an evaluation checks its lm-eval task names (an import of lm-eval's index,
    about 1 CPU-s of every snakemake command); the answer is remembered per lm-eval version,
    names and include path, and looked up again when a file there changes."""
    from snaketune.evaluation import lmeval

    monkeypatch.setenv("SNAKETUNE_CACHE", str(tmp_path / "cache"))
    include = tmp_path / "tasks"
    include.mkdir()
    demo_task = (ROOT / "config/lm_eval_tasks/arith_demo.yaml").read_text()
    (include / "arith_demo.yaml").write_text(demo_task)
    (include / "two.yaml").write_text(demo_task.replace("task: arith_demo", "task: arith_two"))
    looked_up = []
    real = lmeval.task_manager
    monkeypatch.setattr(lmeval, "task_manager", lambda s: looked_up.append(s) or real(s))
    settings = {"tasks": ["arith_demo", "arith_two"], "include_path": str(include)}
    assert lmeval.unknown_tasks(settings) == [] and len(looked_up) == 1
    assert lmeval.unknown_tasks(settings) == [] and len(looked_up) == 1
    assert lmeval.unknown_tasks({**settings, "tasks": ["arith_two"]}) == [] and len(looked_up) == 2
    edited = demo_task.replace("task: arith_demo", "task: arith_two").replace("16", "8")
    (include / "two.yaml").write_text(edited)  # an edited file: looked up again, once
    assert lmeval.unknown_tasks(settings) == [] and len(looked_up) == 3
    assert lmeval.unknown_tasks(settings) == [] and len(looked_up) == 3
