"""Models larger than one GPU at evaluation: the evaluate stage with its weights sharded over
several processes (ZeRO-3, snaketune.evaluation.sharded) and the held-out pass while
training generating on a sharded model, each against one process; and the layout the plan
decides for the evaluate stages (snaketune.budget.stageplan)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ENV, ROOT

from snaketune.budget.evalplan import eval_gib, eval_layout
from snaketune.budget.memplan import Shape
from snaketune.evaluation.sharded import Share

# Llama-3.1-70B's config.json (the fields the plan reads)
LLAMA_70B = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512}  # fmt: skip


def a_run(nodes=1, gpus_per_node=8, ev: dict | None = None) -> dict:
    return {"method": "lora", "nodes": nodes, "gpus_per_node": gpus_per_node, "max_length": 2048,
            "eval": {"batch_size": 8, "max_new_tokens": 256, "nodes": "auto",
                     "gpus_per_node": "auto", **(ev or {})}}  # fmt: skip


def test_a_model_that_fits_one_gpu_is_evaluated_on_one():
    layout = eval_layout(a_run(), Shape.from_config(TINY), 79.6)
    assert (layout.nodes, layout.gpus_per_node) == (1, 1), layout


def test_a_70b_is_evaluated_on_the_fewest_gpus_of_a_node_that_hold_it():
    """bf16 70B: 131.4 GiB of weights; a batch of 8 at 2048 + 256 tokens adds the larger of
    its loss pass's logits (11.7 GiB: bf16 and their fp32 copy) and its generation's KV
    cache (5.6 GiB). On 80 GB GPUs it needs 3 (64.8 GiB each; 2 would need 88.9); on 40 GB
    GPUs 7 (37.2); on 2-GPU nodes of 40 GB the run's other nodes join (4 of them)."""
    shape = Shape.from_config(LLAMA_70B)
    assert shape.params * 2 / 2**30 == pytest.approx(131.4, abs=0.1)
    need = {n: eval_gib(shape, n, 8, 2048, 256)["total"] for n in (1, 2, 3, 6, 7, 8)}
    assert need == {1: 158.97, 2: 88.85, 3: 64.76, 6: 40.66, 7: 37.22, 8: 34.64}
    h100 = eval_layout(a_run(nodes=2), shape, 79.6)
    assert (h100.nodes, h100.gpus_per_node, h100.per_gpu_gib) == (1, 3, 64.76), h100
    a100 = eval_layout(a_run(nodes=2), shape, 39.4)
    assert (a100.nodes, a100.gpus_per_node, a100.per_gpu_gib) == (1, 7, 37.22), a100
    small = eval_layout(a_run(nodes=4, gpus_per_node=2), shape, 39.4)
    assert (small.nodes, small.gpus_per_node) == (4, 2), small  # 8 GPUs: 4 nodes of 2
    # nothing holds it: the largest layout, and the plan says so
    none = eval_layout(a_run(nodes=1, gpus_per_node=2), shape, 39.4)
    assert (none.nodes, none.gpus_per_node) == (1, 2) and "no layout" in none.why


def test_a_layout_set_by_hand_is_kept_and_auto_without_a_gpu_is_one():
    shape = Shape.from_config(LLAMA_70B)
    fixed = eval_layout(a_run(2, 4, {"nodes": 1, "gpus_per_node": 3}), shape, 79.6)
    assert (fixed.nodes, fixed.gpus_per_node) == (1, 3)
    unknown = eval_layout(a_run(), shape, None)
    assert (unknown.nodes, unknown.gpus_per_node) == (1, 1) and "no `gpu`" in unknown.why


def test_every_rank_share_joins_back_in_the_eval_sets_order():
    rows = list(range(11))  # 11 examples over 3 ranks: 4, 4 and 3
    shares = [Share(r, 3).mine(rows) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 3]
    assert sorted(x for s in shares for x in s) == rows
    assert {Share(r, 3).batches(len(rows), 2) for r in range(3)} == {2}
    assert Share(0, 3).join(shares) == rows  # what rank 0 makes of the gathered shares
    assert Share().in_order(rows) == rows  # one process: nothing gathered


def evaluate_command(demo: Path, out: Path, gpus: int) -> list[str]:
    """The demo's evaluate job's command line (as the rule wrote it to its log's shell
    command: the same settings), with ``gpus`` processes and another output folder."""
    from snaketune.evaluation.settings import eval_args
    from snaketune.plan.config import load_yaml, validate_config

    config = validate_config(load_yaml(ROOT / "config/config.yaml"), ROOT)
    settings = config["runs"]["demo"]["eval"]
    tokenized = {
        p.parent.name.split("__")[0]: p for p in (demo / "results/tokenized").glob("*/data.parquet")
    }
    return [sys.executable, str(ROOT / "scripts/evaluate.py"),
            "--model", str(demo / "results/demo/merged_model"), "--eval", str(tokenized["arith_test"]),
            "--train", str(tokenized["arith"]),
            "--base-metrics", str(next((demo / "results/base_eval").glob("*/metrics.json"))),
            "--out", str(out), *shlex.split(eval_args(settings)),
            "--nodes", "1", "--gpus-per-node", str(gpus)]  # fmt: skip


@pytest.mark.slow
def test_the_demo_evaluated_on_two_gpus_equals_one(demo, tmp_path):
    """The evaluate stage on 2 emulated GPUs (the weights sharded over 2 processes, the 64
    examples dealt out 32 and 32) against the demo's own evaluation on one: every greedy
    generation, exact match, math_verify, the lm-eval figures and (summed over ranks in
    another order) the held-out loss."""
    out = tmp_path / "eval"
    proc = subprocess.run(evaluate_command(demo, out, 2), cwd=demo, env=ENV,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    one = json.loads((demo / "results/demo/eval/metrics.json").read_text())
    two = json.loads((out / "metrics.json").read_text())
    assert two["processes"] == 2 and two["examples"] == one["examples"] == 64
    for key in ("exact_match", "math_verify", "stop_rate", "response_tokens"):
        assert two[key] == one[key], key
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["lm_eval"] == one["lm_eval"]
    lines = [(out / "samples.jsonl"), (demo / "results/demo/eval/samples.jsonl")]
    mine, theirs = ([json.loads(x) for x in p.read_text().splitlines()] for p in lines)
    assert [s["example_id"] for s in mine] == [s["example_id"] for s in theirs]
    assert [s["generation"] for s in mine] == [s["generation"] for s in theirs]
    assert not (tmp_path / "eval.workers").exists()  # the workers' heartbeats cleaned up
    assert "launching 1 node(s) x 2 process(es)" in proc.stdout + proc.stderr


HELDOUT = r"""
import json, os, sys
from pathlib import Path
import torch
from snaketune.core.rows import pad_id
from snaketune.evaluation.heldout_pass import HeldOut
from snaketune.evaluation.sharded import is_sharded, load_sharded
model_dir, eval_path, out = sys.argv[1:4]
tokenizer, model, keep = load_sharded(Path(model_dir), torch.float32)
assert is_sharded(model)
whole = sum(p.ds_numel for p in model.parameters())
held = sum(p.numel() for p in model.parameters())
spec = {"path": eval_path, "limit": None, "metric": "exact_match", "batch_size": 24,
        "max_new_tokens": 16, "answers": True}
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
figures = HeldOut(spec, 42, rank, world, tokenizer).run(model, synced=True)
if rank == 0:
    Path(out).write_text(json.dumps({**figures, "whole": whole, "held": held}))
"""


@pytest.mark.extended
@pytest.mark.slow
def test_the_heldout_pass_on_a_sharded_model_equals_the_unsharded_figure(demo, tmp_path):
    """The pass while training on a model ZeRO-3 shards over 2 ranks, generating on the
    shards (no rank ever holds the whole model: each holds half the weights), against the
    evaluate stage's figures of the same model on one process. 64 examples in batches of
    24: each rank runs 2 batches, one of them short."""
    script = tmp_path / "heldout.py"
    script.write_text(HELDOUT)
    eval_path = next((demo / "results/tokenized").glob("arith_test__*/data.parquet"))
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(script), str(demo / "results/demo/merged_model"), str(eval_path), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env={**ENV, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    got = json.loads(out.read_text())
    one = json.loads((demo / "results/demo/eval/metrics.json").read_text())
    assert got["held"] <= got["whole"] / 2 + 1024, got  # a shard, not the model
    assert got["examples"] == 64
    assert got["exact_match"] == one["exact_match"] and got["math_verify"] == one["math_verify"]
    assert got["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert got["response_tokens"] == one["response_tokens"]


EXAMPLE = ROOT / "config/examples/llama3.1-70b-qlora-1x8.yaml"


def test_the_70b_example_dry_run_gives_each_evaluate_job_the_gpus_it_needs(tmp_path):
    """config/examples/llama3.1-70b-qlora-1x8.yaml's dry run as its header gives it (the
    8-GPU-node template profiles/slurm), against a stand-in SLURM, with the model's
    config.json where the download puts it: the train job asks 8 GPUs of one node;
    evaluate_base (the bf16 base, 131 GiB) 3 GPUs of that node, its weights sharded;
    evaluate (the adapter on the 4-bit base, export.merged: false) one GPU; no merge_lora."""
    from conftest import header_dry_run

    proc, jobs = header_dry_run(EXAMPLE, "llama31_70b_instruct", tmp_path)
    assert "merge_lora" not in jobs and "convert_checkpoint" in jobs, jobs
    assert "nodes=1," in jobs["train"] and "gres=gpu:8" in jobs["train"], jobs["train"]
    for rule, gpus in (("evaluate_base", 3), ("evaluate", 1)):
        assert f"gres=gpu:{gpus}," in jobs[rule] and f"workers_per_node={gpus}," in jobs[rule]
        assert "nodes=1," in jobs[rule], jobs[rule]
    assert "evaluate_base on 1 node(s) x 3 GPU(s) (ZeRO-3 shards)" in proc.stderr


@pytest.mark.extended
@pytest.mark.slow
def test_an_adapter_only_run_end_to_end_on_the_demo(demo, tmp_path):
    """The demo with export.merged: false, from a copy of the finished demo (its training
    is not redone: export settings are not training's): no merged model is written, the
    evaluation runs on the base with the adapter and scores as the merged model did, the
    published folder is the adapter with a card that says how to load it."""
    from conftest import snakemake

    work = tmp_path / "w"
    subprocess.run(["cp", "-a", str(demo), str(work)], check=True)
    shutil.rmtree(work / "results/demo/merged_model")
    before = json.loads((work / "results/demo/eval/metrics.json").read_text())
    trained = (work / "results/demo/train/metrics.jsonl").stat().st_mtime_ns
    proc = snakemake("all", "publish", "--configfile", str(ROOT / "config/config.yaml"),
                     "--directory", str(work), "--config",
                     "runs={'demo': {'checkpoints': {'optimizer': 'all'}, "
                     "'export': {'merged': False}, 'publish': {'repo_id': "
                     "'snaketune/tiny-arith-adapter', 'license': 'apache-2.0', "
                     "'dry_run': True}}}", check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert not (work / "results/demo/merged_model").exists()
    assert "rule merge_lora" not in proc.stdout and "rule train" not in proc.stdout
    assert (work / "results/demo/train/metrics.jsonl").stat().st_mtime_ns == trained
    after = json.loads((work / "results/demo/eval/metrics.json").read_text())
    assert after["model"].endswith("results/demo/lora_adapters"), after["model"]
    assert after["exact_match"] == before["exact_match"]
    assert after["loss"] == pytest.approx(before["loss"], rel=1e-5)
    folder = work / "results/demo/publish"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {
        p.name for p in folder.iterdir()
    }
    assert not list(folder.glob("model*.safetensors"))  # the adapter, not a whole model
    card = (folder / "README.md").read_text()
    assert "## How to load" in card and "PeftModel.from_pretrained" in card
    assert "library_name: peft" in card
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert "resources/models" not in str(adapter_config["base_model_name_or_path"])


def test_the_disk_plan_of_an_adapter_only_run_drops_the_merged_model():
    """export.merged: false: the exports are the adapter alone, the bf16 merged model
    (2 bytes a weight of the 70B: 131.4 GiB) is not counted."""
    from dataclasses import replace

    from snaketune.budget.diskplan import run_need
    from snaketune.budget.fit import setup_of

    shape = Shape.from_config(LLAMA_70B)
    run = {**yaml_of(EXAMPLE)["runs"]["llama70b_qlora"]}
    from snaketune.plan.config import validate_config

    config = validate_config({"models": {"llama31_70b_instruct": {"source": "hub", "id": "x"}},
                              "datasets": yaml_of(EXAMPLE)["datasets"],
                              "runs": {"r": run}}, ROOT)  # fmt: skip
    setup = setup_of(config["runs"]["r"], {"zero_optimization": {"stage": 2}})
    assert setup.merged is False
    alone = run_need(shape, setup, 2, "last")["exports"]
    merged = run_need(shape, replace(setup, merged=True), 2, "last")["exports"]
    assert (merged - alone) / 2**30 == pytest.approx(131.4, abs=0.1)
    assert alone / 2**30 < 1


def yaml_of(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def test_a_run_cannot_start_from_a_run_that_keeps_only_its_adapter():
    from snaketune.core.errors import ConfigError
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config/config.yaml")
    dpo = load_yaml(ROOT / "config/dpo_demo.yaml")
    config["datasets"].update(dpo["datasets"])
    config["runs"] = dpo["runs"]
    config["runs"]["sft_demo"]["export"] = {"merged": False}
    with pytest.raises(
        ConfigError,
        match=r"runs\.dpo_demo\.init_from: 'sft_demo' keeps no "
        r"merged model \(export\.merged: false\).*set export\.merged: true",
    ):
        validate_config(config, ROOT)
    full = load_yaml(ROOT / "config/config.yaml")
    demo = full["runs"]["demo"]
    demo.pop("lora")
    demo.update(method="full", export={"merged": False})
    with pytest.raises(ConfigError, match=r"runs\.demo\.export\.merged: false keeps a LoRA"):
        validate_config(full, ROOT)


def test_a_conversion_job_asking_less_memory_than_its_plan_is_refused():
    """The 70B QLoRA example's conversion (the adapter kept, export.merged: false) gates the
    adapter on its base loaded in 4 bits, as training loaded it: its 68.45B decoder linear
    weights at 0.516 bytes (the packed half byte, an 8-bit absmax per 64 and an fp32
    constant per 256 blocks), its other 2.10B weights in bf16, a tensor of 1.05B fp32
    weights being loaded and the libraries (0.35 GiB): 41.1 GiB, not the 141 GiB of the
    base dequantized. A job asking 32 GB is refused before queueing, naming the stage, both
    figures and the key."""
    from snaketune.budget.stageplan import export_plans, stage_memory
    from snaketune.plan.config import validate_config

    config = validate_config({"models": {"llama31_70b_instruct": {"source": "hub", "id": "x"}},
                              "datasets": yaml_of(EXAMPLE)["datasets"],
                              "runs": {"r": yaml_of(EXAMPLE)["runs"]["llama70b_qlora"]}}, ROOT)  # fmt: skip
    stages = export_plans(config["runs"]["r"], Shape.from_config(LLAMA_70B))
    linear, other, layer = 68_451_041_280, 70_553_706_496 - 68_451_041_280, 1_050_673_152
    want = 0.35 + (linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + 2 * other + 4 * layer) / 2**30
    assert stages["convert_checkpoint"]["cpu_gib"] == pytest.approx(want, abs=0.01)
    assert round(want, 1) == 41.1
    assert "merge_lora" not in stages  # export.merged: false
    (line,) = stage_memory("r", stages, {("convert_checkpoint", "r"): 32000})
    assert line.startswith("runs.r: its convert_checkpoint job asks 32000 MB of memory "
                           "(mem_mb), but about 41.1 GiB are needed")  # fmt: skip
    assert "raise set-resources convert_checkpoint: mem_mb to at least" in line
    assert stage_memory("r", stages, {("convert_checkpoint", "r"): 64000}) == []


def test_a_small_models_conversion_is_planned_at_its_size_not_a_shards():
    """The gate's load budget is a shard (export.max_shard_size, 5GB by default), but a
    model smaller than a shard is loaded whole: the demo's 180k-weight model (its
    conversion peaked at 0.4 GB) was planned at 9.7 GiB. A 70B model keeps the shard."""
    from conftest import run_spec

    from snaketune.budget.stageplan import export_plans

    run = run_spec(method="full")
    shape = Shape.from_config(TINY)
    got = export_plans(run, shape)["convert_checkpoint"]["cpu_gib"]
    want = 0.35 + (4 * shape.largest_layer + 2 * 4 * shape.params) / 2**30
    assert got == pytest.approx(want, abs=0.01) and got < 0.5
    big = export_plans(run, Shape.from_config(LLAMA_70B))["convert_checkpoint"]["cpu_gib"]
    assert big == pytest.approx(0.35 + (4 * 1_050_673_152 + 2 * 5e9) / 2**30, abs=0.01)


@pytest.mark.extended
@pytest.mark.slow
def test_the_evaluate_stages_plan_is_what_evaluation_holds():
    """bench/eval_memory.py: a 29M-weight Llama evaluated as the stage does (a loss pass over
    a batch of 8 x 256 tokens, then greedy generation of 64 tokens with the KV cache), under
    MemTracker: each phase's plan (the loss pass's logits; generation's KV cache and prefill
    MLP) and the whole (weights + the larger; margin set aside) within 15% of the largest
    sum of live tensors, and the larger phase the one the plan says."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench/eval_memory.py"), "--json"],
                          capture_output=True, text=True, env=ENV, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = got["plan"]
    assert plan["weights"] == got["weights"]  # the count of the weights is exact
    assert plan["planned"] == pytest.approx(got["measured"], rel=0.15), got
    assert (plan["loss_pass"] > plan["generation"]) == (got["loss_pass"] > got["generation"])
    for part in ("loss_pass", "generation"):
        assert plan[part] == pytest.approx(got[part], rel=0.15), (part, got)


def test_a_reference_stage_that_cannot_hold_its_model_is_refused_naming_the_fix():
    """A full 70B DPO run with a precomputed reference on 80 GB GPUs: each reference_logps
    worker would hold the whole bf16 model (131.4 GiB): refused, naming the stage and
    `dpo.reference: live`; a 4-bit run's reference (its 4-bit base) fits."""
    from snaketune.budget.stageplan import stage_plans, stage_problems
    from snaketune.plan.config import validate_config

    def reference_plan(**change) -> dict:
        """The run's stage plans' reference entry alone ({} where it has none)."""
        config = {"runs": {"r": dpo_run(**change)}}
        plans = stage_plans(config, "r", shape, 79.6)
        return {k: v for k, v in plans.items() if k == "reference_logps"}

    def dpo_run(**change) -> dict:
        run = {"model": "m", "dataset": "pairs", "method": "dpo", "deepspeed": "zero3",
               "nodes": 2, "gpus_per_node": 8, "max_length": 1024, "micro_batch_size": 2,
               "max_steps": 10, "learning_rate": 1e-6, **change}  # fmt: skip
        config = validate_config({"models": {"m": {"source": "hub", "id": "x"}},
                                  "datasets": {"pairs": {"source": "hub", "id": "y",
                                                         "format": "preference"}},
                                  "runs": {"r": run}}, ROOT)  # fmt: skip
        return config["runs"]["r"]

    shape = Shape.from_config(LLAMA_70B)
    full = reference_plan()
    assert full["reference_logps"]["fits"] is False
    (line,) = stage_problems("r", full, 79.6)
    assert (
        line.startswith("runs.r: reference_logps needs ")
        and "(each worker holds the whole reference model (131.4 GiB))" in line
        and "set dpo.reference: live" in line
    ), line
    qlora = reference_plan(lora={"r": 16, "quantize": "4bit"})
    assert qlora["reference_logps"]["fits"] is True, qlora
    assert reference_plan(dpo={"reference": "live"}) == {}


def test_a_scoring_job_asks_the_memory_its_workers_loading_needs():
    """Every registered scoring stage's job has its memory checked before queueing
    (snaketune.plan.pipeline.memory_checked). The 70B DPO run's reference stage on 2 nodes
    x 8: each of a node's 8 workers loads the model, a layer at a time from a bf16 checkpoint (mapped),
    whole (converted to 2 bytes a weight) from an fp32 one; a profile's 240000 MB is refused
    for the fp32 base, naming the stage and the key, and passes for the bf16 one."""
    from snaketune.budget import scoring
    from snaketune.budget.stageplan import stage_memory
    from snaketune.plan.config import validate_config
    from snaketune.plan.pipeline import memory_checked

    assert {s.name for s in scoring.STAGES} <= set(memory_checked())
    run = {"model": "m", "dataset": "pairs", "method": "dpo", "deepspeed": "zero3",
           "nodes": 2, "gpus_per_node": 8, "max_length": 1024, "micro_batch_size": 2,
           "max_steps": 10, "learning_rate": 1e-6}  # fmt: skip
    config = validate_config({"models": {"m": {"source": "hub", "id": "x"}},
                              "datasets": {"pairs": {"source": "hub", "id": "y",
                                                     "format": "preference"}},
                              "runs": {"r": run}}, ROOT)  # fmt: skip
    gib = 1024**3
    for dtype, asked in (("bfloat16", []), ("float32", ["runs.r: its reference_logps job"])):
        shape = Shape.from_config({**LLAMA_70B, "dtype": dtype})
        plan = {
            "reference_logps": scoring.reference_memory(
                scoring.NeedContext(config, "r", shape, 79.6)
            )
        }
        held = shape.largest_layer if dtype == "bfloat16" else shape.params
        assert plan["reference_logps"]["cpu_gib"] == round(8 * (0.35 + held * 2 / gib), 2)
        lines = stage_memory("r", plan, {("reference_logps", "r"): 240000})
        assert [line[: len(asked[0])] for line in lines] == asked if asked else lines == []
        if asked:
            assert "raise set-resources reference_logps: mem_mb to at least" in lines[0]


def full_run(**change) -> dict:
    """A validated full fine-tune of a model "m" on a held-out set (change: its keys)."""
    from snaketune.plan.config import validate_config

    run = {"model": "m", "dataset": "d", "eval_dataset": "e", "method": "full",
           "deepspeed": "zero3", "nodes": 4, "gpus_per_node": 8, "max_length": 2048,
           "micro_batch_size": 1, "max_steps": 10, "learning_rate": 1e-5, **change}  # fmt: skip
    data = {"source": "hub", "id": "y", "format": "prompt_response"}
    config = validate_config({"models": {"m": {"source": "hub", "id": "x"}},
                              "datasets": {"d": data, "e": {**data, "id": "z"}},
                              "runs": {"r": run}}, ROOT)  # fmt: skip
    return config


def test_generation_while_training_is_planned_beside_the_training_states():
    """A full 70B fine-tune on 4 nodes x 8 x 80 GB under ZeRO-3 that scores held-out answers
    while training: the pass holds, beside what training keeps on each GPU between steps
    (the weights' 1/32 in bf16 with the largest layer gathered in fp32, the fp32 gradient
    and Adam partitions: written out here from the parameter count), the larger of its
    batch's logits and its generation's KV cache with the prompt's MLP pass. On the shards
    that fits; gathered whole onto each GPU it would not: `auto` plans on the shards and
    says so; `true` is refused naming eval.gather_for_generation: false."""
    from snaketune.budget.fit import setup_of
    from snaketune.budget.stageplan import stage_problems, training_pass_plans

    shape, gib = Shape.from_config(LLAMA_70B), 1024**3
    p = shape.params
    assert p == 70_553_706_496  # Llama-3.1-70B's published parameter count
    states = 4 * 128256 * 8192 + (2 + 4 + 12) * p / 32
    logits = 8 * 2048 * 128256 * (2 + 4)  # bf16 logits and their fp32 copy
    generation = 2 * 80 * 8 * 128 * 8 * (2048 + 256) * 2 + 3 * 8 * 2048 * 28672 * 2
    on_shards = (states + max(logits, generation)) * 1.1 / gib + 1.5
    whole = (states + max(logits, 2 * p * 31 / 32 + generation)) * 1.1 / gib + 1.5
    zero3 = {"zero_optimization": {"stage": 3}}

    def plan(**ev):
        config = full_run(eval_steps=5, eval={"during_training_answers": True, **ev})
        run = config["runs"]["r"]
        return training_pass_plans(run, shape, setup_of(run, zero3), 79.6)

    auto = plan()["train/heldout_pass"]
    assert auto["per_gpu_gib"] == pytest.approx(on_shards, abs=0.01) and auto["fits"], auto
    assert f"gathered whole: {whole:.1f} GiB (does not fit)" in auto["why"], auto
    shards = plan(gather_for_generation=False)["train/heldout_pass"]
    assert shards["per_gpu_gib"] == auto["per_gpu_gib"] and shards["fits"], shards
    gathered = plan(gather_for_generation=True)
    assert gathered["train/heldout_pass"]["per_gpu_gib"] == pytest.approx(whole, abs=0.01)
    (line,) = stage_problems("r", gathered, 79.6)
    assert line.startswith("runs.r: train/heldout_pass needs ") and \
        "set eval.gather_for_generation: false or auto" in line, line  # fmt: skip
    # without answers the pass is its loss alone; without eval_steps there is no pass
    config = full_run(eval_steps=5)
    loss_only = training_pass_plans(config["runs"]["r"], shape,
                                    setup_of(config["runs"]["r"], zero3), 79.6)  # fmt: skip
    assert loss_only["train/heldout_pass"]["per_gpu_gib"] == pytest.approx(
        (states + logits) * 1.1 / gib + 1.5, abs=0.01
    )
    config = full_run()
    assert training_pass_plans(config["runs"]["r"], shape,
                               setup_of(config["runs"]["r"], zero3), 79.6) == {}  # fmt: skip


def test_grpo_generation_under_zero3_is_planned_on_the_shards():
    """A full GRPO run of the 70B under ZeRO-3 without vLLM: its completions' KV cache
    (micro_batch_size x (prompt + completion) tokens) beside training's states and the frozen
    reference's shard; gathering the whole model would not fit, the shards do."""
    from snaketune.budget.fit import setup_of
    from snaketune.budget.stageplan import training_pass_plans

    shape, gib = Shape.from_config(LLAMA_70B), 1024**3
    p = shape.params
    config = full_run(method="grpo", micro_batch_size=8, max_length=512,
                      grpo={"num_generations": 8, "max_completion_length": 512, "beta": 0.04,
                            "use_vllm": False})  # fmt: skip
    run = config["runs"]["r"]
    got = training_pass_plans(run, shape, setup_of(run, {"zero_optimization": {"stage": 3}}),
                              79.6)["train/generation"]  # fmt: skip
    states = 4 * 128256 * 8192 + (2 + 4 + 12) * p / 32 + 2 * p / 32  # and the reference
    kv = 2 * 80 * 8 * 128 * 2 * 8 * (512 + 512)
    assert got["per_gpu_gib"] == pytest.approx((states + kv) * 1.1 / gib + 1.5, abs=0.01), got
    assert got["fits"] and "gathered whole" in got["why"] and "(does not fit)" in got["why"]


def test_an_evaluate_job_asks_the_memory_its_loading_needs(tmp_path):
    """An 8B base saved in fp32, evaluated in bf16 on one GPU: the job converts the whole
    model in CPU memory (2 bytes a weight, 15.0 GiB, and the libraries): its rule asks that
    with a tenth to spare by default, and a profile asking 12000 MB is refused before
    queueing naming the stage and the key; the run's own model (exported in bf16, the
    checkpoint mapped: a layer at a time) keeps the 16000 MB floor and passes at 12000."""
    import math

    from conftest import SHAPES

    from snaketune.budget.fit import planned_mem_mb
    from snaketune.budget.stageplan import stage_memory, stage_plans

    cfg = {**SHAPES["meta-llama/Llama-3.1-8B-Instruct"], "dtype": "float32"}
    (tmp_path / "resources/models/m").mkdir(parents=True)
    (tmp_path / "resources/models/m/config.json").write_text(json.dumps(cfg))
    config = full_run(nodes=1, gpu="h100-80gb")
    shape = Shape.from_config(cfg)
    need = 1024 * (0.35 + 2 * shape.params / 1024**3)
    assert planned_mem_mb(config, "r", "evaluate_base", 16000, tmp_path) == math.ceil(
        1.1 * round(need / 1024, 2) * 1024
    )
    assert planned_mem_mb(config, "r", "evaluate", 16000, tmp_path) == 16000
    stages = stage_plans(config, "r", shape, 79.6)
    (line,) = stage_memory("r", stages, {("evaluate_base", "r"): 12000, ("evaluate", "r"): 12000})
    assert line.startswith("runs.r: its evaluate_base job asks 12000 MB of memory (mem_mb), "
                           "but about 15.3 GiB are needed (1 process(es) loading: the whole "
                           "model converted to 2 bytes a weight)"), line  # fmt: skip
    assert "raise set-resources evaluate_base: mem_mb to at least" in line
