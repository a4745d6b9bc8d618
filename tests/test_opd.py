"""On-policy distillation (method: opd): TRL's DistillationTrainer on the planned prompts, the
student sampling each completion, a live teacher scoring every token of it on the same ranks.

The per-step oracle: a 2-node run over prompts of unequal length (``opd_run``), each rank
logging its completions; the first step's logged divergence (the reverse KL, the schema's
default, and a JSD) and the teacher's NLL of the completions equal the paper's per-token
divergence and the NLL written out with plain torch on plain transformers' logits of the
same tokens under the base student and the teacher. The pipeline (a tuned teacher, the
on-policy student to its evaluation, the teacher's NLL of the student's greedy completions)
is tests/test_distill.py's chain.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ENV, ROOT, defaults_spec, kill_two_steps_on, launch_train, read_jsonl
from oracles import planned_steps
from test_distill import build_model
from test_tokenize import run_tokenize

from snaketune.core.errors import ConfigError
from snaketune.methods.opd import on_policy, token_nll
from snaketune.plan.config import load_yaml

STEPS = 2


def opd_spec(**block) -> dict:
    """A LoRA opd run as a user's config writes it (the schema's defaults) with what these
    tests need: short completions, two micro batches a step, no adapter dropout, fp32."""
    spec = defaults_spec("opd", lora={"dropout": 0.0}, max_steps=STEPS,
                         opd={"teacher": "m", "max_completion_length": 8, **block})  # fmt: skip
    spec.update(gradient_accumulation_steps=2, save_steps=STEPS, learning_rate=1e-2,
                precision="fp32", micro_batch_size=2)  # fmt: skip
    spec.pop("eval", None)
    return spec


def test_the_opd_block_s_defaults_and_its_teacher_check():
    spec = defaults_spec("opd", opd={"teacher": "m"})
    assert spec["opd"] == {"teacher": "m", "beta": 1.0, "lmbda": 1.0,
                           "max_completion_length": 256, "temperature": 1.0}  # fmt: skip
    with pytest.raises(ConfigError, match=r"runs\.x\.opd\.teacher: 'nobody' is neither a model "
                                          "nor a run of the config"):  # fmt: skip
        defaults_spec("opd", opd={"teacher": "nobody"})
    with pytest.raises(ConfigError, match=r"runs\.x\.opd: missing required key 'teacher'"):
        defaults_spec("opd", opd={})


def test_a_reward_model_cannot_teach():
    from snaketune.plan.config import validate_config

    config = {
        "models": {"m": {"source": "local", "path": "resources/models/m"}},
        "datasets": {"d": {"source": "local", "path": "d.jsonl", "format": "prompt_response"},
                     "p": {"source": "local", "path": "p.jsonl", "format": "preference"}},
        "runs": {"rm": {"model": "m", "dataset": "p", "method": "reward", "epochs": 1,
                        "nodes": 1, "gpus_per_node": 1, "max_length": 64,
                        "micro_batch_size": 2, "learning_rate": 1e-3},
                 "x": {"model": "m", "dataset": "d", "method": "opd", "epochs": 1,
                       "opd": {"teacher": "rm"}, "nodes": 1, "gpus_per_node": 1,
                       "max_length": 64, "micro_batch_size": 2, "learning_rate": 1e-3}},
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"runs\.x\.opd\.teacher: run rm trains a reward model"):
        validate_config(config, ROOT)


def test_a_step_is_on_policy_by_a_draw_of_the_step_alone():
    """Every rank draws the same for a step (the draw is the seed's and the step's); over
    many steps the share is lmbda; lmbda 1 is always, 0 never."""
    assert all(on_policy(3, s, 1.0) for s in range(1, 200))
    assert not any(on_policy(3, s, 0.0) for s in range(1, 200))
    draws = [on_policy(3, s, 0.3) for s in range(1, 4001)]
    assert draws == [on_policy(3, s, 0.3) for s in range(1, 4001)]
    assert abs(sum(draws) / len(draws) - 0.3) < 0.03
    assert draws != [on_policy(4, s, 0.3) for s in range(1, 4001)]  # the seed decides


def test_token_nll_is_the_masked_cross_entropy():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    total, count = token_nll(logits, targets, mask)
    want = [
        -torch.log_softmax(logits[b, t].double(), -1)[targets[b, t]].item()
        for b in range(3)
        for t in range(5)
        if mask[b, t]
    ]
    assert int(count) == 9 and float(total) == pytest.approx(math.fsum(want), rel=1e-6)


def divergence_sums(student, teacher, prompt, completion, beta, temperature=1.0):
    """(summed divergence, summed teacher NLL, tokens) of one completion, written out: at
    each completion token the student's and the teacher's next-token distributions over the
    whole vocabulary (plain transformers' logits at ``temperature``); beta 1 the reverse
    KL(student || teacher), 0 the forward KL(teacher || student), between them the
    generalized JSD with the mixture m = beta p_t + (1 - beta) p_s:
    beta KL(t || m) + (1 - beta) KL(s || m). The NLL at temperature 1."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        s_logits = student(input_ids=ids).logits[0].double()
        t_logits = teacher(input_ids=ids).logits[0].double()
    at = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
    s = torch.log_softmax(s_logits[at] / temperature, -1)
    t = torch.log_softmax(t_logits[at] / temperature, -1)
    if beta == 1.0:
        div = (s.exp() * (s - t)).sum(-1)
    elif beta == 0.0:
        div = (t.exp() * (t - s)).sum(-1)
    else:
        m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), 0)
        div = beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    nll = -torch.log_softmax(t_logits[at], -1).gather(-1, torch.tensor(completion)[:, None])
    return div.sum().item(), nll.sum().item(), len(completion)


@pytest.fixture(scope="module")
def opd_prompts(tmp_path_factory, tiny_model, fixtures_dir):
    """The demo's GSM8K-style questions (their lengths differ: 42 to 82 tokens) tokenized
    and planned for 2 nodes x 1 device, 2 prompts a micro batch, 2 micro batches a step; a
    teacher: a larger tiny Llama with the student's tokenizer."""
    work = tmp_path_factory.mktemp("opd_prompts")
    spec = load_yaml(ROOT / "config/config.yaml")["datasets"]["gsm8k_demo"]
    spec = {k: v for k, v in spec.items() if k not in ("source", "path")}
    run_tokenize(work / "resources/datasets", "gsm8k_demo", spec,
                 fixtures_dir / "gsm8k-demo/train.jsonl", tiny_model, max_length=256)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(work / "resources/datasets/gsm8k_demo.tok.parquet"), "--nodes", "2",
                    "--gpus-per-node", "1", "--micro-batch-size", "2",
                    "--gradient-accumulation-steps", "2", "--seed", "5", "--no-packing", "--out",
                    str(work / "shards")], check=True, env=ENV, capture_output=True)  # fmt: skip
    build_model(tiny_model, work / "teacher", seed=7)
    return work


def rollouts_of(ids, ranks: int) -> dict[int, list[dict]]:
    import json

    out: dict[int, list[dict]] = {}
    for q in range(ranks):
        for line in (ids / f"rank-{q}.rollouts.jsonl").read_text().splitlines():
            record = json.loads(line)
            out.setdefault(record["step"], []).append(record)
    return out


def first_step_against_plain_torch(
    workdir, prompts, tiny_model, beta: float, preset: str, lmbda: float = 1.0
):
    """Train the opd spec with ``beta`` (and ``lmbda``) under DeepSpeed ``preset`` on 2
    ranks, each logging its rows and completions; check each rank trained its planned
    prompts, and the first step's figures against plain transformers' logits of the logged
    completions (the test below says what)."""
    from transformers import AutoModelForCausalLM

    (workdir / "resources").symlink_to(prompts / "resources")
    spec = {**opd_spec(beta=beta, lmbda=lmbda), "deepspeed": preset}
    # each rank's rows of a step in the order of its micro batches
    plan = [[sorted(rows, key=lambda r: r["micro"]) for rows in step]
            for step in planned_steps(prompts / "shards", STEPS)]  # fmt: skip
    assert len({len(r["input_ids"]) for rows in plan[0] for r in rows}) > 1  # unequal prompts
    proc = launch_train(workdir, spec, prompts / "shards", tiny_model, preset,
                        "--log-example-ids", str(workdir / "ids"),
                        "--stage-input", f"teacher={prompts / 'teacher'}")  # fmt: skip
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    metrics = read_jsonl(workdir / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for q in range(2):
        trained = (workdir / "ids" / f"rank-{q}.txt").read_text().split()
        assert trained == [r["example_id"] for step in plan for r in step[q]]
    first = rollouts_of(workdir / "ids", 2)[1]
    assert len(first) == 2  # a record a rank: both its micro batches, generated at once
    student = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(prompts / "teacher", dtype=torch.float32)
    div = nll = 0.0
    tokens = completions = 0
    for record in first:
        for prompt, completion in zip(record["prompt_ids"], record["completion_ids"], strict=True):
            d, n, c = divergence_sums(student, teacher.eval(), prompt, completion, beta)
            div, nll, tokens, completions = div + d, nll + n, tokens + c, completions + 1
    logged = metrics[0]
    assert completions == 8 and tokens > 0
    assert logged["divergence"] == pytest.approx(div / tokens, rel=1e-4)
    assert logged["teacher_nll"] == pytest.approx(nll / tokens, rel=1e-4)
    assert logged["completion_length"] == pytest.approx(tokens / completions)
    assert [m["on_policy"] for m in metrics] == [float(lmbda)] * STEPS  # lmbda 1 or 0 here
    off = abs(logged["divergence"] * tokens / div - 1)
    print(f"beta {beta}, {preset}: divergence off by {off:.1e}, teacher_nll by "
          f"{abs(logged['teacher_nll'] * tokens / nll - 1):.1e} (relative)")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_a_two_rank_opd_step_logs_the_divergence_written_out_in_plain_torch(
    beta, opd_prompts, tiny_model, tmp_path
):
    """2 ranks (ZeRO-2), prompts of unequal length, 2 micro batches a step: the first step's
    ``divergence`` is the per-token divergence (reverse KL at beta 1, the default; the JSD
    at 0.5) summed over every completion token both ranks sampled in the step and divided
    by their count, written out on the base student (a LoRA adapter starts as the identity)
    and the teacher with plain transformers (1e-4); ``teacher_nll`` the teacher's mean NLL
    of those tokens; ``completion_length`` their mean length; every step on-policy."""
    first_step_against_plain_torch(tmp_path, opd_prompts, tiny_model, beta, "zero2")


@pytest.mark.extended
@pytest.mark.slow
def test_under_zero3_the_teacher_sharded_with_the_student_gives_the_same_figures(
    opd_prompts, tiny_model, tmp_path
):
    """Under ZeRO-3 DeepSpeed shards the teacher over the ranks as it does the student (a
    teacher larger than one GPU); the first step's figures are still plain torch's on the
    whole models."""
    first_step_against_plain_torch(tmp_path, opd_prompts, tiny_model, 1.0, "zero3")


def test_an_adapter_on_the_output_head_is_refused_in_one_line():
    """TRL's divergence reads the heads' weights directly: an adapter on lm_head (or the head
    trained whole beside the adapter) would never train; refused before any job."""
    for key in ("modules_to_save", "target_modules"):
        with pytest.raises(ConfigError, match=rf"runs\.x\.lora\.{key}: lm_head trained in "):
            defaults_spec("opd", opd={"teacher": "m"}, lora={key: ["lm_head", "q_proj"]})


def test_the_plans_hold_the_live_teacher_s_weights_from_its_config(tmp_path, tiny_model):
    """The run's need of a live teacher (snaketune.budget.scoring): the teacher's weights
    from its config.json (a model of the config, or a teacher run's model), in the Setup's
    teacher_params; the train job reads its folder as the need's input."""
    from transformers import AutoModelForCausalLM

    from snaketune.budget.scoring import held_params
    from snaketune.plan import trainjob
    from snaketune.plan.config import validate_config

    teacher = build_model(tiny_model, tmp_path / "resources/models/big", seed=3)
    params = AutoModelForCausalLM.from_pretrained(teacher).num_parameters()
    run = {"model": "big", "dataset": "d", "epochs": 1, "nodes": 2, "gpus_per_node": 1,
           "max_length": 64, "micro_batch_size": 2, "learning_rate": 1e-3}  # fmt: skip
    config = validate_config({
        "models": {"big": {"source": "local", "path": str(teacher)},
                   "small": {"source": "local", "path": str(tiny_model)}},
        "datasets": {"d": {"source": "local", "path": "d.jsonl", "format": "prompt_response"}},
        "runs": {"t": {**run, "method": "full"},
                 "x": {**run, "model": "small", "method": "opd", "opd": {"teacher": "t"}},
                 "y": {**run, "model": "small", "method": "opd", "opd": {"teacher": "big"}}},
    }, ROOT)  # fmt: skip
    for name in ("x", "y"):
        assert held_params(config, config["runs"][name], tmp_path) == {"teacher_params": params}
    assert held_params(config, config["runs"]["t"], tmp_path) == {}
    assert trainjob.train_extras(config, "x")["teacher"] == "results/t/hf"
    assert trainjob.train_extras(config, "y")["teacher"] == "resources/models/big"


def test_a_hub_teacher_is_planned_before_its_download(tmp_path, capsys, monkeypatch):
    """The example's plan before any download, from config.json files named on the command
    line (as a user plans before queueing): the student's GPUs hold the teacher run's 8B
    model, its bf16 bytes counted by hand; it was left out (0 GiB) until the teacher was
    downloaded, so the check before queueing passed a run its GPUs could not hold."""
    import json

    from test_cost import LLAMA_8B, llama_params

    from snaketune.app.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("snaketune.budget.diskplan.free_bytes", lambda path: 2**50)
    small = {**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64,
             "num_hidden_layers": 16, "tie_word_embeddings": True}  # fmt: skip
    for folder, fields in (("big", LLAMA_8B), ("small", small)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(fields))
    example = ROOT / "config/examples/llama3.2-1b-opd-from-8b-gsm8k-2x4.yaml"
    code = main(["plan", str(example), "--root", str(ROOT), "--json",
                 "--model-config", f"llama31_8b_instruct={tmp_path / 'big'}",
                 "--model-config", f"llama32_1b_instruct={tmp_path / 'small'}"])  # fmt: skip
    plans = {p["run"]: p for p in json.loads(capsys.readouterr().out)}
    assert code == 0
    teacher_gib = llama_params(LLAMA_8B) * 2 / 2**30
    assert plans["gsm8k_student"]["per_gpu_gib"]["teacher"] == pytest.approx(teacher_gib, abs=0.01)
    assert "teacher" not in plans["gsm8k_teacher"]["per_gpu_gib"]


@pytest.mark.extended
@pytest.mark.slow
def test_with_lmbda_0_every_step_trains_on_the_dataset_s_responses(
    opd_prompts, tiny_model, tmp_path
):
    """lmbda 0: no step samples; each step's completions are the dataset's responses (the
    logged completions are the rows' labelled tokens), and the figures are plain torch's
    divergence and teacher NLL on them."""
    import pyarrow.parquet as pq

    first_step_against_plain_torch(tmp_path, opd_prompts, tiny_model, 1.0, "zero2", 0.0)
    rows = pq.read_table(opd_prompts / "resources/datasets/gsm8k_demo.tok.parquet").to_pylist()
    answers = {r["example_id"]: [t for t in r["labels"] if t != -100] for r in rows}
    for record in rollouts_of(tmp_path / "ids", 2)[1]:
        for i, completion in zip(record["example_ids"], record["completion_ids"], strict=True):
            assert completion == answers[i]


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_opd_run_resumes_exactly(opd_prompts, tiny_model, tmp_path):
    """The 2-node opd run of 6 steps, lmbda 0.5 (steps on and off policy, each drawn from
    the seed and the step), a checkpoint a step, against itself resumed: from its
    checkpoint-3, the launcher killed two steps on (no orphan worker), then rerun. Each step
    is logged once; steps 4 to 6 sample the same completions with the same teacher and have
    the uninterrupted run's figures, their on- or off-policy draw among them."""
    steps, start = 6, 3
    spec = {**opd_spec(lmbda=0.5), "deepspeed": "zero2"}
    spec.update(max_steps=steps, save_steps=1, save_total_limit=steps,
                checkpoints={**spec["checkpoints"], "optimizer": "all"})  # fmt: skip
    teacher = ("--stage-input", f"teacher={opd_prompts / 'teacher'}")
    shards = opd_prompts / "shards"

    def launch(w, *extra):
        return launch_train(w, spec, shards, tiny_model, "zero2", *teacher, *extra)

    a, b = tmp_path / "a", tmp_path / "b"
    for w in (a, b):
        w.mkdir()
        (w / "resources").symlink_to(opd_prompts / "resources")
    out, _ = launch(a, "--log-example-ids", str(a / "ids")).communicate(timeout=900)
    metrics = read_jsonl(a / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), out[-3000:]
    assert {m["on_policy"] for m in metrics} == {0.0, 1.0}  # both kinds of step drawn
    shutil.copytree(a / "results/x/train/checkpoints", b / "results/x/train/checkpoints")
    for k in range(start + 1, steps + 1):
        shutil.rmtree(b / f"results/x/train/checkpoints/checkpoint-{k}")
    live = b / "results/x/train/checkpoints/metrics.jsonl"
    reached = kill_two_steps_on(launch(b), live, start, steps)  # no orphan worker
    first = (b / "results/x/train/logs/attempt-1.log").read_text()
    assert f"resuming from checkpoint-{start}" in first and reached, first[-3000:]
    out, _ = launch(b, "--log-example-ids", str(b / "ids")).communicate(timeout=900)
    assert "resuming from checkpoint-" in out, out[-3000:]
    resumed = read_jsonl(b / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in resumed] == list(range(1, steps + 1))  # each step once
    for got, want in zip(resumed, metrics, strict=True):
        for key in ("loss", "grad_norm", "divergence", "teacher_nll", "completion_length",
                    "on_policy"):  # fmt: skip
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (got["step"], key)
    before, again = rollouts_of(a / "ids", 2), rollouts_of(b / "ids", 2)
    assert min(again) > start  # the rerun resumed past step 3
    for k, ranks in again.items():
        assert [r["completion_ids"] for r in ranks] == [r["completion_ids"] for r in before[k]]
