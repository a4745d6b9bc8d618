"""Held-out evaluation while training (eval_steps), the best checkpoint exported
(export.checkpoint: best) and early stopping (snaketune.core.heldout, snaketune.evaluation.heldout_pass).

The slow tests share one training (the ``heldout_run`` fixture): the demo's run again from
the demo's tuned model on its shards, 40 steps on 2 ranks with the learning rate warming up
to a value that undoes the tuning (0.05 at step 38), so that the held-out loss falls, then
rises: evaluated every 10 steps (exact match too), checkpoints every 10 with
save_total_limit 1, the best checkpoint exported."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, launch_train, read_jsonl, run_spec, train

from snaketune.core.checkpoints import best_checkpoint, mark_complete, prune
from snaketune.core.errors import ConfigError
from snaketune.core.heldout import spec_of
from snaketune.evaluation.heldout_pass import Schedule
from snaketune.plan.config import load_yaml, validate_config


def demo_config(**run) -> dict:
    config = load_yaml(ROOT / "config" / "config.yaml")
    config["runs"]["demo"].update(run)
    return config


@pytest.mark.parametrize(
    "change,line",
    [
        ({"export": {"checkpoint": "best"}},
         "runs.demo.export.checkpoint: best needs held-out figures while training; set "
         "eval_steps (and eval_dataset), or checkpoint: last"),
        ({"early_stopping": {"patience": 2}},
         "runs.demo.early_stopping: needs eval_steps (and eval_dataset); set eval_steps"),
        ({"eval_steps": 20, "export": {"checkpoint": "best"}},
         "runs.demo.export.checkpoint: best needs a checkpoint at every evaluation: eval_steps "
         "(20) must be a multiple of save_steps (50)"),
    ],
)  # fmt: skip
def test_bad_heldout_settings_get_one_line(change, line):
    with pytest.raises(ConfigError) as info:
        validate_config(demo_config(**change), ROOT)
    assert str(info.value) == line


@pytest.mark.parametrize(("eval_steps", "save_steps", "refused"),
                         [(50, 50, False), (100, 50, False), (150, 50, False), (20, 50, True),
                          (50, 100, True), (75, 50, True)])  # fmt: skip
def test_export_best_needs_evaluations_on_saved_steps(eval_steps, save_steps, refused):
    """An evaluation at a step with no checkpoint could not be exported: eval_steps must be a
    whole multiple of save_steps (equal included), not the other way round."""
    config = demo_config(eval_steps=eval_steps, save_steps=save_steps,
                         export={"checkpoint": "best"})  # fmt: skip
    if not refused:
        validate_config(config, ROOT)
        return
    with pytest.raises(ConfigError, match=rf"eval_steps \({eval_steps}\) must be a multiple of "
                                          rf"save_steps \({save_steps}\)"):  # fmt: skip
        validate_config(config, ROOT)


def test_eval_steps_without_an_eval_set_gets_one_line():
    config = demo_config(eval_steps=50)
    del config["runs"]["demo"]["eval_dataset"]
    with pytest.raises(ConfigError, match=r"^runs.demo.eval_steps: nothing to evaluate on; set "
                                          r"eval_dataset"):  # fmt: skip
        validate_config(config, ROOT)


def test_a_run_without_eval_steps_trains_with_the_same_spec():
    """eval_at_start's default must not change the train rule's params of existing runs
    (Snakemake would retrain them)."""
    from snaketune.plan import trainjob

    config = validate_config(demo_config(), ROOT)
    spec = json.loads(trainjob.train_spec(config["runs"]["demo"]))
    assert "eval_at_start" not in spec and "heldout" not in spec
    assert trainjob.train_extras(config, "demo") == {}
    config = validate_config(demo_config(eval_steps=50), ROOT)
    extras = trainjob.train_extras(config, "demo")
    assert extras["heldout"].startswith("results/tokenized/arith_test__")
    spec = json.loads(trainjob.train_spec(config["runs"]["demo"], **extras))
    assert spec["heldout"]["path"] == extras["heldout"] and spec["heldout"]["metric"] == "auto"


def test_early_stopping_counts_evaluations_without_improvement():
    rows = [{"step": 0, "eval_loss": 9.0}, {"step": 10, "eval_loss": 2.0},
            {"step": 20, "eval_loss": 1.95}, {"step": 30, "eval_loss": 2.1},
            {"step": 40, "eval_loss": 1.99}, {"loss": 1.0, "step": 41}]  # fmt: skip
    assert Schedule(10, "loss", {"patience": 2}, 0).stalled(rows) == (2, 1.95, 20)
    assert Schedule(10, "loss", {"patience": 3}, 0).stalled(rows) is None
    # with min_delta 0.1, 1.95 is no improvement on 2.0: three evaluations since step 10
    assert Schedule(10, "loss", {"patience": 3, "min_delta": 0.1}, 0).stalled(rows) == (3, 2.0, 10)
    accuracy = [{"step": 10, "eval_exact_match": 0.5}, {"step": 20, "eval_exact_match": 0.4}]
    assert Schedule(10, "exact_match", {"patience": 1}, 0).stalled(accuracy) == (1, 0.5, 10)


def test_a_start_that_beats_every_checkpoint_is_said_in_the_card_and_the_report():
    """export: best on a run whose held-out figure before training beats every checkpoint
    (the GRPO run that met it: exact match 0.766 at step 0, 0.703 at best): the model
    card and the report say so, with both figures; a run that improved gets no word."""
    from snaketune.app.report import worse_than_start
    from snaketune.app.summary import _fmt, heldout_columns
    from snaketune.core.heldout import start_figure
    from snaketune.export.hub import exported_lines

    held = [{"step": 0, "heldout_exact_match": 0.766, "heldout_loss": 0.5},
            {"step": 10, "heldout_exact_match": 0.703, "heldout_loss": 0.6},
            {"step": 20, "heldout_exact_match": 0.688, "heldout_loss": 0.7}]  # fmt: skip
    assert start_figure(held, "exact_match") == 0.766 and start_figure(held[1:], "loss") is None
    exported = {"checkpoint": "best", "step": 10, "metric": "exact_match", "value": 0.703,
                "last_step": 20, "reason": "best held-out exact_match (highest)",
                "start_value": 0.766, "worse_than_start": True}  # fmt: skip
    card = "\n".join(exported_lines(exported))
    assert "The weights of step 10 of 20" in card
    assert ("**Worse than before training:** the held-out exact_match of the model before "
            "training was 0.766; no evaluated checkpoint reached it.") in card  # fmt: skip
    row = {"run": "rl", **{k: _fmt(v) for k, v in heldout_columns(held, exported).items()}}
    assert worse_than_start(row).startswith(
        "the held-out exact_match before training, 0.766, beats every evaluated checkpoint "
        "(the best: 0.703, step 10); export.checkpoint: best exports step 10 all the same"
    )
    better = {**exported, "start_value": 0.5, "worse_than_start": False}
    assert "Worse" not in "\n".join(exported_lines(better))
    row = {"run": "rl", **{k: _fmt(v) for k, v in heldout_columns(held, better).items()}}
    assert worse_than_start(row) is None


def test_prune_keeps_the_best_checkpoint(tmp_path):
    for step, loss in ((10, 2.0), (20, 1.5), (30, 1.7), (40, 1.9)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        mark_complete(tmp_path / f"checkpoint-{step}", step, 0.0, {"loss": loss})
    assert best_checkpoint(tmp_path, "loss", False).name == "checkpoint-20"
    assert best_checkpoint(tmp_path, "loss", True).name == "checkpoint-10"
    prune(tmp_path, 1, "all", ("loss", False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-20", "checkpoint-40"]
    prune(tmp_path, 1, "all")  # without export best: the newest only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-40"]


@pytest.mark.parametrize(("metric", "kept"), [("loss", "checkpoint-20"),
                                              ("exact_match", "checkpoint-30"),
                                              ("auto", "checkpoint-20")])  # fmt: skip
def test_the_checkpoint_a_run_keeps_as_best(tmp_path, metric, kept):
    """What the worker tells pruning to keep (runspec.kept_best) for a run exporting its best
    checkpoint: the lowest held-out loss, the highest exact match (picked by hand below);
    `auto` is the SFT method's own figure, the loss."""
    from snaketune.plan.runspec import kept_best

    figures = {10: (2.0, 0.10), 20: (1.5, 0.20), 30: (1.7, 0.45), 40: (1.9, 0.30)}
    for step, (loss, exact) in figures.items():
        (tmp_path / f"checkpoint-{step}").mkdir()
        mark_complete(tmp_path / f"checkpoint-{step}", step, 0.0,
                      {"loss": loss, "exact_match": exact})  # fmt: skip
    run = run_spec(max_steps=40, save_steps=10, eval_steps=10,
                   export={"checkpoint": "best", "metric": metric})  # fmt: skip
    run["heldout"] = spec_of(run, "eval.parquet")
    assert kept_best(run)[0] == ("loss" if metric == "auto" else metric)
    prune(tmp_path, 1, "all", kept_best(run))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({kept, "checkpoint-40"})
    run["heldout"]["checkpoint"] = "last"
    assert kept_best(run) is None


# ----------------------------------------------------------------------------- training


def heldout_spec(demo, answers: bool = False, **overrides) -> dict:
    run = run_spec(max_steps=40, save_steps=10, save_total_limit=1, eval_steps=10,
                   learning_rate=0.05, lr_scheduler="linear", warmup_ratio=0.95,
                   export={"checkpoint": "best"},
                   eval={"batch_size": 64, "max_new_tokens": 16,
                         "during_training_answers": answers}, **overrides)  # fmt: skip
    eval_set = next((demo / "results/tokenized").glob("arith_test__*/data.parquet"))
    run["heldout"] = spec_of(run, str(eval_set))
    return run


@pytest.fixture(scope="session")
def heldout_run(demo, tmp_path_factory):
    """The demo's tuned model trained on, 40 steps, held-out loss and exact match every 10
    steps (the loss decides), the best checkpoint exported."""
    work = tmp_path_factory.mktemp("heldout")
    spec = heldout_spec(demo, answers=True)
    out = train(work, spec, demo / "results/demo/shards", demo / "results/demo/merged_model",
                "zero2")  # fmt: skip
    return work, out, spec


def peft_model(demo, adapter):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo / "results/demo/merged_model",
                                                local_files_only=True)  # fmt: skip
    return PeftModel.from_pretrained(base, str(adapter)).eval()


@pytest.mark.slow
def test_heldout_rows_every_n_steps_and_the_best_checkpoint_exported(demo, heldout_run):
    from safetensors.torch import load_file

    from snaketune.core.rows import pad_id
    from snaketune.evaluation.evaluate import heldout_loss, load_examples, score
    from snaketune.evaluation.generation import generate

    work, out, spec = heldout_run
    rows = read_jsonl(out / "metrics.jsonl")
    held = [{k[8:]: v for k, v in r.items() if k.startswith("heldout_")} | {"step": r["step"]}
            for r in rows if "heldout_loss" in r]  # fmt: skip
    assert [r["step"] for r in held] == [0, 10, 20, 30, 40]
    assert all("loss" not in r for r in rows if "heldout_loss" in r)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 41))
    eval_set = spec["heldout"]["path"]
    examples = load_examples(eval_set, None)
    assert {r["examples"] for r in held} == {len(examples)}
    # the exported checkpoint is the one with the lowest held-out loss of those evaluated
    exported = json.loads((out / "model/exported.json").read_text())
    by_step = {r["step"]: r for r in held if r["step"] > 0}
    best = min(by_step, key=lambda s: by_step[s]["loss"])
    assert exported["step"] == best and exported["metric"] == "loss", (exported, by_step)
    assert best < 40, f"the learning rate was meant to overshoot: {by_step}"  # a real choice
    # the figure before training recorded beside it: the tuned demo model it starts from
    # beats every checkpoint of this overshooting run, and the log says so with both figures
    assert exported["start_value"] == held[0]["loss"] < by_step[best]["loss"]
    assert exported["worse_than_start"] is True
    log = (out / "logs/attempt-1.log").read_text()
    assert (f"the held-out loss before training, {held[0]['loss']:.4g}, beats every evaluated "
            f"checkpoint (the best: {by_step[best]['loss']:.4g}, step {best})") in log  # fmt: skip
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["exported"]["step"] == best
    # save_total_limit 1 kept the newest checkpoint and the best
    kept = sorted(p.name for p in (out / "checkpoints").glob("checkpoint-*"))
    assert kept == [f"checkpoint-{best}", "checkpoint-40"]
    # the exported adapter is that step's: its held-out loss is the evaluate stage's for it
    # (fp32, relative 1e-5)
    from transformers import AutoTokenizer

    model = peft_model(demo, out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    stage = heldout_loss(model, examples, 64, pad_id(tokenizer))
    assert stage["loss"] == pytest.approx(by_step[best]["loss"], rel=1e-5)
    # ... and its exact match on the same examples (greedy, the evaluate stage's checks)
    texts, stopped = generate(model, tokenizer, examples, 64, spec["heldout"]["max_new_tokens"])
    assert score(examples, texts, stopped, tokenizer)[1]["exact_match"] == pytest.approx(
        by_step[best]["exact_match"], abs=1e-9)  # fmt: skip
    # the probe (what convert's and merge's gates compare with) is the exported weights'
    probe = load_file(str(out / "probe.safetensors"))
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    assert torch.allclose(logits, probe["logits"], atol=1e-5 * max(1.0, logits.abs().max()))


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_run_keeps_each_heldout_row_once(demo, heldout_run, tmp_path):
    """The fixture's training killed after checkpoint-20 and rerun: it resumes there, and
    the held-out rows (step 0 included) are each written once, with the same figures."""
    import time

    import psutil

    _, out, spec = heldout_run
    live = tmp_path / "results/x/train/checkpoints/metrics.jsonl"
    proc = launch_train(tmp_path, spec, demo / "results/demo/shards",
                        demo / "results/demo/merged_model", "zero2")  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rows = read_jsonl(live) if live.exists() and live.read_text() else []
            if rows and rows[-1]["step"] >= 23:
                break
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        proc.kill()
        proc.communicate()
    again = launch_train(tmp_path, spec, demo / "results/demo/shards",
                         demo / "results/demo/merged_model", "zero2")  # fmt: skip
    log, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "resuming from checkpoint-20" in log, log[-3000:]
    got = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    want = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], "heldout_loss" in r) for r in got] == [
        (r["step"], "heldout_loss" in r) for r in want]  # fmt: skip
    for a, b in zip(got, want, strict=True):
        if "heldout_loss" in a:
            assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6), a["step"]


@pytest.mark.extended
@pytest.mark.slow
def test_early_stopping_ends_as_a_finished_run(demo, tmp_path):
    """patience 1 and a min_delta no change reaches: the run stops at its second evaluation
    in training (step 20 of 40), exit 0, every output written, and says why."""
    spec = heldout_spec(demo, early_stopping={"patience": 1, "min_delta": 100.0},
                        eval_at_start=False)  # fmt: skip
    spec["export"] = {**spec["export"], "checkpoint": "last"}
    spec["heldout"]["checkpoint"] = "last"
    proc = launch_train(tmp_path, spec, demo / "results/demo/shards",
                        demo / "results/demo/merged_model", "zero2")  # fmt: skip
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    assert "early stopping at step 20: held-out loss has not improved by more than 100 for 1 " \
           "evaluations" in log, log[-3000:]  # fmt: skip
    out = tmp_path / "results/x/train"
    for name in ("final_checkpoint", "model", "metrics.jsonl", "probe.safetensors",
                 "run_config.json", "provenance.json"):  # fmt: skip
        assert (out / name).exists(), name
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "heldout_loss" in r] == [10, 20]
    assert rows[-1]["step"] == 20


def test_a_sweep_selects_on_the_best_heldout_figure_seen_while_training():
    from snaketune.app.selection import best_member

    select = {"metric": "heldout_loss_best", "mode": "min"}
    specs = {m: {"sweep_of": {"values": {"learning_rate": lr}, "select": select}}
             for m, lr in (("a", 1e-3), ("b", 1e-2))}  # fmt: skip
    curves = {  # b ends worse but saw the lower held-out loss on the way
        "a": [{"step": 0, "heldout_loss": 0.5}, {"step": 10, "loss": 2.0},
              {"step": 10, "heldout_loss": 1.8}, {"step": 20, "heldout_loss": 1.7}],
        "b": [{"step": 10, "loss": 1.0}, {"step": 10, "heldout_loss": 1.2},
              {"step": 20, "heldout_loss": 1.9}],
    }  # fmt: skip
    best = best_member(specs, {}, curves)
    assert best["best"] == "b" and best["value"] == 1.2  # step 0 (the start) does not count
    config = demo_config(
        sweep={"learning_rate": [1e-3, 1e-2]},
        sweep_select={"metric": "heldout_loss_best", "mode": "min"},
    )
    with pytest.raises(ConfigError, match="is the best held-out figure seen while training: "
                                          "set eval_steps"):  # fmt: skip
        validate_config(config, ROOT)
    config["runs"]["demo"]["eval_steps"] = 50
    assert len(validate_config(config, ROOT)["runs"]) == 2


@pytest.mark.extended
@pytest.mark.slow
def test_a_run_continued_on_one_node_keeps_its_heldout_history(demo, heldout_run, tmp_path):
    """The fixture's run taken back to checkpoint-10 (its best, which pruning kept) and
    continued on 1 node (accumulation 2: the same global batch, resharded): the held-out
    rows up to step 10 kept, those after written once, with the 2-node run's figures."""
    import shutil
    import subprocess
    import sys

    from conftest import ENV

    _, out, spec = heldout_run
    ckpt = tmp_path / "results/x/train/checkpoints"
    shutil.copytree(out / "checkpoints", ckpt)
    shutil.rmtree(ckpt / "checkpoint-40")
    tokenized = next((demo / "results/tokenized").glob("arith__*/data.parquet"))
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(tokenized), "--nodes", "1", "--gpus-per-node", "1",
                    "--micro-batch-size", "32", "--gradient-accumulation-steps", "2",
                    "--seed", str(spec["seed"]), "--model", str(demo / "resources/models/tiny"),
                    "--out", str(tmp_path / "shards")], check=True, env=ENV,
                   capture_output=True)  # fmt: skip
    one = {**spec, "nodes": 1, "gradient_accumulation_steps": 2}
    # the 2-node run's workers had 2 threads each (conftest.launch_train): so does this one
    proc = launch_train(tmp_path, one, tmp_path / "shards", demo / "results/demo/merged_model",
                        "zero2", threads=2)  # fmt: skip
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    assert "resuming from checkpoint-10" in log, log[-3000:]
    got = read_jsonl(tmp_path / "results/x/train/metrics.jsonl")
    want = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], "heldout_loss" in r) for r in got] == [
        (r["step"], "heldout_loss" in r) for r in want]  # fmt: skip
    # rows up to the checkpoint are the 2-node run's own; the first pass after it agrees to
    # float noise (measured 1.1e-5, the training loss at step 20 1.3e-5). Later passes are
    # compared for presence only: the learning rate this fixture warms up to (0.05) makes
    # the run unstable from step ~25, which amplifies that noise (3.7e-3 at step 30, 0.58 at
    # 39; resumed on the same 2 nodes, the test above holds every pass to 1e-6).
    assert [r for r in got if r["step"] <= 10] == [r for r in want if r["step"] <= 10]
    (a,) = [r for r in got if r["step"] == 20 and "heldout_loss" in r]
    (b,) = [r for r in want if r["step"] == 20 and "heldout_loss" in r]
    assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-4)
