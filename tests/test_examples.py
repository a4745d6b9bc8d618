"""Every config example runs in miniature, end to end (tests/miniature.py: the example as
written, only its sizes changed): download, tokenization, sharding, training on emulated
nodes, conversion, merge, evaluation and the report, then plain transformers generates with
each run's exported model on a padded batch, whose config has the base model's inference
settings; a run with tools is evaluated by its tool loop. A new file under config/examples/
is covered with nothing else to write but its model's published config.json fields in
conftest.SHAPES (a vision-language model trained on text: VLM_SHAPES, its family in
tests/families.py).

The CI tier runs the vision-language example in miniature (tests/test_pictures.py, with
checks of its own); the extended tier runs every other one here, the mixture-of-experts
example with a full fine-tune of the same model beside it (its default dropout and exported
router switch, the defects found by running it, are caught in the CI tier by test_moe.py's
own tests: tests/mutations.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import ROOT, snakemake
from miniature import defaults_config, miniature

# The examples another test runs in miniature with checks of their own (the vision-language
# example: tests/test_pictures.py, in the CI tier), left out here.
ELSEWHERE = {"gemma3-4b-vlm-lora-2x4"}
EXAMPLES = sorted(e for e in (ROOT / "config/examples").glob("*.yaml") if e.stem not in ELSEWHERE)


def exported(results: Path, run: str) -> tuple[Path, Path | None]:
    """A run's exported model: (model directory, adapter directory or None)."""
    for name in ("merged_model", "hf"):
        if (results / run / name / "config.json").is_file():
            return results / run / name, None
    adapter = results / run / "lora_adapters"
    assert (adapter / "adapter_config.json").is_file(), sorted((results / run).iterdir())
    base = json.loads((adapter / "provenance.json").read_text())["inputs"]["base"]["path"]
    return results.parent / base, adapter  # recorded relative to the working directory


def generates_on_a_padded_batch(model_dir: Path, adapter: Path | None) -> list[str]:
    """Two prompts of unequal length, left-padded, 4 new tokens each, by plain
    transformers (and peft for an adapter kept apart from its base); a reward model (a
    sequence classifier) scores the batch instead."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    tokenizer = AutoTokenizer.from_pretrained(adapter or model_dir, padding_side="left")
    config = json.loads((model_dir / "config.json").read_text())
    scorer = config["architectures"][0].endswith("ForSequenceClassification")
    auto = AutoModelForSequenceClassification if scorer else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from snaketune.core.lora_targets import load_adapter

        model = load_adapter(model, adapter)
    prompts = ["Tina has 43 clips. She buys 5 more. How many?", "2 + 3 ="]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()  # padded
    with torch.no_grad():
        if scorer:
            scores = model.eval()(**batch).logits
            assert scores.shape == (2, 1) and torch.isfinite(scores).all()
            return [str(float(v)) for v in scores[:, 0]]
        out = model.eval().generate(**batch, max_new_tokens=4, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    assert out.shape[0] == 2 and out.shape[1] > batch["input_ids"].shape[1]
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])


def runs_of(workdir: Path) -> list[str]:
    """The runs the pipeline made (sweep members by their own names): summary.tsv's rows."""
    with open(workdir / "results/summary.tsv") as f:
        return [row["run"] for row in csv.DictReader(f, delimiter="\t")]


def check_miniature(workdir: Path, config: dict) -> None:
    """Each run of ``config`` (the miniature's) in the report, evaluated where it names an
    eval set, its exported model generating on a padded batch with the base's inference
    settings."""
    from snaketune.export.convert import TRAINING_SWITCHES

    results = workdir / "results"
    made = runs_of(workdir)
    for name, spec in config["runs"].items():
        members = [r for r in made if r == name or r.startswith(f"{name}-")]
        assert members, (name, made)
        for run in members:  # evaluated where the run names an eval set
            assert (results / run / "eval/metrics.json").is_file() == ("eval_dataset" in spec), run
            if "eval_dataset" in spec and spec.get("grpo", {}).get("tools"):  # the tool loop ran
                metrics = json.loads((results / run / "eval/metrics.json").read_text())
                assert metrics["tools"]["turns_per_sample"] >= 1, (run, metrics["tools"])
            model_dir, adapter = exported(results, run)
            texts = generates_on_a_padded_batch(model_dir, adapter)
            assert len(texts) == 2
            got = json.loads((model_dir / "config.json").read_text())
            for key, absent in TRAINING_SWITCHES.items():
                if key in got:  # the tiny bases say use_cache true, no router logits
                    assert got[key] == absent, (run, key, got[key])
    assert (results / "summary.html").is_file()


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.parametrize("example", [pytest.param(e, id=e.stem) for e in EXAMPLES])
def test_each_example_runs_in_miniature(demo, example, tmp_path):
    import yaml

    path = miniature(example, demo, tmp_path / "w")
    config = yaml.safe_load(path.read_text())
    if example.stem == "qwen3-30b-a3b-lora-1x8":  # the same model fully fine-tuned, beside
        # the example's LoRA run
        ((name, run),) = config["runs"].items()
        full = {k: v for k, v in run.items() if k != "lora"}
        config["runs"][f"{name}_full"] = {**full, "method": "full", "learning_rate": 1e-4}
        path.write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake("--configfile", str(path), "--directory", str(tmp_path / "w"))
    check_miniature(tmp_path / "w", config)


@pytest.mark.extended
@pytest.mark.slow
def test_every_method_runs_from_the_schemas_defaults(demo, tmp_path):
    """A user's first config for each training method (tests/miniature.py's
    defaults_config: only the required keys written, 4 steps) runs end to end on the demo's
    tiny model: each run evaluated and reported, each export used by plain transformers."""
    import yaml

    path = defaults_config(demo, tmp_path / "w")
    snakemake("--configfile", str(path), "--directory", str(tmp_path / "w"))
    check_miniature(tmp_path / "w", yaml.safe_load(path.read_text()))


def test_the_cpt_example_s_comment_is_its_plan_before_anything_is_downloaded(tmp_path, capsys):
    """The continued pre-training example planned offline, before any download (the 1B's
    published config.json given on the plan's command line; the corpus's size from the
    example's `size`): its steps and tokens a step are printed, and its comment's figures
    are the plan's, rounded as the comment rounds them."""
    import re

    from conftest import SHAPES

    from snaketune.app.cli import main

    example = ROOT / "config/examples/llama3.2-1b-cpt-fineweb-edu-sft-4x8.yaml"
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["meta-llama/Llama-3.2-1B"]))
    main(["plan", str(example), "--root", str(ROOT), "--model-config",
          f"llama32_1b={tmp_path / 'config.json'}"])  # fmt: skip
    out = capsys.readouterr().out
    steps = int(re.search(r"^cpt: ([\d,]+) optimizer steps", out, re.M)[1].replace(",", ""))
    step = re.search(r"^cpt: tokens: about ([\d.]+)M a step", out, re.M)
    assert step is not None, out
    assert re.search(r"^cpt: train about [\d.]+ h on 32 device\(s\).*GPU-hours", out, re.M), out
    text = example.read_text()
    said = re.search(r"\(about ([\d.]+)M tokens, the\s+#\s+documents' mean", text)
    said_steps = re.search(r"epoch: about ([\d,]+) steps", text)
    assert said is not None and said_steps is not None
    assert float(said[1]) == round(float(step[1]), 2)
    assert int(said_steps[1].replace(",", "")) == round(steps, -2)


def test_the_opd_example_is_planned_offline_with_its_generation_time(tmp_path, capsys):
    """The on-policy distillation example offline (the models' published config.json
    files given on the command line, GSM8K's rows from the example's `size`): the student's
    400 steps with each step's generation at generate()'s per-layer floor (16 layers of
    the 1B at 19.7 ms / 18 a layer, its 256 decode steps a GPU), the teacher's steps
    from the stated rows, and both runs' GPU-hours."""
    import re

    from conftest import SHAPES

    from snaketune.app.cli import main

    example = ROOT / "config/examples/llama3.2-1b-opd-from-8b-gsm8k-2x4.yaml"
    args = ["plan", str(example), "--root", str(ROOT)]
    for name, repo in (("llama32_1b_instruct", "meta-llama/Llama-3.2-1B-Instruct"),
                       ("llama31_8b_instruct", "meta-llama/Llama-3.1-8B-Instruct")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(SHAPES[repo]))
        args += ["--model-config", f"{name}={tmp_path / name}"]
    main(args)
    out = capsys.readouterr().out
    assert re.search(r"^gsm8k_student: 400 optimizer steps", out, re.M), out
    generation = re.search(r"^gsm8k_student: train about .* GPU-hours \(a step: generation "
                           r"([\d.]+) s \(100% of steps, 256 decode steps a GPU of ([\d.]+) ms",
                           out, re.M)  # fmt: skip
    assert generation is not None, out
    assert float(generation[2]) == round(16 * 19.7 / 18, 1)
    assert float(generation[1]) == round(256 * 16 * 19.7e-3 / 18, 1)
    # the teacher: 7,473 rows, 4 a micro batch x 8 GPUs = 32 a step: 233 a step x 2 epochs
    assert re.search(r"^gsm8k_teacher: 466 optimizer steps \(233 per epoch x 2 epochs; 7,473 "
                     r"examples, datasets.gsm8k_train.size: 7,473 rows", out, re.M), out  # fmt: skip
    assert re.search(r"^gsm8k_teacher: train about .* GPU-hours", out, re.M), out
