"""Evaluation that speaks the user's task: the figures chosen by the eval set's references
and the run's method, the user's own metrics, the outputs that lead with them, and no
test of a run's kind by a proxy outside the methods and the data kinds."""

from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path

import pytest

from snaketune.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

CAPITALS = [("Australia", "Canberra"), ("France", "Paris"), ("Japan", "Tokyo"),
            ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima")]  # fmt: skip


class CharTokenizer:
    """One token a character: decode is the characters of the ids (the rows below)."""

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def row(i: int, prompt: str, answer: str) -> dict:
    ids = [ord(c) for c in prompt + answer]
    return {"example_id": f"chat:{i}", "input_ids": ids,
            "labels": [-100] * len(prompt) + ids[len(prompt) :]}  # fmt: skip


def chat_rows() -> list[dict]:
    return [row(i, f"What is the capital of {c}? ", f"The capital of {c} is {k}.")
            for i, (c, k) in enumerate(CAPITALS)]  # fmt: skip


def test_free_text_references_get_chrf_and_normalized_match_not_gsm8k_figures():
    import sacrebleu

    from snaketune.evaluation.evaluate import score
    from snaketune.evaluation.figures import normalize

    rows = chat_rows()
    # one generation equal to its reference but for case and punctuation, one word off,
    # the rest unrelated
    gens = ["the capital of australia is canberra", "The capital of France is Lyon.",
            *["I do not know." for _ in rows[2:]]]  # fmt: skip
    samples, figures = score(rows, gens, [True] * len(rows), CharTokenizer())
    refs = [s["reference"] for s in samples]
    assert refs[0] == "The capital of Australia is Canberra."  # the whole reference text
    assert figures["format"] == "text" and figures["reference_answers"] == 0
    # chrF: sacrebleu's corpus figure through its functional API, and each sample's own
    assert figures["chrf"] == pytest.approx(sacrebleu.corpus_chrf(gens, [refs]).score)
    for s, g, r in zip(samples, gens, refs, strict=True):
        assert s["chrf"] == pytest.approx(sacrebleu.sentence_chrf(g, [r]).score)
    assert samples[0]["chrf"] < 100 and samples[2]["chrf"] < samples[1]["chrf"]
    # normalized match by hand: only the first matches once case and punctuation go
    assert normalize(gens[0]) == normalize(refs[0]) and normalize(gens[1]) != normalize(refs[1])
    assert [s["normalized_match"] for s in samples] == [True] + [False] * (len(rows) - 1)
    assert figures["normalized_match"] == pytest.approx(1 / len(rows))
    same, _ = score(rows[:1], [refs[0]], [True], CharTokenizer())
    assert same[0]["chrf"] == pytest.approx(100.0)


def test_numeric_references_keep_exact_match_and_long_references_get_no_normalized_match():
    from snaketune.evaluation.evaluate import score
    from snaketune.evaluation.figures import answer_format

    rows = [row(i, f"{i} + 1 = ? ", f"{i} plus one.\n#### {i + 1}") for i in range(4)]
    samples, figures = score(rows, ["#### 1", "#### 9", "\\boxed{3}", "4"], [True] * 4,
                             CharTokenizer())  # fmt: skip
    assert figures["format"] == "numeric" and "chrf" not in figures and "chrf" not in samples[0]
    assert figures["exact_match"] == 0.25 and figures["math_verify"] == 0.75
    assert answer_format(["#### 3", "x \\boxed{2}", "plain"]) == "mixed"
    assert answer_format(["\\boxed{1}"]) == "numeric" and answer_format(["hello"]) == "text"
    long = [row(0, "Summarise: ", " ".join(["word"] * 40))]
    _, figures = score(long, ["word word"], [True], CharTokenizer())
    assert "chrf" in figures and "normalized_match" not in figures  # references too long


def test_the_headline_is_the_method_s_then_the_data_s_then_the_user_s():
    from snaketune.evaluation.figures import headline
    from snaketune.methods import method_named

    dpo, sft, rm = method_named("dpo"), method_named("lora"), method_named("reward")
    assert headline(dpo.headline, "text", ()) == ["preference_accuracy", "loss", "chrf"]
    assert headline(sft.headline, "numeric", ("m.py:f",)) == [
        "exact_match", "math_verify", "loss", "m.py:f"]  # fmt: skip
    assert headline(rm.headline, None, (), rm.writes_text) == ["preference_accuracy",
                                                             "reward_margin"]  # fmt: skip


def evaluation(headline_first=("preference_accuracy",)) -> dict:
    """A chat DPO run's metrics.json as evaluate() writes it (its figures made by describe)."""
    from snaketune.evaluation.evaluate import against_base, describe

    base = {"format": "text", "loss": 3.5, "perplexity": 33.1, "stop_rate": 0.5,
            "exact_match": 0.0, "math_verify": 0.0, "chrf": 20.0,
            "preference": {"likelihood_accuracy": 0.5}}  # fmt: skip
    metrics = {"format": "text", "loss": 3.25, "perplexity": 25.8, "stop_rate": 0.75,
               "exact_match": 0.0, "math_verify": 0.0, "chrf": 31.5,
               "preference": {"likelihood_accuracy": 0.625, "preference_accuracy": 0.75,
                              "reward_margin": 0.5}}  # fmt: skip
    against_base(metrics, base)
    describe(metrics, headline_first, [])
    return metrics


def test_the_end_line_summary_and_card_lead_with_the_headline(tmp_path):
    from snaketune.app.summary import COLUMNS, figure_columns, headline, write_summary
    from snaketune.export.hub import eval_results

    metrics = evaluation()
    assert list(metrics["figures"])[:3] == ["preference_accuracy", "loss", "chrf"]
    assert "exact_match" not in metrics["figures"]  # no GSM8K figure for chat references
    row = {"run": "chat_dpo", **figure_columns(metrics)}
    assert row["headline"] == "preference_accuracy loss chrf"
    assert row["base_preference_accuracy"] == 0.0 and row["base_chrf"] == 20.0
    tsv = tmp_path / "summary.tsv"
    write_summary([{k: str(v) for k, v in row.items()}], tsv)
    with open(tsv) as fh:
        header = next(csv.reader(fh, delimiter="\t"))
    assert header[: len(COLUMNS)] == COLUMNS and "chrf" in header and "base_chrf" in header
    line = headline(tsv, tmp_path / "summary.html")
    assert line.endswith("chat_dpo: preference_accuracy 0.75 (base 0.0), eval loss 3.25 "
                         "(base 3.5), chrF 31.5 (base 20.0)"), line  # fmt: skip
    assert "exact_match" not in line and "math_verify" not in line
    # the end-of-run line of another config in the same directory: its own runs only
    assert headline(tsv, tmp_path / "summary.html", ["chat_dpo", "other"]) == line
    other = headline(tsv, tmp_path / "summary.html", ["cpt"])
    assert "chat_dpo" not in other and "holds no run of this config (cpt)" in other, other
    names = [r.metric_type for r in eval_results(metrics, "chat_pairs")]
    assert names[:3] == ["preference_accuracy", "loss", "chrf"] and "exact_match" not in names


def test_the_report_shows_the_reference_text_and_marks_only_what_a_checker_decides():
    from snaketune.app.comparison import comparison_table
    from snaketune.app.report import samples_table

    text = [{"prompt": "What is the capital of Peru?", "reference": "The capital of Peru is Lima.",
             "reference_answer": None, "correct": False, "generation": "Lima.", "chrf": 21.5,
             "scores": {"m.py:f": 0.5}}]  # fmt: skip
    html = samples_table(text, 8)
    assert "The capital of Peru is Lima." in html and "None" not in html
    assert "✗ wrong" not in html and "✓ right" not in html
    assert "chrF 21.5" in html and "m.py:f 0.500" in html and "no final answer" in html
    numeric = [{"prompt": "1 + 1", "reference": "two\n#### 2", "reference_answer": "2",
                "correct": True, "generation": "#### 2"}]  # fmt: skip
    assert "✓ right" in samples_table(numeric, 8) and "1 of 1 answered right" in samples_table(
        numeric, 8)  # fmt: skip
    # where the evaluation ran math_verify, the marks are its (the table's figure): "The
    # answer is 8." is right though it has no "#### 8" line (the agent demo read "0 of 24
    # answered right" under a math_verify of 1.0)
    said = [{"prompt": "5 + 3", "reference": "8", "reference_answer": "8", "correct": False,
             "math_verify": True, "generation": "The answer is 8."},
            {"prompt": "2 + 2", "reference": "4", "reference_answer": "4", "correct": False,
             "math_verify": False, "generation": "The answer is 5."}]  # fmt: skip
    html = samples_table(said, 8, "math_verify loss")
    assert html.count("✓ right") == 1 and html.count("✗ wrong") == 1
    assert "1 of 2 answered right: the mark is math_verify's" in html
    # a run that leads with exact match is marked by it
    html = samples_table(said, 8, "exact_match loss")
    assert html.count("✗ wrong") == 2 and "0 of 2 answered right: the mark is exact match" in html
    table = comparison_table(evaluation())
    assert table.index("preference accuracy") < table.index("held-out loss") < table.index(
        "chrF")  # fmt: skip
    assert "<b>preference accuracy" in table and "exact match" not in table


def test_an_agents_comparison_names_its_start_and_shows_its_tool_calls():
    """An agent started from an SFT run is compared with that run's model, not a base: the
    column and heading say so; the calls per question of both are in the table (they were
    only in metrics.json). A run on a base model keeps "base model"."""
    from snaketune.app.comparison import base_label, comparison_table
    from snaketune.evaluation.evaluate import against_base, describe

    start = {
        "format": "numeric",
        "loss": 1.2,
        "exact_match": 0.0,
        "math_verify": 0.5,
        "model": "results/sft/hf",
        "tools": {"calls_per_sample": 0.25, "failures": 0.0},
    }
    agent = {
        "format": "numeric",
        "loss": 1.0,
        "exact_match": 0.0,
        "math_verify": 0.75,
        "model": "results/agent/hf",
        "tools": {"calls_per_sample": 1.5, "failures": 0.125},
    }
    against_base(agent, start)
    describe(agent, ("math_verify",), [])
    assert base_label(agent) == "start: run sft"
    table = comparison_table(agent)
    assert "<th>start: run sft</th>" in table and "base model" not in table
    row = table[table.index("tool calls per question") :].split("</tr>")[0]
    assert ">0.250<" in row and ">1.5<" in row, row
    plain = evaluation()  # a base model's evaluation (no model path, no tools)
    assert base_label(plain) == "base model" and "tool calls" not in comparison_table(plain)
    against_base(agent, {**start, "model": "resources/models/tiny"})
    assert base_label(agent) == "base model"


METRIC = """
def overlap(prompts, completions, answer, **kwargs):
    return [len(set(c.split()) & set(a.split())) / max(1, len(set(a.split())))
            for c, a in zip(completions, answer)]


def country(prompts, completions, country, **kwargs):
    return [1.0 if k in c else None for c, k in zip(completions, country)]
"""


def test_a_user_metric_scores_each_sample_and_the_base_s_with_the_source_columns(
    tmp_path, monkeypatch
):
    from snaketune.evaluation.scorers import scorer, spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics.py").write_text(METRIC)
    rows = [{"question": f"What is the capital of {c}?", "answer": f"The capital is {k}.",
             "country": c} for c, k in CAPITALS[:3]]  # fmt: skip
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "resources/datasets/chat").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "resources/datasets/chat/data.parquet")
    config = {"runs": {"r": {"eval": {"metrics": ["metrics.py:overlap", "metrics.py:country"]}}}}
    settings = spec(config, "r", str, lambda m: None)
    assert set(settings["code_sha256"]) == {"metrics.py:overlap", "metrics.py:country"}
    gens = ["The capital is Canberra.", "Paris", "I do not know"]
    samples = [{"example_id": f"chat:{i}", "prompt": r["question"], "reference": r["answer"],
                "generation": g} for i, (r, g) in enumerate(zip(rows, gens, strict=True))]  # fmt: skip
    base_samples = tmp_path / "base_samples.jsonl"
    base_gens = ["capital", "The capital is Paris.", "Japan"]
    base_samples.write_text("".join(json.dumps({**s, "generation": g}) + "\n"
                                    for s, g in zip(samples, base_gens, strict=True)))  # fmt: skip
    metrics = {"base": {}}
    keys = scorer(settings, base_samples)(samples, metrics)
    assert keys == ["metrics.py:overlap", "metrics.py:country"]

    def by_hand(completions):  # the same arithmetic, written out here
        out = []
        for c, r in zip(completions, rows, strict=True):
            want = set(r["answer"].split())
            out.append(len(set(c.split()) & want) / len(want))
        return out

    assert [s["scores"]["metrics.py:overlap"] for s in samples] == pytest.approx(by_hand(gens))
    assert metrics["metrics.py:overlap"] == pytest.approx(sum(by_hand(gens)) / 3)
    assert metrics["base"]["metrics.py:overlap"] == pytest.approx(sum(by_hand(base_gens)) / 3)
    # the source row's own column reached the function; None is no figure for that example
    assert [s["scores"]["metrics.py:country"] for s in samples] == [None, None, None]
    assert metrics["metrics.py:country"] is None
    samples[1]["generation"] = "France"
    scorer(settings, None)(samples, metrics)
    assert samples[1]["scores"]["metrics.py:country"] == 1.0 and metrics["metrics.py:country"] == 1


@pytest.mark.parametrize("metrics, line", [
    (["nope.py:f"], "runs.demo.eval.metrics: 'nope.py:f': nope.py is not a file"),
    (["model:nope"], "runs.demo.eval.metrics: 'model:nope': there is no run 'nope'"),
    (["model:demo"], "runs.demo.eval.metrics: 'model:demo' names this run itself"),
    (["lenght"], "runs.demo.eval.metrics: 'lenght' is not a reward"),
])  # fmt: skip
def test_a_metric_that_cannot_be_used_is_one_line_before_anything_runs(metrics, line):
    import yaml

    from snaketune.plan.config import validate_config

    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["runs"]["demo"]["eval"]["metrics"] = metrics
    with pytest.raises(ConfigError) as err:
        validate_config(config, ROOT)
    assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)


def test_an_edited_metric_reruns_the_evaluation_only(tmp_path, monkeypatch):
    """The file's sha256 is in the evaluate stage's options (its params), not the train's."""
    import yaml

    from snaketune.plan.config import validate_config
    from snaketune.plan.stages import run_eval_args
    from snaketune.plan.trainjob import train_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.py").write_text(METRIC)
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["runs"]["demo"]["eval"]["metrics"] = ["m.py:overlap"]
    run = validate_config(config, ROOT)["runs"]["demo"]
    from snaketune.evaluation.scorers import spec

    before = run_eval_args(run, spec({"runs": {"demo": run}}, "demo", str, lambda m: None))
    trained = train_spec(run)
    (tmp_path / "m.py").write_text(METRIC + "\n# edited\n")
    after = run_eval_args(run, spec({"runs": {"demo": run}}, "demo", str, lambda m: None))
    assert before != after and "code_sha256" in after and train_spec(run) == trained


def test_the_dpo_plot_s_panels_keep_their_axes_apart():
    """The preference panel's second axis (reward accuracy, at its right) and its labels
    end before the next panel's begin, with held-out points while training too."""
    from snaketune.app.plots import training_figure
    from snaketune.methods import method_named

    metrics = [{"step": s, "loss": 0.7 - 0.01 * s, "lr": 1e-3, "tokens_per_s": 900.0,
                "reward_chosen": 0.01 * s, "reward_rejected": -0.01 * s,
                "reward_margin": 0.02 * s, "reward_accuracy": min(1.0, 0.1 * s)}
               for s in range(1, 21)]  # fmt: skip
    metrics += [{"step": s, "heldout_loss": 2.0 - 0.02 * s} for s in (10, 20)]
    fig = training_figure(metrics, "chat_dpo: training", 1.5, None, method_named("dpo").panel)
    fig.canvas.draw()  # the layout is made at drawing, as the SVG is
    renderer = fig.canvas.get_renderer()
    panels = fig.axes[:3]
    first = [ax for ax in fig.axes if ax.get_position().x0 == panels[0].get_position().x0]
    assert len(first) == 2  # the panel and its right axis
    right_edge = max(ax.get_tightbbox(renderer).x1 for ax in first)
    assert right_edge < panels[1].get_tightbbox(renderer).x0, "the panels' labels overlap"
    import matplotlib.pyplot as plt

    plt.close(fig)


# ------------------------------------------------------- no proxy test of a run's kind

# Where a run's kind may be asked directly: the methods, the data kinds, and the module
# that owns what a model's head is.
OWNERS = ("scripts/snaketune/methods/", "scripts/snaketune/data/",
          "scripts/snaketune/evaluation/heads.py")  # fmt: skip
# keys only one method or data kind writes: probing for one (``"k" in m``) tells a kind
ONE_KINDS_KEYS = {
    "reward",
    "reward_margin",
    "chosen_score",
    "chosen_logp",
    "preference_accuracy",
    "likelihood_accuracy",
    "rejected_input_ids",
}
SWITCHES = re.compile(r"reward[-_]seed|dpo[-_]beta")  # a switch named after one method


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)


def proxy_nodes(tree: ast.AST) -> list[tuple[int, str]]:
    """The syntax tree's tests of a run's kind by a proxy: a head compared with "score", a
    metrics file's head read (``.get("head")``), a key only one kind writes probed with
    ``in``, a literal naming a switch after one method."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            if any(_name(x) == "head" for x in sides) and any(
                isinstance(x, ast.Constant) and x.value == "score" for x in sides
            ):
                found.append((n.lineno, "tests a head type"))
            if (
                isinstance(n.left, ast.Constant)
                and n.left.value in ONE_KINDS_KEYS
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in n.ops)
            ):
                found.append((n.lineno, "probes a key that only one method or data kind writes"))
        elif (
            isinstance(n, ast.Call)
            and _name(n.func) == "get"
            and n.args
            and isinstance(n.args[0], ast.Constant)
            and n.args[0].value == "head"
        ):
            found.append((n.lineno, "reads a metrics file's head"))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and SWITCHES.search(n.value):
            found.append((n.lineno, "a switch named after one method"))
    return found


def proxies(paths: list[Path]) -> list[str]:
    """Python files read as syntax trees; the workflow's rules (Snakemake's language) line
    by line for the same forms."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        if path.suffix == ".py":
            found += [f"{where}:{i}: {why}" for i, why in proxy_nodes(ast.parse(text))]
            continue
        for i, line in enumerate(text.splitlines(), 1):
            code = line.split("#")[0]
            if SWITCHES.search(code) or re.search(r"""head\s*[!=]=\s*["']score""", code):
                found.append(f"{where}:{i}: {line.strip()}")
    return found


def test_nothing_outside_the_methods_and_data_kinds_tests_a_run_s_kind_by_a_proxy():
    """Where a run's kind is asked directly is where it is defined: the methods, the data
    kinds, and the module that owns what a model's head is; everywhere else asks them."""
    paths = [
        p
        for p in [
            *ROOT.glob("scripts/**/*.py"),
            *ROOT.glob("workflow/**/*.smk"),
            ROOT / "Snakefile",
        ]
        if not str(p.relative_to(ROOT)).startswith(OWNERS)
    ]
    assert len(paths) > 60
    assert proxies(paths) == []


def test_the_proxy_scan_finds_each_form(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        'if ev.get("head") == "score":\n    pass\nif "reward_margin" in m[0]:\n'
        "    x = '--reward-seed'\nif head != 'score': pass\n"
        'rows = [m for m in metrics if "reward" not in m]\n'
    )
    found = proxies([probe])
    assert sorted({int(f.split(":")[1]) for f in found}) == [1, 3, 4, 5, 6], found


# ------------------------------------------------------------ the chain, end to end

COUNTRIES = [f"Country{chr(65 + i)}{chr(65 + j)}" for i in range(8) for j in range(8)]


def capital(country: str) -> str:
    return country.replace("Country", "City")


def chat_files(data: Path) -> None:
    """Chat rows (messages, with the country as a column of their own) and preference
    pairs (the right capital chosen, another rejected); the last 16 countries held out.
    Questions and answers of unequal length: some ask politely."""
    from conftest import write_jsonl

    def question(i: int, c: str) -> str:
        return f"What is the capital of {c}?" + (" Please answer briefly." if i % 3 else "")

    def chat(i: int, c: str) -> dict:
        return {"messages": [{"role": "user", "content": question(i, c)},
                             {"role": "assistant", "content": f"The capital of {c} is "
                              f"{capital(c)}."}], "country": c}  # fmt: skip

    def pair(i: int, c: str) -> dict:
        other = COUNTRIES[(COUNTRIES.index(c) + 5) % len(COUNTRIES)]
        return {"prompt": question(i, c), "chosen": f"The capital of {c} is {capital(c)}.",
                "rejected": f"The capital of {c} is {capital(other)}.", "country": c}  # fmt: skip

    data.mkdir(parents=True, exist_ok=True)
    train, held = COUNTRIES[:48], COUNTRIES[48:]
    write_jsonl(data / "chat-train.jsonl", [chat(i, c) for i, c in enumerate(train)])
    write_jsonl(data / "chat-test.jsonl", [chat(i, c) for i, c in enumerate(held)])
    write_jsonl(data / "pairs-train.jsonl", [pair(i, c) for i, c in enumerate(train)])
    write_jsonl(data / "pairs-test.jsonl", [pair(i, c) for i, c in enumerate(held)])


CHAIN_METRIC = '''
def overlap(prompts, completions, answer, **kwargs):
    """Share of the reference's words the generation has."""
    return [len(set(c.split()) & set(a.split())) / len(set(a.split()))
            for c, a in zip(completions, answer)]
'''


def chain_config(work: Path) -> dict:
    short = {"nodes": 1, "gpus_per_node": 1, "max_length": 96, "micro_batch_size": 8,
             "max_steps": 12, "save_steps": 12, "deepspeed": "zero2",
             "eval": {"max_new_tokens": 16, "batch_size": 16}}  # fmt: skip
    local = {"source": "local"}
    return {
        "models": {"tiny": {"source": "local", "path": "resources/fixtures/tiny-llama"}},
        "datasets": {
            "chat": {**local, "path": "data/chat-train.jsonl", "format": "messages"},
            "chat_test": {**local, "path": "data/chat-test.jsonl", "format": "messages"},
            "pairs": {**local, "path": "data/pairs-train.jsonl", "format": "preference"},
            "pairs_test": {**local, "path": "data/pairs-test.jsonl", "format": "preference"},
        },
        "runs": {
            "chat_sft": {"model": "tiny", "dataset": "chat", "eval_dataset": "chat_test",
                         "method": "lora", "learning_rate": 3e-3,
                         "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **short},
            "rm": {"model": "tiny", "dataset": "pairs", "eval_dataset": "pairs_test",
                   "method": "reward", "learning_rate": 1e-3, **short},
            "chat_dpo": {"init_from": "chat_sft", "dataset": "pairs", "method": "dpo",
                         "eval_dataset": "pairs_test", "learning_rate": 1e-3,
                         "lora": {"r": 8, "alpha": 16, "dropout": 0.0}, **short,
                         "eval": {**short["eval"],
                                  "metrics": ["metrics.py:overlap", "model:rm"]}},
        },
    }  # fmt: skip


def rewards_by_hand(model_dir: Path, prompts: list[str], completions: list[str]) -> list[float]:
    """The reward model's scores with plain transformers: each prompt's user turn and its
    completion in the model's own chat template, cut at the run's max_length, the logit at
    the last token, one text at a time."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": completion}],
                                       tokenize=False)  # fmt: skip
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :96]
        with torch.no_grad():
            out.append(model(input_ids=ids).logits[0, 0].item())
    return out


@pytest.mark.slow
@pytest.mark.extended
def test_a_chat_sft_then_dpo_chain_is_evaluated_on_its_task(fixtures_dir, tmp_path):
    """A user's chat data tuned with LoRA, then DPO from it on preference pairs, with a
    metric of their own and a reward run's model as metrics: the end line, the summary and
    the report lead with the held-out loss, chrF and DPO's preference accuracy, base beside
    tuned; the samples show their reference text and no right/wrong mark; the user's metric
    and the reward model's score equal the function and the model run by hand."""
    import html
    import importlib.util
    import shutil
    import subprocess

    import yaml

    work = tmp_path / "w"
    (work / "resources").mkdir(parents=True)
    shutil.copytree(fixtures_dir / "tiny-llama", work / "resources/fixtures/tiny-llama")
    chat_files(work / "data")
    (work / "metrics.py").write_text(CHAIN_METRIC)
    (work / "config.yaml").write_text(yaml.safe_dump(chain_config(work), sort_keys=False))
    from conftest import snakemake

    proc = snakemake("--configfile", str(work / "config.yaml"), "--directory", str(work),
                     cwd=work, check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    (line,) = [ln for ln in out.splitlines() if ln.startswith("report: ")]
    dpo_part = line.split("chat_dpo: ")[1].split(" | ")[0]
    sft_part = line.split("chat_sft: ")[1].split(" | ")[0]
    assert dpo_part.startswith("preference_accuracy "), line
    for figure in ("preference_accuracy ", "eval loss ", "chrF ", "metrics.py:overlap ",
                   "model:rm "):  # fmt: skip
        assert figure in dpo_part and "(base " in dpo_part, (figure, line)
    assert sft_part.startswith("eval loss ") and "chrF " in sft_part, line
    assert "exact_match" not in line and "math_verify" not in line, line

    results = work / "results"
    metrics = json.loads((results / "chat_dpo/eval/metrics.json").read_text())
    assert metrics["format"] == "text" and metrics["headline"][:3] == [
        "preference_accuracy", "loss", "chrf"]  # fmt: skip
    samples = [json.loads(x) for x in (results / "chat_dpo/eval/samples.jsonl").read_text()
               .splitlines()]  # fmt: skip
    base = [json.loads(x) for x in (results / "chat_dpo/start_eval/samples.jsonl").read_text()
            .splitlines()]  # fmt: skip
    assert len(samples) == len(base) == 16
    # the user's metric, by hand on the same samples: the file imported here, called alone
    spec = importlib.util.spec_from_file_location("user_metrics", work / "metrics.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    for rows, figure in ((samples, metrics["metrics.py:overlap"]),
                         (base, metrics["base"]["metrics.py:overlap"])):  # fmt: skip
        want = [user.overlap([s["prompt"]], [s["generation"]], [s["reference"]])[0]
                for s in rows]  # fmt: skip
        assert figure == pytest.approx(sum(want) / len(want))
    for s in samples:
        assert s["scores"]["metrics.py:overlap"] == pytest.approx(
            user.overlap([s["prompt"]], [s["generation"]], [s["reference"]])[0])  # fmt: skip
    # the reward run's model, by hand with plain transformers on every generation
    pairs = [json.loads(x) for x in (work / "data/pairs-test.jsonl").read_text().splitlines()]
    prompt = {f"pairs_test:{i}": p["prompt"] for i, p in enumerate(pairs)}
    rm = next(results / "rm" / n for n in ("merged_model", "hf") if (results / "rm" / n).is_dir())
    for rows, figure, key in ((samples, metrics, "model:rm"),
                              (base, metrics["base"], "model:rm")):  # fmt: skip
        want = rewards_by_hand(rm, [prompt[s["example_id"]] for s in rows],
                               [s["generation"] for s in rows])  # fmt: skip
        assert figure[key] == pytest.approx(sum(want) / len(want), abs=1e-4)
        if rows is samples:
            assert [s["scores"][key] for s in rows] == pytest.approx(want, abs=1e-4)

    # the report: the reference text of each sample, no mark; the summary table fits
    page = (results / "summary.html").read_text()
    for run in ("chat_sft", "chat_dpo"):  # (the reward run's pairs are marked: a checker)
        section = page.split(f'<section id="run-{run}">')[1].split("</section>")[0]
        assert "✗ wrong" not in section and "✓ right" not in section, run
        assert "no final answer" in section and "None" not in section.split("Samples")[1]
    assert html.escape(samples[0]["reference"].strip()) in section
    chromium = shutil.which("chromium")
    assert chromium, "chromium is needed (scripts/setup_env.sh installs it)"
    probe = results / "width-probe.html"
    probe.write_text(
        page.replace(
            "</body>",
            "<script>const t = document.getElementById("
            "'summary').parentElement; document.title = 'W' + "
            "t.scrollWidth + '/' + t.clientWidth;</script></body>",
        )
    )
    measured = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
         f"--user-data-dir={tmp_path / '.chromium'}", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    scroll, width = map(int, re.search(r"<title>W(\d+)/(\d+)</title>", measured).groups())
    assert scroll <= width, f"the summary table is {scroll} px wide in {width} px"
