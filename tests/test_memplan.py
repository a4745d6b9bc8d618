"""The per-GPU memory plan: model states against DeepSpeed's own estimators for 1B, 7B and
32B shapes, the config examples planned as fitting, a 32B full fine-tune with ZeRO-2 that
does not fit (and the change that makes it), and `snaketune plan`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import ENV, ROOT, SHAPES, VLM_SHAPES, snakemake
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from snaketune.budget.advice import changes, format_plan, plan_run
from snaketune.budget.memplan import Setup, Shape, activations, estimate, model_states
from snaketune.core.errors import UserError
from snaketune.plan.config import validate_config

# Parameter counts the Hub states for them.
PARAMS = {
    "meta-llama/Llama-3.2-1B": 1.24e9,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24e9,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03e9,
    "deepseek-ai/deepseek-coder-6.7b-instruct": 6.74e9,
    "Qwen/Qwen2.5-32B-Instruct": 32.8e9,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,  # every expert (3.3B active)
}


def setup(**overrides) -> Setup:
    base = dict(adapter="full", stage=2, offload_optimizer=False, offload_params=False, nodes=2,
                gpus_per_node=8, micro_batch_size=4, max_length=1024, gradient_checkpointing=False,
                attention="sdpa", liger=False, bytes_per_weight=2)  # fmt: skip
    return Setup(**{**base, **overrides})


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_parameter_count_from_config_json(model):
    assert Shape.from_config(SHAPES[model]).params == pytest.approx(PARAMS[model], rel=0.01)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("nodes,gpus", [(1, 1), (2, 8), (4, 4)])
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_model_states_match_deepspeed(model, nodes, gpus, offload):
    shape = Shape.from_config(SHAPES[model])
    ours = model_states(
        shape, setup(stage=2, nodes=nodes, gpus_per_node=gpus, offload_optimizer=offload)
    )
    _, theirs = estimate_zero2_model_states_mem_needs(
        shape.params, gpus, nodes, cpu_offload=offload
    )
    # measured: equal to the byte in every case (the formulas are DeepSpeed 0.19.8's, term
    # by term); 1e-9 only for float rounding. An optimizer counted at 8 bytes instead of 12
    # per parameter would be 8% off at 16 GPUs.
    assert sum(ours.values()) == pytest.approx(theirs, rel=1e-9)


@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("nodes,gpus", [(1, 1), (2, 8), (4, 4)])
@pytest.mark.parametrize("optim,params", [(False, False), (True, False), (True, True)])
def test_zero3_model_states_match_deepspeed(model, nodes, gpus, optim, params):
    shape = Shape.from_config(SHAPES[model])
    s = setup(stage=3, nodes=nodes, gpus_per_node=gpus, offload_optimizer=optim,
              offload_params=params)  # fmt: skip
    ours = model_states(shape, s)
    _, theirs, _ = estimate_zero3_model_states_mem_needs(
        shape.params, shape.largest_layer, gpus, nodes, cpu_offload=optim,
        cpu_offload_params=params,
    )  # fmt: skip
    # measured: equal to the byte in every case (the formulas are DeepSpeed 0.19.8's, term
    # by term); 1e-9 only for float rounding. An optimizer counted at 8 bytes instead of 12
    # per parameter would be 8% off at 16 GPUs.
    assert sum(ours.values()) == pytest.approx(theirs, rel=1e-9)


def test_lora_states_are_the_frozen_weights_plus_small_adapters():
    shape = Shape.from_config(SHAPES["deepseek-ai/deepseek-coder-6.7b-instruct"])
    lora = model_states(shape, setup(adapter="lora", lora_r=16))
    full = model_states(shape, setup())
    assert lora["weights"] == full["weights"] == 2 * shape.params
    assert 0 < lora["optimizer"] < full["optimizer"] / 100
    # r=16 on every linear of 32 layers: 16 x (in + out) summed
    assert shape.lora_params(16, "all-linear") == 32 * 16 * (4 * 8192 + 3 * (4096 + 11008))


def test_activation_knobs_move_the_estimate_the_right_way():
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.2-1B"])
    s = setup(max_length=2048, micro_batch_size=8)
    plain = estimate(shape, s)["activations"]
    layers = estimate(shape, replace(s, liger=True))["activations"]  # without the logits
    checkpointed = estimate(shape, replace(s, liger=True, gradient_checkpointing=True))
    assert checkpointed["activations"] < layers / 4
    assert estimate(shape, replace(s, micro_batch_size=4))["activations"] == pytest.approx(
        plain / 2, rel=0.01
    )
    assert estimate(shape, replace(s, attention="eager"))["activations"] > plain * 1.5
    assert estimate(shape, replace(s, liger=True))["activations"] < plain


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_micro_batch_a_step_holds_gradients_or_activations_not_both(stage):
    """The measured full fine-tune (docs/benchmarks.md, one H200): with one micro batch a
    step under ZeRO-2 the peak is the activations at the start of backward, before the
    gradients exist, so the plan takes the larger of the two; with accumulation the earlier
    micro batches' gradients stay beside the next one's activations (both counted), as
    under ZeRO-3 and ZeRO-1, whose gradient buffers are made before backward."""
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.2-1B"])
    one = setup(nodes=1, gpus_per_node=1, max_length=2048, stage=stage)
    acc = replace(one, accumulation=2)
    got1, got2 = estimate(shape, one), estimate(shape, acc)
    grads, acts = got2["gradients"], got2["activations"]
    assert 0 < grads < acts and got1["activations"] == acts
    body1, body2 = (g["total"] - g["margin"] for g in (got1, got2))
    if stage == 2:
        assert body2 - body1 == pytest.approx(grads, abs=0.02)
        assert got1["not_at_once"] == pytest.approx(-grads, abs=0.01)
        # the gradients larger than the activations (a short micro batch): they are the peak
        short = estimate(shape, replace(one, max_length=64, micro_batch_size=1))
        assert short["gradients"] > short["activations"]
        assert short["not_at_once"] == pytest.approx(-short["activations"], abs=0.01)
    else:
        assert body1 == pytest.approx(body2) and "not_at_once" not in got1
    line = format_plan("r", {"per_gpu_gib": got1, "gpu_gib": 79.6, "fits": True,
                             "cpu_gib_per_node": 1.0, "suggestion": None})  # fmt: skip
    assert ("gradients and activations not held at once" in line) == (stage == 2), line


def test_32b_full_zero2_does_not_fit_and_the_suggestion_does():
    shape = Shape.from_config(SHAPES["Qwen/Qwen2.5-32B-Instruct"])
    s = setup(nodes=4, gpus_per_node=4, micro_batch_size=1, max_length=4096,
              gradient_checkpointing=True)  # fmt: skip
    plan = plan_run(shape, s, 79.2)
    assert plan["fits"] is False
    assert plan["per_gpu_gib"]["weights"] > 60  # 2 bytes x 32.8B unpartitioned
    assert plan["suggestion"].startswith("deepspeed: zero3"), plan["suggestion"]
    # the suggestion's own setting plans as fitting
    fixed = [c for what, c in changes(s) if plan["suggestion"].startswith(what)][0]
    assert plan_run(shape, fixed, 79.2)["fits"] is True


def test_when_no_single_change_fits_the_cheapest_set_of_changes_is_named():
    """An 8B LoRA at micro batch 8 x 4096 on 40 GiB GPUs (what a user met): no single change
    fits, a smaller micro batch with gradient checkpointing does; the plan names that pair
    and its figure, each recomputed here from the formulas."""
    from snaketune.budget.advice import NOTHING_FITS

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    s = setup(adapter="lora", lora_r=16, nodes=1, micro_batch_size=8, max_length=4096)
    assert not [what for what, c in changes(s) if estimate(shape, c)["total"] <= 39.4]
    plan = plan_run(shape, s, 39.4)
    fixed = replace(s, micro_batch_size=2, gradient_checkpointing=True)
    total = estimate(shape, fixed)["total"]
    assert plan["suggestion"] == (
        "no single change fits; together: micro_batch_size: 2 (raise "
        "gradient_accumulation_steps to keep the global batch); gradient_checkpointing: true "
        f"(then {total:.1f} GiB per GPU)")  # fmt: skip
    assert total <= 39.4 < estimate(shape, replace(fixed, micro_batch_size=4))["total"]
    # nothing fits a GPU too small for the weights alone, even 4-bit on 64 nodes
    assert plan_run(shape, s, 1.0)["suggestion"] == NOTHING_FITS


def test_cpu_memory_per_node_by_how_the_model_is_loaded():
    """A 4-bit 70B on 8 ranks streams onto the GPUs a layer at a time (the largest, its
    embedding: 128256 x 8192 at 2 bytes, per process), not a bf16 copy per process (1,051
    GiB, more than the node has, as the plan said before); a LoRA base in bf16 is loaded
    whole by each process."""
    from snaketune.budget.advice import plan_run

    llama70b = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                "vocab_size": 128256, "tie_word_embeddings": False}  # fmt: skip
    shape = Shape.from_config(llama70b)
    s = setup(adapter="lora", lora_r=16, nodes=1, gpus_per_node=8, micro_batch_size=1,
              gradient_checkpointing=True, quantized=True)  # fmt: skip
    plan = plan_run(shape, s, 79.2)
    assert plan["cpu_gib_per_node"] == round(128256 * 8192 * 2 * 8 / 2**30, 2)  # 15.66
    assert "4-bit base streams onto the GPUs" in plan["cpu_why"]
    bf16 = plan_run(shape, replace(s, quantized=False), 79.2)
    assert bf16["cpu_gib_per_node"] == round(shape.params * 2 * 8 / 2**30, 2) > 1000
    assert "converts the whole model" in bf16["cpu_why"]
    # saved in bf16 (config.json says so) and trained in bf16: the checkpoint stays mapped
    saved = Shape.from_config({**llama70b, "torch_dtype": "bfloat16"})
    mapped = plan_run(saved, replace(s, quantized=False), 79.2)
    assert mapped["cpu_gib_per_node"] == plan["cpu_gib_per_node"]
    assert "stays memory-mapped" in mapped["cpu_why"]


@pytest.mark.extended
@pytest.mark.slow
def test_what_loading_holds_of_cpu_memory_is_what_the_plan_counts():
    """bench/load_memory.py's short form, measured (each process's own resident memory while
    the train stage's loader runs): a bf16 checkpoint loaded in bf16 holds no copy (under a
    tenth of the weights' bytes, 4% here: the plan counts a layer at a time), a conversion
    to fp32 holds the whole model at 4 bytes a weight (the plan's P x w, within 10%); a 4-bit
    base (QLoRA) loaded on this CPU keeps what its device would hold (its tensors' bytes,
    within 15%). What a 4-bit load holds above that for a moment is reported, not judged
    here: it is a layer's worth in most loads, a whole bf16 copy's in some (docs/benchmarks.md)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench/load_memory.py"), "--short",
                           "--json"], capture_output=True, text=True, env=ENV, timeout=300,
                          check=True)  # fmt: skip
    mapped, converted, quantized = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["precision"] for r in (mapped, converted, quantized)] == ["bf16", "fp32", "4bit"]
    assert mapped["anon_bytes"] < 0.1 * mapped["params"] * 2, mapped  # a copy: all of it
    assert converted["anon_bytes"] == pytest.approx(converted["params"] * 4, rel=0.1), converted
    assert quantized["held_bytes"] == pytest.approx(quantized["tensor_bytes"], rel=0.15), quantized


def test_the_train_jobs_memory_is_checked_against_the_cpu_figure(tmp_path):
    """Before queueing, a run whose train job asks less memory per node (mem_mb) than its
    CPU figure is refused, naming the run, both figures and the key."""
    from snaketune.budget.fit import check_runs
    from snaketune.plan.config import load_config

    path = _example_root(tmp_path, "qwen-32b-zero3-offload-4x4.yaml")
    config = load_config(path, tmp_path)
    (run,) = config["runs"]
    plan = json.loads(_plan(path, "--json").stdout)[0]
    need = plan["cpu_gib_per_node"]
    (line,) = check_runs(config, [run], tmp_path, tmp_path, False, {run: need * 1024 * 0.9})
    assert line.startswith(f"runs.{run}: its train job asks {need * 1024 * 0.9:g} MB of memory "
                           f"per node (mem_mb), but {need:.1f} GiB per node are needed "
                           "(the states offloaded to CPU memory")  # fmt: skip
    assert "raise set-resources train: mem_mb" in line
    assert check_runs(config, [run], tmp_path, tmp_path, False, {run: need * 1024 * 1.01}) == []
    # a run whose jobs run here is checked against this machine instead
    assert not [ln for ln in check_runs(config, [run], tmp_path, tmp_path, True, {run: 1})
                if "mem_mb" in ln]  # fmt: skip


def test_unknown_architecture_is_one_line():
    with pytest.raises(
        UserError, match="cannot plan memory for model_type 'mamba'.*skip_memory_check"
    ):
        Shape.from_config({"model_type": "mamba", "hidden_size": 8})


def _example_root(tmp_path: Path, example: str, edit=None) -> Path:
    """A workflow root holding the example config and the config.json of its model where
    download_model puts it (resources/models/<name>/)."""
    shutil.copytree(ROOT / "config", tmp_path / "config")
    shutil.copytree(ROOT / "workflow", tmp_path / "workflow")
    config = yaml.safe_load((ROOT / "config/examples" / example).read_text())
    for name, spec in config["models"].items():
        (tmp_path / "resources/models" / name).mkdir(parents=True)
        (tmp_path / "resources/models" / name / "config.json").write_text(
            json.dumps(SHAPES[spec["id"]])
        )
    if edit:
        edit(config)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _plan(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "snaketune.app.cli", "plan", str(config), "--root", str(config.parent),
         *args], capture_output=True, text=True, env=ENV, cwd=config.parent, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize(
    "example,gpu",
    [("llama3.2-1b-gsm8k-full-2x8.yaml", "h100-80gb"), ("coder-6.7b-lora-2x4.yaml", "a100-40gb"),
     ("qwen-32b-zero3-offload-4x4.yaml", "a100-80gb"), ("qwen-32b-qlora-1x4.yaml", "a100-40gb")],
)  # fmt: skip
def test_config_examples_plan_as_fitting(tmp_path, example, gpu):
    proc = _plan(_example_root(tmp_path, example), "--gpu", gpu, "--json")
    (plan,) = json.loads(proc.stdout)
    assert plan["fits"] is True, plan
    # the disk plan is against this machine's free space: a 32B full fine-tune may not fit
    assert proc.returncode == (0 if plan["disk"]["fits"] else 1), proc.stderr
    assert plan["disk"]["need_bytes"]["total"] > plan["disk"]["need_bytes"]["checkpoint"] > 0
    assert set(plan["per_gpu_gib"]) >= {"weights", "gradients", "optimizer", "activations",
                                        "margin", "total"}  # fmt: skip
    assert {"run", "gpu_gib", "cpu_gib_per_node", "suggestion"} <= set(plan)


def test_32b_example_changed_to_zero2_plans_as_not_fitting(tmp_path):
    def to_zero2(config):
        config["runs"][next(iter(config["runs"]))]["deepspeed"] = "zero2"

    config = _example_root(tmp_path, "qwen-32b-zero3-offload-4x4.yaml", to_zero2)
    proc = _plan(config, "--gpu-memory", "80")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if "against GPU" in ln]
    assert "does NOT fit" in line and "cheapest change that fits: deepspeed: zero3" in line
    assert "against GPU 80.0 GiB" in line


def test_plan_without_a_downloaded_model_says_so(tmp_path):
    config = _example_root(tmp_path, "coder-6.7b-lora-2x4.yaml")
    shutil.rmtree(tmp_path / "resources/models")
    proc = _plan(config, "--gpu", "a100-40gb")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "error: runs.coder_lora: cannot plan: the config.json of model deepseek_coder_6_7b"
    )
    # offline (the tests' HF_HUB_OFFLINE): said at once, with commands that work
    assert "this machine is offline (HF_HUB_OFFLINE is set)" in line
    assert f"(snakemake --profile <profile> --configfile {config} --until download_model)" in line
    assert "a folder holding its config.json alone" in line  # and the command that plans so
    assert f"(snaketune plan {config} --model-config deepseek_coder_6_7b=<folder>;" in line


def test_workflow_refuses_a_run_that_cannot_fit_before_any_job(tmp_path):
    """Through the workflow (local profile): once the model's config.json is there, a run
    that cannot fit stops the workflow before any job runs, with the plan's line."""
    snakemake("--directory", str(tmp_path), "make_fixtures")  # the demo's model is built
    config = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    config["runs"]["demo"]["gpu"] = 0.5  # GiB: not even the CUDA context fits
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = snakemake("--configfile", str(path), "--directory", str(tmp_path), check=False)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert len(errors) == 4 and "Traceback" not in proc.stdout + proc.stderr, errors
    assert errors[0].startswith("error: demo: ") and "does NOT fit" in errors[0], errors
    assert "against GPU 0.5 GiB" in errors[0] and "skip_memory_check: true" in errors[0]
    # nor do its evaluations (the tuned model's and the base's), each named
    assert [e.split(" needs ")[0] for e in errors[1:3]] == [
        "error: runs.demo: evaluate",
        "error: runs.demo: evaluate_base",
    ]
    assert errors[3] == "error: 3 problem(s) found before queueing; nothing was run"
    assert not (tmp_path / "results").exists()  # no job ran


def test_check_runs_cpu_run_skip_and_not_yet_downloaded(fixtures_dir, tmp_path):
    from snaketune.budget.fit import check_runs
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config/config.yaml")
    config["models"]["tiny"]["path"] = str(fixtures_dir / "tiny-llama")
    config["datasets"]["gsm8k_demo"]["path"] = str(fixtures_dir / "gsm8k-demo/train.jsonl")
    config["datasets"]["gsm8k_demo_test"]["path"] = str(fixtures_dir / "gsm8k-demo/test.jsonl")
    config = validate_config(config, ROOT)
    # the demo on this machine's CPU: 2 processes against its memory
    assert check_runs(config, ["demo"], tmp_path, ROOT, local=True) == []
    # a GPU that is far too small: refused, unless skip_memory_check
    config["runs"]["demo"]["gpu"] = 0.5
    line, *evaluations = check_runs(config, ["demo"], tmp_path, ROOT, local=True)
    assert line.startswith("demo: ") and "does NOT fit" in line
    # nor do its evaluations (the tuned model's and the base's)
    assert [e.split(" needs ")[0] for e in evaluations] == [
        "runs.demo: evaluate",
        "runs.demo: evaluate_base",
    ]
    config["runs"]["demo"]["skip_memory_check"] = True
    assert check_runs(config, ["demo"], tmp_path, ROOT, local=True) == []
    # no GPU type on SLURM: not checked; a model not built yet: checked later
    del config["runs"]["demo"]["gpu"]
    assert check_runs(config, ["demo"], tmp_path, ROOT, local=False) == []
    config["models"]["tiny"]["path"] = str(tmp_path / "not-built-yet")
    assert check_runs(config, ["demo"], tmp_path, ROOT, local=True) == []


def _grpo_run(**grpo) -> dict:
    """The newcomer example's GRPO run (Llama-3.1-8B, LoRA, 2 x 4 GPUs), with ``grpo``,
    validated."""
    config = yaml.safe_load(
        (ROOT / "config/examples/llama3.1-8b-chat-lora-sweep-grpo-2x4.yaml").read_text()
    )
    run = validate_config(config, ROOT)["runs"]["math_grpo"]  # defaults filled
    run["grpo"].update(grpo)  # after: validation refuses use_vllm true without vLLM here
    return run


def test_grpo_plan_counts_completions_reference_and_vllm():
    from snaketune.budget.fit import setup_of

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    zero2 = {"zero_optimization": {"stage": 2}}

    def plan(gpu=79.2, **grpo):
        return plan_run(shape, setup_of(_grpo_run(**grpo), zero2), gpu)

    short, long = plan(max_completion_length=256), plan(max_completion_length=2048)
    # 16 sequences of 512 + 2048 tokens against 512 + 256: the activations follow the length
    assert long["per_gpu_gib"]["activations"] > 2.5 * short["per_gpu_gib"]["activations"]
    # vLLM (colocate) takes its share of each GPU: 0.9 of 79.2 GiB against 0.3 of it
    low = plan(use_vllm=True, vllm_gpu_memory_utilization=0.3)["per_gpu_gib"]
    high = plan(use_vllm=True, vllm_gpu_memory_utilization=0.9)["per_gpu_gib"]
    assert low["vllm"] == pytest.approx(0.3 * 79.2, abs=0.01)
    assert high["total"] - low["total"] == pytest.approx(0.6 * 79.2, abs=0.02)
    assert "vllm" not in plan()["per_gpu_gib"]
    # no GPU type: vLLM's share cannot be counted, and the line says so
    unknown = plan(gpu=None, use_vllm=True)
    assert "vLLM's share" in format_plan("math_grpo", unknown)
    assert "not counted" in format_plan("math_grpo", unknown)
    # full fine-tuning with beta > 0 holds a frozen bf16 copy: 2 bytes x 8.03B = 15 GiB
    full = _grpo_run()
    del full["lora"]
    ref = plan_run(shape, setup_of(full, zero2), 79.2)["per_gpu_gib"]
    assert ref["reference"] == pytest.approx(2 * 8.03e9 / 2**30, rel=0.01)
    full["grpo"]["beta"] = 0.0
    assert "reference" not in plan_run(shape, setup_of(full, zero2), 79.2)["per_gpu_gib"]
    # the guide's case: a full fine-tune whose reference copy tips it over 80 GB
    full["grpo"]["beta"] = 0.04
    z3 = plan_run(shape, setup_of(full, {"zero_optimization": {"stage": 3}}), 79.2)
    assert z3["per_gpu_gib"]["reference"] == pytest.approx(2 * 8.03e9 / 8 / 2**30, rel=0.01)


def test_hub_lookup_offline_or_unreachable_asks_once_and_fails_fast(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from snaketune.data import sources

    calls = []

    def download(repo_id, filename, revision=None, local_files_only=False):
        calls.append(local_files_only)
        raise OSError("not in the cache" if local_files_only else "network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    sources.hub_config_json.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert sources.hub_config_json("org/m", None) == (
        None, "this machine is offline (HF_HUB_OFFLINE is set)")  # fmt: skip
    assert calls == [True]  # the cache only
    sources.hub_config_json.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(sources, "hub_reachable", lambda endpoint: False)
    path, why = sources.hub_config_json("org/m", None)
    assert path is None and "cannot be reached" in why and calls == [True, True]
    # once per model and process: a second run of the same model asks nothing
    assert sources.hub_config_json("org/m", None)[0] is None and calls == [True, True]
    sources.hub_config_json.cache_clear()


# ----------------------------------------------------------------------------- 4-bit base


def _llama(tmp_path: Path, **sizes) -> Path:
    """A random Llama with the given sizes, saved in fp32 (offline)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
                            "num_hidden_layers": 4, "num_attention_heads": 4,
                            "num_key_value_heads": 2, **sizes})  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_weights_are_what_bitsandbytes_holds(tmp_path, double_quant):
    """The plan's 4-bit weights against a model bitsandbytes really loaded: its parameters
    (4-bit packed and fp32) plus each layer's quantization constants, to the byte (every
    linear a whole number of 256 blocks of 64 weights: double quantization's constants
    without a partial block), on a model whose embeddings outweigh its linears."""
    import torch

    from snaketune.evaluation.model import build_model

    path = _llama(tmp_path, vocab_size=8192)
    q = {"bits": 4, "quant_type": "nf4", "double_quant": double_quant, "blocksize": 64,
         "load_dtype": "fp32", "compute_dtype": "fp32"}  # fmt: skip
    model = build_model(path, "fp32", "sdpa", q)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            held += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                held += state.state2.absmax.numel() * state.state2.absmax.element_size()
    shape = Shape.from_config(json.loads((path / "config.json").read_text()))
    s = setup(adapter="lora", lora_r=8, bytes_per_weight=4, nodes=1, gpus_per_node=1,
              quantized=True, double_quant=double_quant)  # fmt: skip
    assert shape.params - shape.linear_params > shape.linear_params
    assert model_states(shape, s)["weights"] == pytest.approx(held, rel=1e-9)
    # the same figure from a run's config (what `snaketune plan` and the checks read):
    # lora.double_quant reaches the plan (measured 1.0000 of the held bytes either way)
    from snaketune.app.fixtures import demo_run_spec
    from snaketune.budget.fit import setup_of

    run = demo_run_spec(ROOT, method="lora", precision="fp32", nodes=1, gpus_per_node=1,
                        micro_batch_size=1, max_length=64,
                        lora={"r": 8, "quantize": "4bit", "double_quant": double_quant})  # fmt: skip
    from_run = setup_of(run, {"zero_optimization": {"stage": 2}}, on_gpu=False)
    assert model_states(shape, from_run)["weights"] == pytest.approx(held, rel=0.01)
    # the linears' share: about half a byte of their 4 each (the rest stays fp32)
    linears = held - 4 * (shape.params - shape.linear_params)
    assert linears < 4 * shape.linear_params * (0.13 if double_quant else 0.145)
    assert torch.is_tensor(model.model.layers[0].mlp.down_proj.weight.quant_state.absmax)


def test_a_lora_run_that_does_not_fit_is_told_about_qlora(tmp_path):
    """The 32B QLoRA example without quantize on one A100 40 GB: ZeRO-3 cannot help a single
    GPU, the 4-bit base can; with it the example fits on one node, ZeRO-2."""
    shape = Shape.from_config(SHAPES["Qwen/Qwen2.5-32B-Instruct"])
    s = setup(adapter="lora", lora_r=16, nodes=1, gpus_per_node=1, micro_batch_size=1,
              max_length=4096, gradient_checkpointing=True)  # fmt: skip
    plan = plan_run(shape, s, 39.4)
    assert plan["fits"] is False
    assert plan["suggestion"].startswith("lora.quantize: 4bit (QLoRA) (then "), plan
    quantized = plan_run(shape, replace(s, quantized=True), 39.4)
    assert quantized["fits"] is True and quantized["per_gpu_gib"]["weights"] < 18.5
    # a 4-bit run is never offered offload (validation refuses it)
    assert not [what for what, _ in changes(replace(s, quantized=True)) if "offload" in what]
    config = _example_root(tmp_path, "qwen-32b-qlora-1x4.yaml")
    proc = _plan(config, "--gpu", "a100-40gb")
    (line,) = [ln for ln in proc.stdout.splitlines() if "against GPU" in ln]
    assert "weights (4-bit base)" in line and ": fits;" in line, line


def _bench(name: str):
    """A module of bench/ (loaded by path: bench/ holds a tokenize.py that would shadow the
    standard library's on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "qlora"])
def test_the_plan_for_the_demo_model_is_what_training_holds(quantized):
    """The demo's model with qlora_demo's settings (LoRA r8, modules_to_save, micro batch
    32 x 256), trained 2 steps on CPU: the plan (its CUDA margin set aside) within 15% of
    the largest sum of live tensors that PyTorch's MemTracker saw (bench/qlora_memory.py;
    measured: 1.03 for both, and 1.09 / 1.12 on a 29M-weight Llama)."""
    bench = _bench("qlora_memory")
    got = bench.measure(bench.CASES["demo"], quantized, steps=2)
    held, planned = got["tensors"]["Total"], got["plan"]["planned"]
    assert planned == pytest.approx(held, rel=0.15), (planned, held, got["tensors"])
    assert got["losses"][-1] < got["losses"][0]  # it trained


@pytest.mark.extended
@pytest.mark.slow
def test_a_zero2_step_holds_its_gradients_only_under_accumulation():
    """bench/memory_timing.py: a 27M-weight Llama fully fine-tuned through DeepSpeed ZeRO-2
    (the product's preset) on CPU, the peak of live tensors (PyTorch's MemTracker) of a step
    of one micro batch and of two: the second is higher by the gradients' bytes (the first
    micro batch's, beside the second one's activations), the first holds none at its peak;
    the plan less its margin within 10% of both (measured: +1.9% and +1.7%)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench/memory_timing.py"), "--json"],
                          capture_output=True, text=True, env=ENV, timeout=900,
                          check=True)  # fmt: skip
    got = json.loads(proc.stdout)
    grads = 4 * got["cases"]["1"]["params"] / 2**20  # fp32 gradients of every weight
    assert got["measured_step_up_mib"] == pytest.approx(grads, rel=0.05), got
    assert got["planned_step_up_mib"] == pytest.approx(grads, rel=0.05), got
    for case in got["cases"].values():
        assert case["plan_total_mib"] == pytest.approx(case["peak_mib"]["Total"], rel=0.10), case
        assert case["losses"][-1] < case["losses"][0]  # it trained


def test_cpu_memory_per_node_is_counted_in_the_run_s_precision():
    """A bf16 checkpoint (Llama-3.1-70B's) trained in fp32: each of a node's 4 processes
    converts the whole model to 4 bytes a weight before DeepSpeed moves it; trained in bf16
    (the checkpoint's own dtype) it stays memory-mapped and each process holds its largest
    layer at a time; a 4-bit base streams the same way."""
    from snaketune.budget.memplan import cpu_per_node

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-70B-Instruct"])
    assert shape.saved_bytes == 2
    s = setup(adapter="lora", lora_r=16, nodes=1, gpus_per_node=4, bytes_per_weight=4)
    assert cpu_per_node(shape, s) == shape.params * 4 * 4
    assert cpu_per_node(shape, replace(s, bytes_per_weight=2)) == shape.largest_layer * 2 * 4
    assert cpu_per_node(shape, replace(s, quantized=True)) == shape.largest_layer * 4 * 4


def saved_bytes(model, micro: int, length: int) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward of ``model`` on
    ``micro`` x ``length`` tokens (its weights left out, each storage counted once): what
    the plan's activations count, read from torch, not from the plan's formula."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(
        0, model.config.vocab_size, (micro, length), generator=torch.Generator().manual_seed(0)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())


def tiny_llama(layers: int, attention: str, **sizes):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(num_hidden_layers=layers, attn_implementation=attention, **sizes)
    )
    return model.train()


# hidden, MLP, heads, KV heads: grouped-query attention, every head its own KV, an odd width
LAYER_SIZES = [(64, 176, 4, 2), (128, 320, 8, 8), (96, 256, 6, 2)]


@pytest.mark.parametrize("hidden,ffn,heads,kv_heads", LAYER_SIZES)
def test_a_layer_s_activations_are_what_autograd_keeps_for_backward(hidden, ffn, heads, kv_heads):
    """A decoder layer's share of the plan's activations (sdpa, no checkpointing, fp32), per
    token, against the bytes autograd saves for backward in a Llama of 4 layers less one of
    2 (their difference: two layers, the embeddings and logits cancelled): never under it
    (a plan under the truth is an out-of-memory), at most 12% over (measured: +4.5%, +9.6%,
    +3.0%)."""
    sizes = dict(vocab_size=256, hidden_size=hidden, intermediate_size=ffn,
                 num_attention_heads=heads, num_key_value_heads=kv_heads)  # fmt: skip
    two, four = tiny_llama(2, "sdpa", **sizes), tiny_llama(4, "sdpa", **sizes)
    micro, length = 2, 64
    measured = (saved_bytes(four, micro, length) - saved_bytes(two, micro, length)) / 2
    s = setup(nodes=1, gpus_per_node=1, micro_batch_size=micro, max_length=length,
              bytes_per_weight=4, liger=True)  # fmt: skip
    planned = activations(Shape.from_config(four.config.to_dict()), s) - activations(
        Shape.from_config(two.config.to_dict()), s
    )
    planned /= 2
    assert measured <= planned <= 1.12 * measured, (planned, measured, planned / measured)


def test_a_gpu_is_named_by_its_table_name_or_its_gib():
    from snaketune.budget.memplan import GPUS, gpu_memory

    assert gpu_memory(None) is None
    assert gpu_memory("H100-80GB") == GPUS["h100-80gb"]  # any case
    assert gpu_memory(94) == 94.0 and isinstance(gpu_memory(94), float)
    assert gpu_memory(39.5) == 39.5
    with pytest.raises(UserError) as e:
        gpu_memory("h100")
    assert "'h100' is not a known GPU" in str(e.value) and "h100-80gb" in str(e.value)
    assert "gpu: 94" in str(e.value)


def test_zero1_partitions_the_optimizer_and_keeps_an_fp32_master_even_of_fp32_weights():
    """ZeRO-1 splits Adam's states (fp32 master, two moments: 12 bytes a weight) over the
    GPUs and keeps the gradients whole; plain data parallelism (stage 0) in fp32 steps the
    weights themselves, Adam's two moments alone (8 bytes, what torch's AdamW holds)."""
    import torch

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.2-1B"])
    p, n = shape.params, 16
    for w in (2, 4):
        one = model_states(shape, setup(stage=1, bytes_per_weight=w))
        assert one["optimizer"] == pytest.approx(12 * p / n)
        assert one["gradients"] == pytest.approx((w + 4 if w == 2 else 4) * p)
    for stage in (2, 3):  # a ZeRO optimizer's fp32 partition, even of fp32 weights
        fp32 = model_states(shape, setup(stage=stage, bytes_per_weight=4))
        assert fp32["optimizer"] == pytest.approx(12 * p / n)
    zero = model_states(shape, setup(stage=0, bytes_per_weight=4))
    assert zero["optimizer"] == pytest.approx(8 * p)
    # torch's AdamW on fp32 weights: exp_avg and exp_avg_sq, 8 bytes a weight
    weight = torch.nn.Parameter(torch.zeros(1000))
    adam = torch.optim.AdamW([weight])
    weight.grad = torch.ones(1000)
    adam.step()
    state = adam.state[weight]
    assert sum(v.numel() * v.element_size() for v in state.values() if v.dim()) == 8 * 1000


def test_the_margin_is_the_cuda_context_and_a_tenth_of_the_rest():
    """1.5 GiB of CUDA context and 10% of everything else for the allocator's
    fragmentation (docs/slurm.md's plan), whatever the run."""
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    for s in (setup(), setup(adapter="lora", lora_r=16, gradient_checkpointing=True)):
        got = estimate(shape, s)
        body = sum(v for k, v in got.items() if k not in ("margin", "total"))
        assert got["margin"] == pytest.approx(1.5 + 0.1 * body, abs=0.02)
        assert got["total"] == pytest.approx(body + got["margin"], abs=0.02)


def test_reward_models_are_held_whole_on_every_gpu_in_the_run_s_precision():
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    s = setup(adapter="lora", lora_r=16, completion_length=256, stage=3)
    assert "reward_models" not in estimate(shape, s)
    for w in (2, 4):
        got = estimate(shape, replace(s, reward_model_params=1_240_000_000, bytes_per_weight=w))
        assert got["reward_models"] == round(1_240_000_000 * w / 2**30, 2)  # not split by ZeRO-3


def test_a_live_teacher_is_held_whole_or_sharded_over_the_gpus_under_zero3():
    """On-policy distillation's teacher (snaketune.methods.opd): in the run's precision,
    whole on every GPU under ZeRO-0 to 2, split over every GPU of the run under ZeRO-3 (as
    DeepSpeed shards it with the student)."""
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.2-1B-Instruct"])
    teacher = 8_030_000_000
    for stage, share in ((0, 1), (2, 1), (3, 16)):
        s = setup(stage=stage, completion_length=256)  # 2 nodes x 8 GPUs
        assert "teacher" not in estimate(shape, s)
        for w in (2, 4):
            got = estimate(shape, replace(s, teacher_params=teacher, bytes_per_weight=w))
            assert got["teacher"] == round(teacher / share * w / 2**30, 2), (stage, w)


def test_offloaded_states_are_counted_in_cpu_memory_per_node():
    """Offload puts Adam's fp32 master and moments and the fp32 gradients (16 bytes a trained
    weight) in CPU memory, and with offload_params the 16-bit weights (2 bytes a weight),
    split over the nodes, times DeepSpeed's buffer factor (1.5); a LoRA run trains its
    adapters only, whose states are too small to count. The adapter's name is built at
    run time, as YAML's are (an ``is`` against the code's literal fails)."""
    from snaketune.budget.memplan import cpu_per_node, cpu_why

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    p = shape.params
    full = "".join(["fu", "ll"])
    optim = setup(adapter=full, stage=2, nodes=2, offload_optimizer=True)
    assert model_states(shape, setup(adapter=full))["optimizer"] == pytest.approx(12 * p / 16)
    assert cpu_per_node(shape, optim) == pytest.approx(16 * p / 2 * 1.5)
    assert "the states offloaded to CPU memory" in cpu_why(shape, optim)
    both = setup(adapter=full, stage=3, nodes=4, offload_optimizer=True, offload_params=True)
    assert cpu_per_node(shape, both) == pytest.approx((16 + 2) * p / 4 * 1.5)
    lora = setup(adapter="lora", lora_r=16, stage=3, nodes=2, offload_optimizer=True)
    assert cpu_per_node(shape, lora) == 0
    assert cpu_per_node(shape, replace(lora, offload_params=True)) == pytest.approx(2 * p / 2 * 1.5)


def test_sequence_parallel_splits_the_activations_and_logits_of_each_sequence():
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    s = setup(max_length=8192, micro_batch_size=1)
    for checkpointed in (False, True):
        one = replace(s, gradient_checkpointing=checkpointed)
        assert activations(shape, replace(one, sequence_parallel=4)) == pytest.approx(
            activations(shape, one) / 4
        )


def test_eager_attention_keeps_every_layer_s_scores_and_checkpointing_one_layer_s():
    """The eager kernel's score matrices (micro batch x heads x length^2 a layer) against
    what autograd saves for backward (measured: 1.23 of one such matrix a layer: the
    softmax's output and a little more; the plan counts two, the scores and their
    softmax on a GPU): never under it, at most twice it. A linear attention layer keeps
    none; under gradient checkpointing one layer's at a time."""
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    micro, length = 2, 64
    measured = (
        saved_bytes(tiny_llama(2, "eager", **sizes), micro, length)
        - saved_bytes(tiny_llama(2, "sdpa", **sizes), micro, length)
    ) / 2
    shape = Shape.from_config(tiny_llama(2, "sdpa", **sizes).config.to_dict())
    s = setup(nodes=1, gpus_per_node=1, micro_batch_size=micro, max_length=length,
              bytes_per_weight=4, liger=True)  # fmt: skip
    eager = "".join(["ea", "ger"])  # built at run time, as YAML's strings are
    planned = (activations(shape, replace(s, attention=eager)) - activations(shape, s)) / 2
    assert measured <= planned <= 2 * measured, (planned, measured)
    # Qwen3.5: 8 of its 32 layers full attention, 24 linear ones (no scores)
    qwen = Shape.from_config(VLM_SHAPES["Qwen/Qwen3.5-9B"])
    q = setup(max_length=1024, micro_batch_size=3)
    eager = activations(qwen, replace(q, attention="eager")) - activations(qwen, q)
    full = activations(shape, replace(s, attention="eager")) - activations(shape, s)
    # 8 layers x 2 matrices x micro batch 3 x heads x length^2 x 2 bytes (bf16); the tiny
    # Llama's: 2 layers x 2 matrices x micro x 4 heads x length^2 x 4 bytes (fp32)
    assert eager == 8 * 2 * 3 * qwen.heads * 1024**2 * 2
    assert full == 2 * 2 * micro * 4 * 64**2 * 4
    # checkpointed: one layer's scores beside the checkpoints, whatever the layer count
    for model in (shape, qwen):
        for base in (s, q):
            ck = replace(base, gradient_checkpointing=True)
            one = activations(model, replace(ck, attention="eager")) - activations(model, ck)
            every = activations(model, replace(base, attention="eager")) - activations(model, base)
            kinds = model.attention_layers
            assert one == pytest.approx(every / (kinds["full"] + kinds["sliding"]))


@pytest.mark.parametrize("hidden,ffn,heads,kv_heads", LAYER_SIZES[:2])
def test_a_checkpointed_layer_keeps_its_input_alone(hidden, ffn, heads, kv_heads):
    """Under gradient checkpointing autograd keeps each layer's input (hidden x tokens) and
    recomputes the rest in backward, one layer at a time: the plan's per-layer share is
    what torch's checkpoint saves of a Llama of 4 layers less one of 2, to the byte."""
    sizes = dict(vocab_size=256, hidden_size=hidden, intermediate_size=ffn,
                 num_attention_heads=heads, num_key_value_heads=kv_heads)  # fmt: skip
    two, four = tiny_llama(2, "sdpa", **sizes), tiny_llama(4, "sdpa", **sizes)
    for model in (two, four):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    micro, length = 2, 64
    measured = (saved_bytes(four, micro, length) - saved_bytes(two, micro, length)) / 2
    s = setup(nodes=1, gpus_per_node=1, micro_batch_size=micro, max_length=length,
              bytes_per_weight=4, liger=True, gradient_checkpointing=True)  # fmt: skip
    planned = activations(Shape.from_config(four.config.to_dict()), s) - activations(
        Shape.from_config(two.config.to_dict()), s
    )
    assert planned / 2 == measured == micro * length * hidden * 4


def test_a_4bit_base_dequantizes_its_largest_linear_for_each_matmul():
    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    s = setup(adapter="lora", lora_r=16, gradient_checkpointing=True)
    extra = activations(shape, replace(s, quantized=True)) - activations(shape, s)
    assert extra == 2 * 4096 * 14336  # the MLP's 4096 x 14336, in bf16


def test_grpo_logits_are_the_completions_and_the_kv_cache_what_generation_holds():
    """GRPO scores its completions only: the logits follow micro batch x completion
    tokens, not the prompt. Without vLLM the rollouts' KV cache (every non-linear layer's
    keys and values of every token) is held while generating, not beside training's
    activations: the plan takes the larger; the cache's bytes are those of the cache
    transformers fills (a tiny Llama's forward with use_cache)."""
    import torch

    shape = Shape.from_config(SHAPES["meta-llama/Llama-3.1-8B-Instruct"])
    s = setup(adapter="lora", lora_r=16, max_length=512, completion_length=1024, micro_batch_size=4)
    logits = activations(shape, s) - activations(shape, replace(s, liger=True))
    longer_prompt = replace(s, max_length=2048)
    assert logits == activations(shape, longer_prompt) - activations(
        shape, replace(longer_prompt, liger=True)
    )
    assert logits == pytest.approx(4 * 1024 * shape.vocab * (2 + 8))
    # a deep, narrow Llama (every head its own KV) whose cache outweighs what training
    # keeps under checkpointing and liger: the plan is the cache transformers fills
    model = tiny_llama(24, "sdpa", vocab_size=256, hidden_size=32, intermediate_size=32,
                       num_attention_heads=4, num_key_value_heads=4).eval()  # fmt: skip
    micro, prompt, completion = 3, 40, 24
    ids = torch.zeros((micro, prompt + completion), dtype=torch.long)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    held = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
    )
    tiny = Shape.from_config(model.config.to_dict())
    g = setup(nodes=1, gpus_per_node=1, micro_batch_size=micro, max_length=prompt,
              completion_length=completion, bytes_per_weight=4, liger=True,
              gradient_checkpointing=True)  # fmt: skip
    assert activations(tiny, g) == held == 24 * 2 * 32 * 4 * micro * (prompt + completion)
    # with vLLM the cache is vLLM's (its share of the GPU); without completions (not GRPO)
    # nothing is generated: training's activations alone, under the cache here
    assert activations(tiny, replace(g, vllm_share=0.5)) < held
    sft = replace(g, max_length=prompt + completion, completion_length=0)
    assert activations(tiny, sft) < held
    assert activations(tiny, sft) == activations(tiny, replace(g, vllm_share=0.5))

    # linear attention layers keep a fixed state, no cache: with 2 of 24 the cache is 22
    # layers' (still over what training keeps); with half of them, it is under it
    def hybrid(linear: int) -> Shape:
        kinds = ["linear_attention"] * linear + ["full_attention"] * (24 - linear)
        return Shape.from_config({**model.config.to_dict(), "layer_types": kinds})

    assert hybrid(2).attention_layers == {"full": 22, "sliding": 0, "linear": 2}
    assert activations(hybrid(2), g) == held * 22 / 24
    half = hybrid(12)
    training = activations(half, replace(g, vllm_share=0.5))  # vLLM holds the cache
    assert activations(half, g) == training > held * 12 / 24


def test_eager_attention_keeps_a_sliding_window_layer_s_whole_score_matrix():
    """transformers' eager kernel applies a sliding window as a mask on the whole
    length x length matrix: a Gemma 3 whose layers slide (window 16 of 64 tokens) keeps
    what the same model with full attention keeps for backward, to the byte, and the plan
    counts it so (it counted length x window, a quarter here: Gemma 3's 1,024-token window
    at 8,192 tokens was an eighth of the truth)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def gemma(kinds: list[str]):
        torch.manual_seed(0)
        config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, sliding_window=16,
                                  layer_types=kinds, attn_implementation="eager")  # fmt: skip
        return Gemma3ForCausalLM(config).train()

    sliding, full = gemma(["sliding_attention"] * 2), gemma(["full_attention"] * 2)
    assert saved_bytes(sliding, 2, 64) == saved_bytes(full, 2, 64)
    s = setup(nodes=1, gpus_per_node=1, micro_batch_size=2, max_length=64,
              bytes_per_weight=4, liger=True, attention="eager")  # fmt: skip
    plans = [Shape.from_config(m.config.to_dict()) for m in (sliding, full)]
    assert plans[0].attention_layers["sliding"] == 2 and plans[0].window == 16
    assert activations(plans[0], s) == activations(plans[1], s)
