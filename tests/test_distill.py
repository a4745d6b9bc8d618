"""Distillation (method: distill): a student trained on rows with cross-entropy mixed with a
divergence from a teacher's top-k, the teacher's log-probs computed once (rule
teacher_logps).

One pipeline (``distill_chain``) proves the pieces meet: a larger tiny model tuned first
(run ``teacher``, full fine-tuning), a student distilled from it on 2 nodes (run
``student``, LoRA) and the same student tuned by SFT alone on the same data and steps (run
``sft``), and an on-policy student from the same teacher (run ``opd``, method opd: the
student samples, the teacher scores each token live; tests/test_opd.py has its per-step
oracle). Its outputs are checked against computations written out with plain transformers
and torch (tests/oracles.py): the stored top-k, the student's first logged step, the
held-out KL, the teacher's NLL of the on-policy student's greedy completions. In the CI
tier the teacher and the student train 16 steps, the on-policy student 4, and the run
``sft`` is left out: every stage and figure runs, and the comparisons that need the
students to have learnt (closer to the teacher than SFT alone; completions the teacher
finds likelier than the base student's) are the extended tier's.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import (
    ENV,
    ROOT,
    ci_tier,
    kill_and_resume,
    pipeline_inputs,
    pipeline_spec,
    read_jsonl,
    snakemake,
    train,
)
from oracles import distill_sums, mean_nll, planned_steps, teacher_topk, token_logps

from snaketune.core.errors import ConfigError
from snaketune.plan.config import validate_config

LORA = {
    "r": 8,
    "alpha": 16,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "modules_to_save": ["lm_head", "embed_tokens"],
}
STUDENT = {
    "model": "tiny",
    "dataset": "mixed",
    "eval_dataset": "arith_test",
    "lora": LORA,
    "nodes": 2,
    "gpus_per_node": 1,
    "max_length": 256,
    "micro_batch_size": 16,
    "max_steps": 32,
    "save_steps": 16,
    "learning_rate": 6.0e-3,
    "checkpoints": {"optimizer": "all"},
    "seed": 16,  # its plan's first step gives the ranks 17 and 15 rows
    "eval": {"max_new_tokens": 16, "batch_size": 64},
}
DISTILL = {"teacher": "teacher"}  # the schema's defaults: top-k 32, alpha 0.5, T 1, forward KL
# on-policy distillation from the same teacher (the schema's defaults: reverse KL, T 1, every
# step on-policy), completions as long as the eval's; its adapter leaves the head alone (TRL's
# divergence reads the heads' weights)
OPD = {
    **STUDENT,
    "method": "opd",
    "lora": {k: v for k, v in LORA.items() if k != "modules_to_save"},
    "opd": {"teacher": "teacher", "max_completion_length": 16},
    "micro_batch_size": 8,
    "max_steps": 24,
    "learning_rate": 2.0e-3,
}


def build_model(
    tokenizer_dir: Path,
    out: Path,
    vocab: int | None = None,
    seed: int = 1,
) -> Path:
    """A tiny Llama larger than the demo's (3 layers, hidden 128) with the tokenizer of
    ``tokenizer_dir``, or (``vocab``) a tokenizer of its own trained to that size."""
    from transformers import AutoTokenizer

    from snaketune.app.fixtures import FixtureSizes, build_model, build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if vocab is not None:
        tokenizer = build_tokenizer(["1 + 2 = 3", "Tina has 43 clips"] * 50, vocab)
    model = build_model(
        tokenizer, FixtureSizes(hidden_size=128, intermediate_size=512, layers=3), seed=seed
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def chain_config(workdir: Path) -> dict:
    """The demo's models and datasets, a larger tiny model (``big``), a mixture of the
    demo's arithmetic (37 tokens a row) and GSM8K-style rows (42 to 82: ranks get unequal
    example counts), and the three runs."""
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg["models"]["big"] = {"source": "local", "path": "resources/fixtures/big-llama"}
    cfg["datasets"]["mixed"] = {
        "source": "mixture",
        "mixture": [{"dataset": "arith"}, {"dataset": "gsm8k_demo"}],
    }
    cfg["runs"] = {
        "teacher": {
            **STUDENT,
            "model": "big",
            "method": "full",
            "nodes": 1,
            "micro_batch_size": 32,
            "max_steps": 64,
            "save_steps": 64,
            "learning_rate": 2.0e-3,
        },
        "student": {**STUDENT, "method": "distill", "distill": DISTILL},
        "sft": {**STUDENT, "method": "lora"},
        "opd": OPD,
    }
    del cfg["runs"]["teacher"]["lora"]
    if ci_tier():  # every stage and figure, not learning (the module's docstring)
        del cfg["runs"]["sft"]
        cfg["runs"]["teacher"].update(max_steps=16, save_steps=16)
        cfg["runs"]["student"].update(max_steps=16)
        cfg["runs"]["opd"].update(max_steps=4, save_steps=4)
    return cfg


@pytest.fixture(scope="module")
def distill_chain(tmp_path_factory, fixtures_dir) -> Path:
    """The pipeline above, through snakemake on the local profile."""
    workdir = tmp_path_factory.mktemp("distill_chain")
    fixtures = workdir / "resources/fixtures"
    fixtures.mkdir(parents=True)
    for name in ("tiny-llama", "arith-demo", "gsm8k-demo"):
        shutil.copytree(fixtures_dir / name, fixtures / name)
    build_model(fixtures / "tiny-llama", fixtures / "big-llama")
    (workdir / "config.yaml").write_text(yaml.safe_dump(chain_config(workdir)))
    proc = snakemake("--configfile", str(workdir / "config.yaml"), "--directory", str(workdir))
    (workdir / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return workdir


def topk_of(path: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """The stored top-k by example id, read with pyarrow alone: (ids, log-probs) [targets,
    k], and k (the file's metadata)."""
    table = pq.read_table(path)
    k = int(table.schema.metadata[b"k"])
    out = {}
    for row in table.to_pylist():
        out[row["example_id"]] = (
            torch.tensor(row["ids"]).reshape(-1, k),
            torch.tensor(row["logps"]).reshape(-1, k),
        )
    return out, k


def tokenized_set(workdir: Path, eval_set: bool) -> Path:
    """The student's tokenized training rows or eval set."""
    name = "arith_test" if eval_set else "mixed"
    return next((workdir / "results/tokenized").glob(f"{name}__tiny__*/data.parquet"))


def stage_output(workdir: Path, eval_set: bool) -> Path:
    """The teacher stage's output for the student's training rows or its eval set."""
    rows = pq.ParquetFile(tokenized_set(workdir, eval_set)).metadata.num_rows
    for path in (workdir / "results/teacher_logps").glob("*/topk.parquet"):
        if pq.ParquetFile(path).metadata.num_rows == rows:
            return path
    raise AssertionError(f"no teacher_logps output of {rows} rows")


def teacher_stage(tokenized: Path, teacher: Path, out: Path, *flags: str) -> list[str]:
    """The command of the teacher stage on ``tokenized`` with ``teacher``, writing ``out``."""
    return [
        sys.executable,
        str(ROOT / "scripts/teacher_logps.py"),
        "--tokenized",
        str(tokenized),
        "--model",
        str(teacher),
        *flags,
        "--out",
        str(out),
    ]


def model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.slow
def test_the_teacher_stage_stores_the_teachers_own_log_softmax_top_k(distill_chain):
    """Every row of the tokenized training set once, in its order, k = 32 (the default);
    for rows across the stage's chunks (each worker's), the stored ids are the tuned
    teacher's k most likely next tokens at each label position and their log-probs its
    log-softmax, computed with plain transformers one example at a time (1e-5), as are the
    labels' own log-probs stored beside them."""
    w = distill_chain
    path = stage_output(w, eval_set=False)
    rows = pq.read_table(tokenized_set(w, eval_set=False)).to_pylist()
    assert len(rows) == 2048 + 512
    stored, k = topk_of(path)
    assert k == 32
    assert pq.read_table(path, columns=["example_id"]).column(0).to_pylist() == [
        r["example_id"] for r in rows
    ]
    teacher = model(w / "results/teacher/hf")
    own = dict(
        zip(
            *pq.read_table(path, columns=["example_id", "label_logps"]).to_pydict().values(),
            strict=True,
        )
    )
    for i in (0, 1, 255, 256, 257, 1000, 2559):  # chunks of 256 rows: both workers'
        r = rows[i]
        want = token_logps(teacher, r["input_ids"], r["labels"])  # the labels' own
        assert own[r["example_id"]] == pytest.approx(want, abs=1e-5)
        ids, logps = teacher_topk(teacher, r["input_ids"], r["labels"], k)
        got_ids, got = stored[r["example_id"]]
        assert got_ids.shape == ids.shape and len(ids) == sum(
            1 for t in r["labels"][1:] if t != -100
        )
        assert torch.equal(got_ids, ids)
        assert torch.allclose(got.double(), logps, atol=1e-5, rtol=0)
    assert not (path.parent / "parts").exists()
    prov = json.loads((path.parent / "provenance.json").read_text())
    assert prov["stage"] == "teacher_logps" and prov["config"]["top_k"] == 32


@pytest.mark.slow
def test_a_two_rank_distillation_step_logs_the_loss_written_out_in_plain_torch(distill_chain):
    """The student's first step (2 ranks, token-balanced packed micro batches of unequal
    example counts): its logged loss is ((1 - alpha) x the cross-entropy + alpha x T^2 x the
    forward KL from the stored top-k at T) summed over both ranks' label tokens over their
    count, written out example by example with plain torch on the base model (a LoRA
    adapter starts as the identity); its ce and kl fields the two means (1e-4)."""
    w = distill_chain
    shards = w / "results/student/shards"
    (first,) = planned_steps(shards, 1)
    assert len(first[0]) != len(first[1])  # unequal batches
    stored, _ = topk_of(stage_output(w, eval_set=False))
    base = model(w / "resources/models/tiny")
    block = json.loads((w / "results/student/train/run_config.json").read_text())["distill"]
    assert (block["alpha"], block["temperature"], block["divergence"]) == (0.5, 1.0, "forward")
    ce = kl = 0.0
    n = 0
    for r in first[0] + first[1]:
        c, d, m = distill_sums(base, r, *stored[r["example_id"]], block["temperature"])
        ce, kl, n = ce + c, kl + d, n + m
    logged = read_jsonl(w / "results/student/train/metrics.jsonl")[0]
    alpha = block["alpha"]
    assert logged["loss"] == pytest.approx(((1 - alpha) * ce + alpha * kl) / n, rel=1e-4)
    assert logged["ce"] == pytest.approx(ce / n, rel=1e-4)
    assert logged["kl"] == pytest.approx(kl / n, rel=1e-4)


@pytest.mark.extended
@pytest.mark.slow
def test_with_alpha_0_distillation_is_sft_step_for_step(distill_chain, tmp_path):
    """alpha 0 on the SFT run's own shards and start: the first step's loss and gradient
    norm are the SFT run's (the same token mean of the cross-entropy, the same gradient)."""
    w = distill_chain
    spec = pipeline_spec(w / "results/student/train", tmp_path)
    spec["distill"] = {**spec["distill"], "alpha": 0.0}
    spec.update(max_steps=1, save_steps=1)
    inputs = pipeline_inputs(w / "results/student/train")  # its teacher's top-k
    out = train(tmp_path, spec, w / "results/sft/shards", w / "resources/models/tiny", "zero2",
                *inputs)  # fmt: skip
    (got,) = read_jsonl(out / "metrics.jsonl")
    sft = read_jsonl(w / "results/sft/train/metrics.jsonl")[0]
    assert got["loss"] == pytest.approx(sft["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(sft["grad_norm"], rel=1e-5)


def heldout_kl(w: Path, exported: Path) -> float:
    """The KL from the teacher's stored top-k on the eval set to ``exported``, per label
    token, written out with plain torch."""
    stored, _ = topk_of(stage_output(w, eval_set=True))
    m, total, n = model(exported), [], 0
    for r in pq.read_table(tokenized_set(w, eval_set=True)).to_pylist():
        _, d, c = distill_sums(m, r, *stored[r["example_id"]], 1.0)
        total.append(d)
        n += c
    return math.fsum(total) / n


@pytest.mark.slow
def test_the_distilled_students_headline_is_its_kl_to_the_teacher_in_plain_torch(distill_chain):
    """On the demo task's held-out set, the student's evaluation's heldout_kl (the headline,
    with the teacher's stored top-k) is the KL written out with plain torch on the exported
    model, its teacher_loss the teacher's own held-out loss (1e-5); the terminal's end line
    gives both."""
    w = distill_chain
    metrics = json.loads((w / "results/student/eval/metrics.json").read_text())
    assert metrics["headline"][:2] == ["heldout_kl", "teacher_loss"]
    student = heldout_kl(w, w / "results/student/merged_model")
    assert metrics["heldout_kl"] == pytest.approx(student, abs=1e-5)
    eval_rows = pq.read_table(tokenized_set(w, eval_set=True)).to_pylist()
    teacher_nll, _ = mean_nll(model(w / "results/teacher/hf"), eval_rows)
    assert metrics["teacher_loss"] == pytest.approx(teacher_nll, abs=1e-5)  # beside its own
    line = (w / "snakemake.out").read_text()
    assert re.search(r"student: kl_to_teacher [0-9.]+, teacher loss [0-9.]+", line), line[-2000:]


def completion_nll(teacher, eval_rows: dict, samples: Path, tokenizer) -> float:
    """The teacher's mean NLL per token of the greedy completions in ``samples`` (each
    generation encoded again after its eval row's prompt), with plain transformers."""
    from snaketune.core.rows import prompt_and_answer

    total, count = [], 0
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        row = eval_rows[s["example_id"]]
        prompt = prompt_and_answer(row["input_ids"], row["labels"])[0]
        completion = tokenizer(s["generation"], add_special_tokens=False).input_ids
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = torch.log_softmax(teacher(input_ids=ids).logits[0].double(), -1)
        total += [-logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]
        count += len(completion)
    return math.fsum(total) / count


def opd_figures(w: Path) -> tuple[float, float, dict]:
    """The on-policy student's teacher_nll and its base's, written out, and its metrics."""
    from transformers import AutoTokenizer

    metrics = json.loads((w / "results/opd/eval/metrics.json").read_text())
    rows = {r["example_id"]: r for r in pq.read_table(tokenized_set(w, eval_set=True)).to_pylist()}
    teacher = model(w / "results/teacher/hf")
    tokenizer = AutoTokenizer.from_pretrained(w / "results/teacher/hf")
    tuned = completion_nll(teacher, rows, w / "results/opd/eval/samples.jsonl", tokenizer)
    prov = json.loads((w / "results/opd/eval/provenance.json").read_text())
    base_metrics = w / prov["inputs"]["base_metrics"]["path"]
    base = completion_nll(teacher, rows, base_metrics.with_name("samples.jsonl"), tokenizer)
    return tuned, base, metrics


@pytest.mark.slow
def test_the_on_policy_student_reaches_evaluation_with_its_teachers_nll_of_its_completions(
    distill_chain,
):
    """Run ``opd`` (2 nodes, the teacher run's final model held live) trains and reaches its
    evaluation; its headline leads with teacher_nll, the teacher's mean NLL of the student's
    own greedy completions of the held-out prompts, and the base student's beside it, both
    written out with plain transformers (1e-4); each step logged its figures."""
    w = distill_chain
    tuned, base, metrics = opd_figures(w)
    assert metrics["headline"][0] == "teacher_nll"
    assert metrics["figures"]["teacher_nll"]["value"] == pytest.approx(tuned, rel=1e-4)
    assert metrics["figures"]["teacher_nll"]["base"] == pytest.approx(base, rel=1e-4)
    steps = read_jsonl(w / "results/opd/train/metrics.jsonl")
    assert steps and all(
        {"divergence", "teacher_nll", "completion_length", "on_policy"} <= set(s) for s in steps
    )
    job = json.loads((w / "results/opd/train/job.json").read_text())
    assert job["inputs"]["teacher"] == "results/teacher/hf"


@pytest.mark.extended
@pytest.mark.slow
def test_the_on_policy_student_writes_what_its_teacher_finds_likelier_than_the_base(
    distill_chain,
):
    """After 24 on-policy steps the teacher's NLL of the student's greedy completions of the
    held-out prompts is below the base student's, measured with plain transformers."""
    tuned, base, _ = opd_figures(distill_chain)
    assert tuned < base, (tuned, base)
    print(
        f"the teacher's NLL of greedy completions: on-policy student {tuned:.4f}, base {base:.4f}"
    )


@pytest.mark.extended
@pytest.mark.slow
def test_the_distilled_student_is_closer_to_its_teacher_than_sft_alone(distill_chain):
    """On the demo task's held-out set, the student distilled from the tuned teacher has a
    lower KL to the teacher than the same student tuned by SFT alone on the same data and
    steps (the run ``sft``, at the documented lengths)."""
    w = distill_chain
    student = heldout_kl(w, w / "results/student/merged_model")
    sft = heldout_kl(w, w / "results/sft/merged_model")
    assert student < sft, (student, sft)
    print(f"held-out KL to the teacher: distilled {student:.4f}, SFT alone {sft:.4f}")


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(
    distill_chain, tmp_path, monkeypatch
):
    """A teacher whose vocabulary is not the student's: the config's check names the key
    and the fix before any job (the models are on this machine), and the teacher stage
    refuses too (a teacher downloaded later), in one line, writing nothing."""
    w = distill_chain
    other = build_model(w / "resources/fixtures/tiny-llama", tmp_path / "other", vocab=600)
    cfg = chain_config(w)
    cfg["models"]["other"] = {"source": "local", "path": str(other)}
    cfg["runs"]["student"]["distill"] = {"teacher": "other"}
    monkeypatch.chdir(w)  # where snakemake reads the config: its --directory
    with pytest.raises(ConfigError) as exc:
        validate_config(cfg, ROOT)
    line = str(exc.value)
    assert "\n" not in line and "runs.student.distill.teacher" in line, line
    assert "is not the student's" in line and "choose a teacher" in line, line
    out = tmp_path / "topk/topk.parquet"
    proc = subprocess.run(
        teacher_stage(
            tokenized_set(w, eval_set=True),
            other,
            out,
            "--student-model",
            str(w / "resources/models/tiny"),
        ),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if "tokenizer" in x]
    assert len(errors) == 1 and "is not the student's" in errors[0], proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_teacher_worker_takes_the_stage_down_and_a_rerun_computes_the_rest(
    distill_chain, tmp_path
):
    """The teacher stage's 2 workers: one SIGKILLed before it publishes its third part takes
    the other down (no orphan, no output, the parts written kept); the rerun computes only
    the missing parts, and its top-k is the uninterrupted stage's, bit for bit."""
    import psutil

    w = distill_chain
    tokenized = tokenized_set(w, eval_set=False)
    out = tmp_path / "topk/topk.parquet"
    cmd = teacher_stage(
        tokenized,
        w / "results/teacher/hf",
        out,
        "--nodes",
        "2",
        "--batch-rows",
        "16",
        "--precision",
        "auto",
        "--chunk-rows",
        "256",
    )
    killed = subprocess.run(
        cmd,
        env={**ENV, "SNAKETUNE_KILL_BEFORE_PUBLISH": "part-000005"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = killed.stdout + killed.stderr
    assert killed.returncode != 0 and "stopping the others" in log, log[-3000:]
    assert not out.exists()
    left = [
        p for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, [p.info["cmdline"] for p in left]
    kept = sorted(int(p.stem.split("-")[1]) for p in (out.parent / "parts").glob("part-*"))
    assert 1 in kept and 3 in kept and 5 not in kept, kept
    rerun = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    log = rerun.stdout + rerun.stderr
    assert rerun.returncode == 0, log[-3000:]
    computed = [int(n) for n in re.findall(r"worker 0: (\d+) chunks computed", log)]
    assert computed == [5 - sum(k % 2 == 0 for k in kept)], (kept, log[-3000:])  # 10 chunks
    assert pq.read_table(out).equals(pq.read_table(stage_output(w, eval_set=False)))


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_student_resumes_exactly(distill_chain, tmp_path):
    """The student's training from its step-16 checkpoint, killed two steps on and rerun:
    it resumes there and every step's loss, ce and kl are the uninterrupted run's."""
    w = distill_chain
    spec = pipeline_spec(w / "results/student/train", tmp_path)
    start, resumed = kill_and_resume(
        w / "results/student/train",
        tmp_path,
        spec,
        w / "results/student/shards",
        w / "resources/models/tiny",
    )
    assert start == 16
    uninterrupted = read_jsonl(w / "results/student/train/metrics.jsonl")
    for a, b in zip(resumed, uninterrupted, strict=True):
        for key in ("loss", "ce", "kl", "grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("layout", ["padded", "varlen", "rows"])
def test_the_collator_puts_each_teachers_top_k_beside_its_target(layout):
    """Rows of unequal lengths collated in each layout: the teacher values beside each
    target (labels[..., 1:] != -100, row by row) are that example's for that token (here
    each stored id is the token itself and each log-prob names the example)."""
    from snaketune.methods.distill import teacher_collator

    rows, teacher = [], {}
    for e, n in enumerate((7, 3, 12, 5, 9)):
        ids = [10 + e * 20 + t for t in range(n)]
        labels = [-100] * 2 + ids[2:]
        rows.append({"example_id": f"e{e}", "input_ids": ids, "labels": labels})
        targets = [t for t in range(1, n) if labels[t] != -100]
        teacher[f"e{e}"] = (
            np.array([[ids[t], 0] for t in targets]),
            np.full((len(targets), 2), float(e), dtype=np.float32),
        )
    batch = teacher_collator(layout, 0, 16, None, teacher)(rows)
    shifted = batch["labels"][..., 1:]
    keep = shifted != -100
    assert torch.equal(batch["teacher_ids"][:, 0], shifted[keep])
    owner = (shifted[keep] - 10) // 20
    assert torch.equal(batch["teacher_logps"][:, 0].long(), owner)


@pytest.mark.parametrize("kind", ["forward", "reverse", "mixed"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_each_divergence_is_the_papers(kind, temperature):
    """snaketune.evaluation.topk.divergence on random logits and a random teacher top-k
    equals the divergence written out token by token in float64 (oracles.distill_sums'
    formula: Hinton et al.'s softened distributions, times T^2 there)."""
    from snaketune.evaluation.topk import divergence

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    teacher = torch.log_softmax(torch.randn(6, 50, generator=g) * 3, dim=-1).topk(8)
    got = divergence(logits, teacher.indices, teacher.values, temperature, kind, 0.3)

    class Fixed(torch.nn.Module):  # a "model" whose logits are the ones above
        def forward(self, input_ids):
            return type("Out", (), {"logits": logits[None].double()})()

    row = {"input_ids": list(range(7)), "labels": [-100] + [0] * 6}
    for j in range(6):
        one = {"input_ids": row["input_ids"], "labels": [-100] * 7}
        one["labels"][j + 1] = 0
        _, want, _ = distill_sums(
            Fixed(),
            one,
            teacher.indices[j : j + 1],
            teacher.values[j : j + 1],
            temperature,
            kind,
            0.3,
        )
        assert got[j].item() * temperature**2 == pytest.approx(want, abs=1e-5)


@pytest.mark.extended
@pytest.mark.slow
def test_a_teacher_larger_than_one_gpu_is_sharded_and_stores_the_same_top_k(
    distill_chain, tmp_path
):
    """The teacher stage with the teacher's weights sharded over its 2 workers (ZeRO-3, as
    the evaluation shards a model larger than one GPU), on chunks that give the workers
    unequal forward passes (the short one runs passes that keep nothing): the same ids and
    log-probs as the stage with a whole teacher per worker (1e-5)."""
    w = distill_chain
    tokenized = tokenized_set(w, eval_set=True)
    out = tmp_path / "topk/topk.parquet"
    proc = subprocess.run(
        teacher_stage(
            tokenized,
            w / "results/teacher/hf",
            out,
            "--nodes",
            "2",
            "--batch-rows",
            "8",
            "--chunk-rows",
            "20",
            "--sharded",
            "1",
        ),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    got, k = topk_of(out)
    want, _ = topk_of(stage_output(w, eval_set=True))
    assert k == 32 and list(got) == list(want)
    for name, (ids, logps) in want.items():
        assert torch.equal(got[name][0], ids)
        assert torch.allclose(got[name][1], logps, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_plans_count_the_teacher_stage(distill_chain):
    """The teacher stage in the plans: on GPUs too small for the whole teacher it is
    sharded over the run's GPUs (and the rule's resource says so); its disk is (8k + 4)
    bytes per token of the tokenized sets (at most: every token); its time is a forward
    pass of the teacher's size over those tokens."""
    from snaketune.budget.diskplan import disk_plan_of
    from snaketune.budget.scoring import teacher_seconds
    from snaketune.budget.teacherplan import memory_plan, sharded, tokens

    w = distill_chain
    config = validate_config(yaml.safe_load((w / "config.yaml").read_text()), ROOT)
    run = config["runs"]["student"]
    whole = memory_plan(config, run, None, w)
    assert whole["sharded"] is False and whole["fits"] is None
    small = whole["per_gpu_gib"] - 0.001
    tight = memory_plan(config, run, small, w)
    assert tight["sharded"] is True and tight["per_gpu_gib"] <= whole["per_gpu_gib"]
    assert "sharded over 2 GPUs" in tight["why"]
    assert not sharded(config, run, w)  # no `gpu`: a CPU run, never sharded
    assert sharded(config, {**run, "gpu": small}, w)
    counted = tokens(config, "student", w)
    lengths = sum(
        pq.read_table(tokenized_set(w, e), columns=["length"]).column(0).to_numpy().sum()
        for e in (False, True)
    )
    assert counted == lengths
    disk = disk_plan_of(config, "student", w, ROOT)
    assert disk["need_bytes"]["teacher_logps"] == round(lengths * (32 * 8 + 4))
    cost = teacher_seconds(config, "student", w, 989.0)
    assert cost["gpus"] == 2 and cost["s"] > 0 and f"{lengths:,.0f} tokens" in cost["basis"]
