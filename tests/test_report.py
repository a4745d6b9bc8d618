"""The report's number formatting and lm-eval result handling (no pipeline needed)."""

from __future__ import annotations

import pytest

from snaketune.app.comparison import pretty
from snaketune.app.summary import lm_eval_columns
from snaketune.evaluation.lmeval import collect, with_base


@pytest.mark.parametrize(
    ("value", "percent", "shown"),
    [(0.765625, True, "76.6%"), (6.31459, False, "6.31"), (552.575, False, "553"),
     (26290.8, False, "26,291"), (0.000123, False, "1.23e-04"), (0.111044, False, "0.111"),
     (12.34, False, "12.3"), (192, False, "192"), (None, False, "–"), ("", True, "–")],
)  # fmt: skip
def test_numbers_are_shown_with_sensible_digits(value, percent, shown):
    assert pretty(value, percent) == shown


RESULTS = {
    "arith_demo": {"alias": "arith_demo", "sample_len": 64,
                   "exact_match,strict-match": 0.75, "exact_match_stderr,strict-match": 0.05},
    "hellaswag": {"alias": "hellaswag", "acc,none": 0.3, "acc_stderr,none": 0.01,
                  "acc_norm,none": 0.32, "acc_norm_stderr,none": "N/A"},
}  # fmt: skip


def test_lm_eval_results_keep_each_metric_with_its_stderr():
    figures = collect(RESULTS)
    assert figures == {
        "arith_demo": {"exact_match,strict-match": {"value": 0.75, "stderr": 0.05}},
        "hellaswag": {"acc,none": {"value": 0.3, "stderr": 0.01},
                      "acc_norm,none": {"value": 0.32, "stderr": None}},
    }  # fmt: skip


def test_lm_eval_gain_over_base_and_summary_columns():
    tuned = with_base(
        collect(RESULTS), {"arith_demo": {"exact_match,strict-match": {"value": 0.0}}}
    )
    em = tuned["arith_demo"]["exact_match,strict-match"]
    assert (em["base"], em["gain"]) == (0.0, 0.75)
    acc = tuned["hellaswag"]["acc,none"]
    assert acc["base"] is None and acc["gain"] is None  # no base figure: no gain invented
    columns = lm_eval_columns({"lm_eval": tuned})
    assert columns["lm_eval:arith_demo:exact_match,strict-match"] == 0.75
    assert columns["gain_lm_eval:arith_demo:exact_match,strict-match"] == 0.75
    assert columns["base_lm_eval:hellaswag:acc,none"] is None


def test_a_grpo_run_is_plotted_by_its_rewards_and_summarised_by_quarters():
    from snaketune.app.plots import training_svg
    from snaketune.methods import method_named
    from snaketune.methods.rollouts import reward_quarters

    metrics = [{"step": s, "loss": 0.01, "lr": 1e-3, "tokens_per_s": 100.0,
                "reward": 0.1 * s, "reward_correctness_mean": 0.05 * s,
                "reward_format_mean": 1.0} for s in range(1, 9)]  # fmt: skip
    svg = training_svg(metrics, "rl", None, panel=method_named("grpo").panel)
    assert 'id="reward"' in svg and 'id="loss"' not in svg
    assert "mean reward per completion" in svg and "correctness" in svg
    # the total's quarters, and each reward's by its key (steps 1-2 and 7-8 of 8)
    assert reward_quarters(metrics) == {
        "reward_first_quarter": 0.15, "reward_last_quarter": 0.75,
        "reward_first_quarter:correctness": 0.075, "reward_last_quarter:correctness": 0.375,
        "reward_first_quarter:format": 1.0, "reward_last_quarter:format": 1.0,
    }  # fmt: skip
    sft = [{k: v for k, v in m.items() if not k.startswith("reward")} for m in metrics]
    assert reward_quarters(sft) == {}
    assert 'id="loss"' in training_svg(sft, "sft", 0.5)


def test_a_preference_run_is_summarised_by_what_its_trainer_logs():
    """DPO logs reward accuracy and margin, KTO's trainer only the margin: the summary's
    last quarter has each run's own (steps 7-8 of 8), and no column it never logged."""
    from snaketune.methods.outputs import preference_quarter

    dpo = [{"step": s, "loss": 0.5, "reward_accuracy": 0.1 * s, "reward_margin": 0.2 * s}
           for s in range(1, 9)]  # fmt: skip
    assert preference_quarter(dpo) == pytest.approx(
        {"reward_accuracy_last_quarter": 0.75, "reward_margin_last_quarter": 1.5}
    )
    kto = [{k: v for k, v in m.items() if k != "reward_accuracy"} for m in dpo]
    assert preference_quarter(kto) == pytest.approx({"reward_margin_last_quarter": 1.5})
    assert preference_quarter([{"step": 1, "loss": 0.1}]) == {}


def test_the_page_names_the_runs_another_config_left_in_results(demo, tmp_path):
    """The page is the config's runs; a run another config trained in the same directory
    (its results/<run>/ there) is named on it, not dropped without a word (the demo's row
    vanished from a page titled "all runs" after another config ran)."""
    import json
    import subprocess
    import sys

    from conftest import ENV, ROOT, run_spec

    (tmp_path / "results/old/train").mkdir(parents=True)
    (tmp_path / "results/old/train/provenance.json").write_text("{}")
    (tmp_path / "results/demo").symlink_to(demo / "results/demo")
    (tmp_path / "results/tokenized").mkdir()  # not a run
    runs = json.dumps({"demo": run_spec()})
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/report.py"), "--runs", runs, "--summary",
         "out/summary.tsv", "--curves", "out/curves", "--html", "out/summary.html"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "out/summary.html").read_text()
    assert "<h1>snaketune: the runs of this config</h1>" in page
    assert "runs of another config (not on this page;" in page and "): old.</p>" in page
    assert 'id="run-demo"' in page and 'id="run-old"' not in page
    # the run's name never wraps mid-word in the table (its model's name below it may)
    assert "<span class='run'>demo</span>" in page and "span.run{white-space:nowrap}" in page
