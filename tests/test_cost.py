"""What a run will cost before it is queued (snaketune.budget.cost): its steps from the data
and the batch, the advice on them, the train stage's time from a calibration or from its
FLOPs at an assumed MFU, continuations against the job's time limit, and the estimate's
error once the run has finished. The figures are checked against arithmetic written out
here."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snaketune.core.modelshape import Shape

ROOT = Path(__file__).resolve().parents[1]
# a Llama-3.1-8B's config.json (the fields the plan reads)
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
            "head_dim": 128, "torch_dtype": "bfloat16"}  # fmt: skip


def config_with(tmp_path: Path, rows: int, models: dict | None = None, **run) -> dict:
    """A validated config: model m (LLAMA_8B's config.json) and ``models``, a local jsonl of
    ``rows`` prompt/response rows of unequal length (dataset d), an eval set of 50 rows (e),
    run x with ``run``."""
    from snaketune.plan.config import validate_config

    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m/config.json").write_text(json.dumps(LLAMA_8B))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": "q" * (i % 7 + 1), "response": "a"}) + "\n"
                            for i in range(rows)))  # fmt: skip
    held = tmp_path / "eval.jsonl"  # an eval set of 50 rows
    held.write_text("".join(json.dumps({"prompt": "q", "response": "a"}) + "\n"
                            for _ in range(50)))  # fmt: skip
    written = {"nodes": 2, "gpus_per_node": 4, "max_length": 256, "micro_batch_size": 4,
               "learning_rate": 1e-4, "epochs": 2, "method": "lora", **run}  # fmt: skip
    if "max_steps" in run:
        del written["epochs"]
    config = {"models": {"m": {"source": "local", "path": str(tmp_path / "m")}, **(models or {})},
              "datasets": {"d": {"source": "local", "path": str(data),
                                 "format": "prompt_response"},
                           "e": {"source": "local", "path": str(held),
                                 "format": "prompt_response"}},
              "runs": {"x": {"model": "m", "dataset": "d", **written}}}  # fmt: skip
    return validate_config(config, ROOT)


def test_steps_per_epoch_are_the_examples_over_one_step_s_examples(tmp_path):
    from snaketune.budget.cost import format_steps, steps_of

    config = config_with(tmp_path, 1000, gradient_accumulation_steps=2)
    s = steps_of(config, "x", tmp_path)
    # 4 a micro batch x 2 accumulated x 8 GPUs = 64 a step; 1000 // 64 = 15 (the rest left
    # out, as the shard plan does), 2 epochs
    assert (s["per_step"], s["steps_per_epoch"], s["steps"]) == (64, 15, 30)
    assert s["basis"].startswith("about, from the source rows") and s["warnings"] == []
    (line,) = format_steps("x", s)
    assert line.startswith("x: 30 optimizer steps (15 per epoch x 2 epochs; 1,000 examples")
    # the tokenized set, once made, is counted instead (overlong rows dropped)
    from snaketune.plan.stages import tokenized

    path = tmp_path / tokenized(config, "x")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"length": list(range(100, 740))}), path)
    s = steps_of(config, "x", tmp_path)
    assert (s["examples"], s["steps_per_epoch"], s["basis"]) == (640, 10, "the tokenized set")
    config["runs"]["x"]["max_steps"] = 25
    del config["runs"]["x"]["epochs"]
    assert steps_of(config, "x", tmp_path)["steps"] == 25


def test_max_steps_fixes_the_steps_and_their_time_before_the_data_is_there(tmp_path):
    """A Hub dataset not downloaded (offline): with max_steps the steps are known, and so is
    the FLOPs estimate (every example at max_length, as before tokenization); with epochs
    they are not counted yet."""
    from snaketune.budget.cost import ASSUMED_MFU, estimate, format_steps, steps_of

    config = config_with(tmp_path, 100, gpu="a100-80gb", max_steps=400)
    config["datasets"]["d"] = {"source": "hub", "id": "someone/qa", "format": "prompt_response"}
    s = steps_of(config, "x", tmp_path)
    assert (s["steps"], s["examples"], s["per_step"]) == (400, None, 32)
    (line,) = format_steps("x", s)
    assert line == ("x: 400 optimizer steps (max_steps (the dataset is not downloaded: its "
                    "epochs not counted yet); 32 a step)")  # fmt: skip
    e = estimate(config, "x", tmp_path, Shape.from_config(LLAMA_8B), s)
    h, layers = 4096, 32
    n = layers * (2 * h * h + 2 * h * 1024 + 3 * h * 14336) + 128256 * h
    flops = 4 * n * 256 * 32 + 6 * layers * h * 256**2 * 32  # 32 examples at max_length 256
    assert e["train_s"] == pytest.approx(400 * flops / (8 * 312e12 * ASSUMED_MFU["lora"]), rel=1e-3)
    config["runs"]["x"]["epochs"] = 2  # epochs instead: the steps wait for the data
    del config["runs"]["x"]["max_steps"]
    s = steps_of(config, "x", tmp_path)
    assert "steps" not in s and format_steps("x", s) == [
        "x: steps: not counted yet: datasets.d is not downloaded and this machine is offline "
        "(HF_HUB_OFFLINE is set); set datasets.d.size (rows, and tokens for a text set: its "
        "card's figures)"
    ]


def test_a_hub_set_s_steps_before_its_download_are_its_stated_or_carded_rows(tmp_path,
                                                                             monkeypatch):  # fmt: skip
    """Before a Hub dataset is downloaded its rows are the ones its `size` states, else the
    split's num_examples on its card where the Hub answers (a Hub on localhost here): the
    steps are counted from them, said so; the rows downloaded replace both. A text set's
    stated documents and tokens become rows by their pieces at max_length (lengths taken
    as exponential around their mean)."""
    import math

    from hubserver import FakeHub
    from huggingface_hub import constants

    from snaketune.budget.cost import steps_of
    from snaketune.plan import corpus
    from snaketune.plan.config import validate_config

    raw = config_with(tmp_path, 100, gpu="a100-80gb")
    hub = {"source": "hub", "id": "org/qa", "split": "train", "format": "prompt_response"}
    raw["datasets"]["d"] = {**hub, "size": {"rows": 7473}}
    config = validate_config(raw, ROOT)
    s = steps_of(config, "x", tmp_path)  # 32 a step: 4 a micro batch x 8 GPUs
    assert (s["examples"], s["steps_per_epoch"], s["steps"]) == (7473, 233, 466)
    assert s["basis"] == "datasets.d.size: 7,473 rows"
    card = {"dataset_info": [
        {"config_name": "other", "splits": [{"name": "train", "num_examples": 5}]},
        {"config_name": "main", "splits": [{"name": "test", "num_examples": 1319},
                                           {"name": "train", "num_examples": 7473}]}]}  # fmt: skip
    raw["datasets"]["d"] = {**hub, "subset": "main"}
    config = validate_config(raw, ROOT)
    with FakeHub("org/qa", {}, card=card) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        corpus.card_rows.cache_clear()
        s = steps_of(config, "x", tmp_path)
        corpus.card_rows.cache_clear()
    assert (s["examples"], s["basis"]) == (7473, "org/qa's card on the Hub: 7,473 rows")
    raw["datasets"]["d"] = {**hub, "format": "text", "size": {"rows": 1000, "tokens": 3e6}}
    config = validate_config(raw, ROOT)
    s = steps_of(config, "x", tmp_path)  # a mean of 3,000 tokens at max_length 256
    assert s["examples"] == round(1000 / (1 - math.exp(-256 / 3000)))
    assert "1,000 documents, 3,000,000 tokens" in s["basis"]
    # the pipeline's stages count its download (its text at 4 bytes a token, at the Hub
    # rate) and its tokenization from the stated tokens
    from snaketune.budget import stagecost as sc

    shared = sc.shared_stages(config, {"x": Shape.from_config(LLAMA_8B)}, tmp_path)
    assert shared["download_dataset d"]["s"] == pytest.approx(3e6 * 4 / 100e6)
    (tok,) = [v for k, v in shared.items() if k.startswith("tokenize_dataset d__")]
    assert "about 3.0M tokens (the tokens datasets.d.size states)" in tok["basis"]
    from snaketune.plan.stages import download_spec

    assert "size" not in download_spec(config["datasets"]["d"])  # no job reruns for it


def test_the_assumed_rates_are_the_ones_docs_benchmarks_md_states():
    """Each rate a plan assumes without a calibration (snaketune.budget.rates) is the figure
    docs/benchmarks.md's table of assumed rates gives for it, in its unit."""
    import re

    from snaketune.budget import rates

    text = (ROOT / "docs/benchmarks.md").read_text()
    stated = dict(re.findall(r"^\| `([A-Z_]+)` \| ([0-9.,]+) ?(?:MB/s|%)", text, flags=re.M))
    assert rates.MB == 1e6
    assert float(stated["DOWNLOAD_MB_S"]) == rates.DOWNLOAD_MB_S
    assert float(stated["DISK_MB_S"]) == rates.DISK_MB_S
    assert float(stated["DECODE_SHARE"]) / 100 == rates.DECODE_SHARE
    assert float(stated["FORWARD_MFU"]) / 100 == pytest.approx(rates.FORWARD_MFU, abs=5e-4)
    per_layer, per_step = rates.DECODE_FLOOR_S["cpu"]
    assert (f"| `DECODE_FLOOR_S` | {per_layer * 1e3:.2f} ms a layer + {per_step * 1e3:.1f} ms a "
            f"step (CPU); {rates.DECODE_FLOOR_S['gpu'][0] * 1e3:.2f} ms a layer (GPU) |") in text  # fmt: skip
    assert f"| `STARTUP_S` | {rates.STARTUP_S:g} s," in text
    assert (f"| `CPU_S_PER_TOKEN`, `CPU_FLOP_S` | {rates.CPU_S_PER_TOKEN * 1e6:g} us a token, "
            f"{rates.CPU_FLOP_S / 1e9:g} GFLOP/s |") in text  # fmt: skip
    assert (f"| `JOB_START_S`, `DATA_JOB_START_S` | {rates.JOB_START_S:g} s, "
            f"{rates.DATA_JOB_START_S:g} s |") in text  # fmt: skip
    assert f"| `CPU_STEP_S` | {rates.CPU_STEP_S:g} s a step |" in text
    assert f"| `GENERATING_STARTUP_S` | {rates.GENERATING_STARTUP_S:g} s |" in text
    from snaketune.budget import tokenizeplan as plan

    per_row = plan.CLEAN_S_PER_ROW
    assert (f"(`snaketune.budget.tokenizeplan`) | {per_row['sign'] * 1e6:g} us a row (a signature "
            f"job), {per_row['gather'] * 1e6:g} us a row (the gather), "
            f"{plan.CLEAN_JOB_START_S:g} s a job's start |") in text  # fmt: skip


@pytest.mark.parametrize("rows, run, said", [
    (40, {}, ["one optimizer step per epoch", "2 optimizer step(s) in all: fewer than 10"]),
    (400, {"epochs": 1, "warmup_ratio": 1.0}, ["warmup_ratio 1.0 of 12 steps is the whole run"]),
    (3000, {}, []),
])  # fmt: skip
def test_few_steps_and_a_warmup_over_the_whole_run_are_warned_about(tmp_path, rows, run, said):
    from snaketune.budget.cost import steps_of

    warnings = steps_of(config_with(tmp_path, rows, **run), "x", tmp_path)["warnings"]
    assert [w[: len(s)] for w, s in zip(warnings, said, strict=False)] == said, warnings
    assert len(warnings) == len(said)


def test_fewer_examples_than_one_step_is_refused_before_queueing(tmp_path):
    from snaketune.budget.planlines import check_steps

    config = config_with(tmp_path, 20)
    (line,) = check_steps(config, {"x": None}, tmp_path)
    assert line.startswith("runs.x: 20 examples (about, from the source rows") and (
        "fewer than one optimizer step takes (32" in line)  # fmt: skip


def test_the_assumed_mfu_of_each_update_is_the_measured_one_in_the_benchmarks():
    """The MFU a plan assumes before a calibration, per kind of update, is what the product's
    GPU check measured: the figures of docs/benchmarks.md's measured table (its first GPU
    heading's rows for full fine-tuning and LoRA), and the basis names where from."""
    import re

    from snaketune.budget.cost import ASSUMED_MFU, MFU_SOURCE

    text = (ROOT / "docs/benchmarks.md").read_text()
    section = text[text.index("### Measured: one NVIDIA H200, 2026-11-28") :]
    measured = {}
    for kind, label in (("full", "full fine-tuning"), ("lora", "LoRA r16, all linear")):
        row = re.search(rf"^\| {re.escape(label)} \|([^\n]*)$", section, flags=re.M)
        cells = [c.strip() for c in row.group(1).split("|")]
        measured[kind] = float(cells[2].rstrip("%")) / 100  # tokens/s, step s, MFU
    assert measured == pytest.approx(ASSUMED_MFU, abs=5e-4)
    assert "H200" in MFU_SOURCE and "2026-11-28" in MFU_SOURCE


def test_a_gpu_run_without_calibration_is_its_flops_at_the_assumed_mfu(tmp_path):
    from snaketune.budget.cost import ASSUMED_MFU, estimate, format_estimate, steps_of
    from snaketune.plan.stages import tokenized

    config = config_with(tmp_path, 1000, gpu="a100-80gb")
    path = tmp_path / tokenized(config, "x")
    path.parent.mkdir(parents=True)
    lengths = [200 + (i % 50) for i in range(1000)]
    pq.write_table(pa.table({"length": lengths}), path)
    s = steps_of(config, "x", tmp_path)
    shape = Shape.from_config(LLAMA_8B)
    e = estimate(config, "x", tmp_path, shape, s)
    # by hand: N = the 8B's matmul weights (all but the input embedding): 32 layers of
    # attention (q, o: 4096^2; k, v: 4096 x 1024) and MLP (3 x 4096 x 14336), the head
    h, layers = 4096, 32
    n = layers * (2 * h * h + 2 * h * 1024 + 3 * h * 14336) + 128256 * h
    per = 4 * 8  # examples a step: 4 a micro batch x 8 GPUs
    mean = sum(lengths) / len(lengths)
    squares = sum(x * x for x in lengths) / len(lengths)
    flops = 4 * n * mean * per + 6 * layers * h * squares * per  # LoRA: 4N per token
    want = s["steps"] * flops / (8 * 312e12 * ASSUMED_MFU["lora"])
    assert e["train_s"] == pytest.approx(want, rel=1e-3)
    assert e["gpu_hours"] == pytest.approx(e["wall_s"] * 8 / 3600)
    line = format_estimate("x", e, 8)
    assert "assumed MFU 25.2% of a100-80gb's 312 TFLOP/s a GPU (measured on one H200" in line
    assert "GPU-hours" in line
    config["runs"]["x"]["gpu"] = None
    del config["runs"]["x"]["gpu"]
    e = estimate(config, "x", tmp_path, shape, s)
    # a CPU run before a calibration: its update at this machine's assumed rate, 59 us a
    # token and 4N FLOPs a token (LoRA) at 135 GFLOP/s, its start-up assumed (9 s and
    # the weights at 500 MB/s), no GPU-hours
    rate = 1 / (59e-6 + 4 * n / 1.35e11)
    assert e["train_s"] == pytest.approx(s["steps"] * mean * per / rate, rel=1e-4)  # norms
    assert e["outside_s"] == pytest.approx(9.0 + LLAMA_8B_PARAMS * 2 / 500e6)
    assert e["gpu_hours"] is None and e["basis"].startswith("not calibrated: this CPU's")
    # the run itself finished here (a dry run after it): said so, not "no finished run"
    finished(tmp_path, "x", config["runs"]["x"], 80.0, 45.0, 1_280_000, 20, 40, "cpu", LLAMA_8B)
    e = estimate(config, "x", tmp_path, shape, s)
    assert "wall_s" not in e and e["basis"].startswith("no estimate: run x has finished here")


def llama_params(c: dict) -> int:
    """A Llama's weights counted by hand from its config.json: the embedding (and an untied
    head), each layer's q, k, v, o, three MLP matrices and two norms, the final norm."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["vocab_size"] * h + head + c["num_hidden_layers"] * layer + h


@pytest.mark.parametrize("method", ["opd", "grpo"])
def test_a_generating_run_s_step_is_its_generation_scoring_and_training_by_hand(tmp_path,
                                                                                method):  # fmt: skip
    """Before a calibration, a GPU run that generates while it trains is estimated step by
    step: every GPU decoding its micro batches' completions at their limit (a decode step the
    largest of the student's bf16 bytes at half an H100's 3.35 TB/s, its FLOPs, and
    generate()'s floor of 19.7 ms over gemma-2b's 18 layers a layer: the floor, 16 layers;
    opd's lmbda the share of steps that generate), a forward pass of what scores them (opd: its teacher, the 8B; GRPO with
    beta > 0: the reference, the student's size) and the training over prompt plus
    completion, each at its assumed MFU of 989 TFLOP/s a GPU. opd: LoRA on a 1B-shaped
    student with a tied head; GRPO: a full fine-tune of one with its own head. Before
    tokenization every prompt is max_length long."""
    from snaketune.budget.cost import estimate, format_estimate, steps_of
    from snaketune.plan.stages import tokenized

    lora = method == "opd"
    small = {**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64,
             "num_hidden_layers": 16, "tie_word_embeddings": lora}  # fmt: skip
    (tmp_path / "t").mkdir()
    (tmp_path / "t/config.json").write_text(json.dumps(LLAMA_8B))
    block = ({"opd": {"teacher": "t", "max_completion_length": 128, "lmbda": 0.5},
              "lora": {"r": 16}}
             if lora else
             {"grpo": {"num_generations": 4, "max_completion_length": 128, "beta": 0.04}})  # fmt: skip
    teacher = {"t": {"source": "local", "path": str(tmp_path / "t")}}
    config = config_with(tmp_path, 1000, teacher, **{"method": method, **block},
                         gpu="h100-80gb", gradient_accumulation_steps=2)  # fmt: skip
    (tmp_path / "m/config.json").write_text(json.dumps(small))
    shape = Shape.from_config(small)
    rows = 1 if lora else 4  # completions of a prompt
    prompts = 8 * 2 * 4 // rows  # a step's: 8 GPUs x 2 micro batches x 4 rows
    student, teacher = llama_params(small), llama_params(LLAMA_8B)
    share = 0.5 if lora else 1.0
    scored = teacher if lora else student

    def by_hand(lengths):
        mean = sum(lengths) / len(lengths)
        squares = sum((x + 128) ** 2 for x in lengths) / len(lengths) * prompts * rows
        tokens = (mean + 128) * prompts * rows
        n = student if lora else student - 128256 * 2048  # the input embedding: a lookup
        update = (4 if lora else 6) * n * tokens + 6 * 16 * 2048 * squares
        decode = max(student * 2 / (3.35e12 * 0.5), 2 * student * 4 / (989e12 * 0.317),
                     16 * 19.7e-3 / 18)  # fmt: skip
        assert decode == 16 * 19.7e-3 / 18  # a 1B's step: the floor, not its bytes
        return {"generation": share * 2 * 128 * decode,
                "scoring": 2 * scored * tokens / (8 * 989e12 * 0.317),
                "training": update / (8 * 989e12 * (0.252 if lora else 0.317))}  # fmt: skip

    s = steps_of(config, "x", tmp_path)  # before tokenization: each prompt max_length (256)
    e = estimate(config, "x", tmp_path, shape, s)
    for part, want in by_hand([256]).items():
        assert e["step_parts"][part] == pytest.approx(want, rel=1e-12), part
    assert "every prompt taken at max_length until the data is tokenized" in e["basis"]
    path = tmp_path / tokenized(config, "x")
    path.parent.mkdir(parents=True)
    lengths = [40 + (i % 30) for i in range(1000)]  # the prompts' tokens
    pq.write_table(pa.table({"length": lengths}), path)
    s = steps_of(config, "x", tmp_path)
    e = estimate(config, "x", tmp_path, shape, s)
    assert s["per_step"] == prompts
    want = by_hand(lengths)
    for part in want:
        assert e["step_parts"][part] == pytest.approx(want[part], rel=1e-12), part
    assert e["train_s"] == pytest.approx(s["steps"] * sum(want.values()), rel=1e-9)
    line = format_estimate("x", e, 8)
    assert (f"generation {want['generation']:.1f} s ({share:.0%} of steps, 256 decode steps "
            "a GPU of 17.5 ms: the floor of 16 layers launched (transformers' benchmark of "
            "gemma-2b in eager mode, 19.7 ms a token)") in line  # fmt: skip
    assert f"a forward pass of {scored / 1e9:.2f}B held weights" in line
    assert "GPU-hours" in line and "not calibrated" in line and "max_length" not in line
    config["runs"]["x"]["gpu"] = "tpu-v9"  # no figures known (a name from elsewhere)
    e = estimate(config, "x", tmp_path, shape, s)
    assert e == {"basis": "no estimate: no peak FLOP/s known for GPU tpu-v9"}


def test_a_gpu_s_memory_bandwidth_is_its_own_not_a_neighbour_s(monkeypatch):
    """Each GPU name the config takes, and the names torch reports for the H100's three
    forms, get their own datasheet bandwidth, not that of a name they contain (an H100 PCIe
    is not an SXM H100); a GPU whose peak is known but not its bandwidth gets no generating
    estimate, said so."""
    from snaketune.budget import rates
    from snaketune.core.throughput import peak_tflops

    datasheet = {"h200-141gb": 4.8, "h100-80gb": 3.35, "NVIDIA H100 80GB HBM3": 3.35,
                 "NVIDIA H100 PCIe": 2.0, "NVIDIA H100 NVL": 3.9, "a100-80gb": 2.04,
                 "a100-64gb": 1.64, "a100-40gb": 1.55, "NVIDIA A100-SXM4-40GB": 1.55,
                 "l40s-48gb": 0.864}  # fmt: skip
    for name, tb_s in datasheet.items():
        assert rates.bandwidth(name) == pytest.approx(tb_s * 1e12, rel=1e-12), name
    assert rates.bandwidth("80") is None and rates.bandwidth("tpu-v9") is None
    peaks = {"NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H100 80GB HBM3": 989.0,
             "h100-80gb": 989.0, "H100 PCIE": 756.0}  # fmt: skip
    for name, tflops in peaks.items():
        assert peak_tflops(name) == tflops, name
    monkeypatch.setattr(rates, "HBM_TB_S", {k: v for k, v in rates.HBM_TB_S.items() if k != "L40S"})
    from snaketune.budget.rolloutcost import step_parts

    got = step_parts(
        {"runs": {"x": {"method": "grpo"}}}, "x", Path("."), None, 1, None, "l40s-48gb"
    )
    assert got == {"basis": "no estimate: no memory bandwidth known for GPU l40s-48gb"}


def test_a_model_s_bytes_are_its_saved_dtype_s_and_bf16_when_unsaid():
    from snaketune.budget.rates import weight_bytes

    fp32 = Shape.from_config({**LLAMA_8B, "torch_dtype": "float32"})
    unsaid = Shape.from_config({k: v for k, v in LLAMA_8B.items() if k != "torch_dtype"})
    assert weight_bytes(fp32) == llama_params(LLAMA_8B) * 4
    assert weight_bytes(unsaid) == llama_params(LLAMA_8B) * 2


def finished(work: Path, run: str, spec: dict, train_s: float, outside_s: float,
             tokens_per_epoch: int, steps_per_epoch: int, steps: int, device: str,
             model: dict, **segments) -> None:  # fmt: skip
    """The files a finished run leaves that a calibration reads (``segments``: more of its
    provenance's segment figures)."""
    train = work / "results" / run / "train"
    train.mkdir(parents=True)
    (work / "results" / run / "shards").mkdir()
    (train / "run_config.json").write_text(json.dumps(spec))
    (train / "provenance.json").write_text(json.dumps({"device": device, "segments": {
        "train_s": train_s, "outside_training_s": outside_s, **segments}}))  # fmt: skip
    (train / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n"
                                                 for s in range(1, steps + 1)))  # fmt: skip
    (work / "results" / run / "shards/manifest.json").write_text(json.dumps({
        "shards": [{"tokens": tokens_per_epoch // 2}, {"tokens": tokens_per_epoch // 2}],
        "steps_per_epoch": steps_per_epoch, "global_batch": 32}))  # fmt: skip
    models = work / "resources/models" / spec["model"]
    models.mkdir(parents=True, exist_ok=True)
    (models / "config.json").write_text(json.dumps(model))


def test_a_calibration_from_a_finished_run_scales_by_tokens_and_gpus(tmp_path):
    from snaketune.budget.cost import estimate, format_estimate, steps_of
    from snaketune.plan.stages import tokenized

    config = config_with(tmp_path, 1000, gpu="h100-80gb", eval_dataset="e")
    run = config["runs"]["x"]
    path = tmp_path / tokenized(config, "x")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"length": [300] * 1000}), path)
    spec = {**run, "nodes": 1, "gpus_per_node": 4, "model": "m"}
    # measured: 40 steps of 64,000 tokens (20 steps an epoch of 1,280,000) in 80 s on 4 GPUs
    finished(tmp_path, "earlier", spec, 80.0, 45.0, 1_280_000, 20, 40, "cuda", LLAMA_8B)
    (tmp_path / "benchmarks/evaluate").mkdir(parents=True)
    (tmp_path / "benchmarks/evaluate/earlier.tsv").write_text("s\th:m:s\n30.5\t0:00:30\n")
    (tmp_path / "benchmarks/merge_lora").mkdir(parents=True)  # x is a LoRA run: it merges
    (tmp_path / "benchmarks/merge_lora/earlier.tsv").write_text("s\th:m:s\n12.0\t0:00:12\n")
    s = steps_of(config, "x", tmp_path)
    e = estimate(config, "x", tmp_path, Shape.from_config(LLAMA_8B), s)
    rate_per_gpu = 40 * 64_000 / 80.0 / 4  # tokens/s a GPU
    want = s["steps"] * (300 * 32) / (rate_per_gpu * 8)  # 32 examples of 300 a step, 8 GPUs
    assert e["train_s"] == pytest.approx(want) and e["outside_s"] == 45.0
    assert e["wall_s"] == pytest.approx(want + 45.0)
    assert e["stages"] == {"evaluate": 30.5, "merge_lora": 12.0}
    assert e["basis"] == "calibrated from run earlier"
    assert format_estimate("x", e, 8).startswith("x: train about ")
    # its other stages as the calibration's took: evaluate on the run's GPUs (eval: auto
    # on an h100-80gb: the fewest that hold the 8B, one), the run's total added up
    from snaketune.budget.stagecost import costs_of, format_costs

    c = costs_of(config, "x", Shape.from_config(LLAMA_8B), s, e, tmp_path)
    assert list(c["stages"]) == ["train", "merge_lora", "evaluate"]
    assert c["stages"]["merge_lora"]["gpu_hours"] is None  # a CPU job
    assert c["stages"]["evaluate"] == {"s": 30.5, "gpu_hours": pytest.approx(30.5 / 3600),
                                       "gpus": 1, "basis": "as run earlier's took"}  # fmt: skip
    assert c["total"]["s"] == pytest.approx(want + 45.0 + 30.5 + 12.0)
    assert c["total"]["gpu_hours"] == pytest.approx((want + 45.0) * 8 / 3600 + 30.5 / 3600)
    assert "x: evaluate: about 30 s, 0.01 GPU-hours on 1 GPU(s) (as run earlier's took)" in (
        format_costs("x", c))  # fmt: skip
    import shutil

    # another method (or adapter) on the same model calibrates it by its tokens
    # (calibrate.from_other_method); another model shape or device kind does not at all
    other = tmp_path / "o"
    other.mkdir()
    config_other = config_with(other, 1000, gpu="h100-80gb", method="full")
    finished(other, "earlier", {**spec, "method": "lora"}, 80.0, 45.0, 1_280_000, 20, 40,
             "cuda", LLAMA_8B)  # fmt: skip
    e = estimate(config_other, "x", other, Shape.from_config(LLAMA_8B),
                 steps_of(config_other, "x", other))  # fmt: skip
    assert e["basis"].startswith("calibrated from run earlier of method lora (its 32,000 ")
    assert e["outside_s"] == 45.0 and e["stages"] == {}
    for shape, device in ((dict(LLAMA_8B, num_hidden_layers=16), "cuda"), (LLAMA_8B, "cpu")):
        shutil.rmtree(other / "results/earlier")
        finished(other, "earlier", {**spec, "method": "lora"}, 80.0, 45.0, 1_280_000, 20, 40,
                 device, shape)  # fmt: skip
        e = estimate(config_other, "x", other, Shape.from_config(LLAMA_8B),
                     steps_of(config_other, "x", other))  # fmt: skip
        assert not e["basis"].startswith("calibrated"), (shape, device)


def test_a_first_jobs_op_builds_are_left_out_and_start_up_scales_with_processes_per_core(
    tmp_path, monkeypatch
):
    """A CPU calibration that was a machine's first job (72 s outside its steps: 55 s of them
    DeepSpeed's op builds, 12 s its start-up, 3 s of it the launch): the next job is
    estimated without the builds; its workers' start-up (9 s) is as measured for as many
    processes on this machine's cores, twice it for twice the processes over the cores."""
    from snaketune.budget.cost import estimate, steps_of
    from snaketune.train.segments import segments_summary

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # the segments of such a job, summed as the launcher does
    seg = segments_summary([{"began": 100.0, "ended": 177.0, "train_s": 5.0, "reason": "done",
                             "worker_started": 103.0, "first_step_at": 167.0,
                             "compile_s": 55.0}])  # fmt: skip
    assert seg == {"jobs": 1, "continuations": 0, "wall_s": 77.0, "train_s": 5.0,
                   "outside_training_s": 72.0, "compile_s": 55.0, "startup_s": 12.0,
                   "launch_s": 3.0}  # fmt: skip
    config = config_with(tmp_path, 1000)
    run = config["runs"]["x"]
    spec = {**run, "nodes": 2, "gpus_per_node": 1, "model": "m"}
    finished(tmp_path, "first", spec, 5.0, 72.0, 1_280_000, 20, 30, "cpu", LLAMA_8B,
             compile_s=55.0, startup_s=12.0, launch_s=3.0)  # fmt: skip
    shape = Shape.from_config(LLAMA_8B)
    # one node: no rendezvous poll to wait through (1 s less than the 2-node calibration)
    for (nodes, gpus), outside in {(1, 2): 16.0, (2, 1): 17.0, (1, 1): 16.0,
                                   (2, 2): 17.0 + 9.0, (1, 4): 16.0 + 9.0}.items():  # fmt: skip
        run.update(nodes=nodes, gpus_per_node=gpus)
        e = estimate(config, "x", tmp_path, shape, steps_of(config, "x", tmp_path))
        assert e["outside_s"] == pytest.approx(outside), (nodes, gpus, e)
    # a GPU calibration: each node's processes have cores of their own; one node's
    # calibration predicting four nodes adds the rendezvous poll, and four to one takes it off
    for cal_nodes, nodes, outside in ((2, 4, 17.0), (1, 4, 18.0), (4, 1, 16.0), (1, 1, 17.0)):
        gpu = tmp_path / f"g{cal_nodes}{nodes}"
        gpu.mkdir()
        config = config_with(gpu, 1000, gpu="h100-80gb")
        finished(gpu, "first", {**spec, "nodes": cal_nodes, "gpu": "h100-80gb"}, 5.0, 72.0,
                 1_280_000, 20, 30, "cuda", LLAMA_8B, compile_s=55.0, startup_s=12.0,
                 launch_s=3.0)  # fmt: skip
        config["runs"]["x"].update(nodes=nodes, gpus_per_node=8)
        e = estimate(config, "x", gpu, shape, steps_of(config, "x", gpu))
        assert e["outside_s"] == pytest.approx(outside), (cal_nodes, nodes, e)


def test_a_train_job_s_time_before_its_launcher_began_is_counted_from_its_benchmark(tmp_path):
    """The train rule's own start (its shell, Python) comes before the launcher's first
    segment: a one-job calibration adds what Snakemake's benchmark of the job measured
    beyond the segments' wall time; a run of several jobs (waits between them in its wall
    time) or without a benchmark adds nothing."""
    from snaketune.budget.cost import estimate, steps_of

    config = config_with(tmp_path, 1000, gpu="h100-80gb")
    spec = {**config["runs"]["x"], "nodes": 1, "gpus_per_node": 8, "model": "m"}
    shape = Shape.from_config(LLAMA_8B)
    for jobs, bench, outside in ((1, "73.25", 45.0 + 0.75), (2, "73.25", 45.0), (1, None, 45.0)):
        work = tmp_path / f"w{jobs}{bench}"
        work.mkdir()
        finished(work, "first", spec, 27.5, 45.0, 1_280_000, 20, 30, "cuda", LLAMA_8B,
                 jobs=jobs, wall_s=72.5)  # fmt: skip
        if bench:
            (work / "benchmarks/train").mkdir(parents=True)
            (work / "benchmarks/train/first.tsv").write_text(f"s\th:m:s\n{bench}\t0:01:13\n")
        e = estimate(config, "x", work, shape, steps_of(config, "x", work))
        assert e["outside_s"] == pytest.approx(outside), (jobs, bench, e)


def test_an_op_build_is_timed_as_one_time_and_a_cached_load_is_not(tmp_path, monkeypatch):
    """snaketune.train.startup.watch_builds around DeepSpeed's OpBuilder.jit_load: a load of
    an op torch's extension cache does not hold counts its seconds; one it holds, none."""
    import time

    from deepspeed.ops.op_builder.builder import OpBuilder

    from snaketune.train import startup

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(startup, "_BUILDS", {"compile_s": 0.0})

    def slow_load(self, verbose=True):
        time.sleep(0.2)
        return self.name

    monkeypatch.setattr(OpBuilder, "jit_load", slow_load)
    startup.watch_builds()
    startup.watch_builds()  # once: not wrapped twice

    class Op:
        name = "fake_op"

    assert OpBuilder.jit_load(Op()) == "fake_op"
    built = startup.figures(None)["compile_s"]
    assert 0.2 <= built < 1.0
    (tmp_path / "fake_op").mkdir(exist_ok=True)
    (tmp_path / "fake_op" / "fake_op.so").write_bytes(b"")
    OpBuilder.jit_load(Op())  # from the cache
    assert startup.figures(None)["compile_s"] == built
    started = startup.figures(None)["worker_started"]
    assert started is not None and started <= time.time()


LLAMA_8B_PARAMS = 8_030_261_248  # Llama-3.1-8B's parameters, as its model card states


def test_each_stage_of_a_gpu_run_without_calibration_is_worked_out_by_hand(tmp_path):
    """An 8B LoRA run on 2 x 4 A100-80GB, no calibration: each stage's seconds and GPU-hours
    from the model's bytes and FLOPs at the assumed rates, written out here; the shared
    stages (download, tokenize, the base's evaluation) once, and not at all once done."""
    from snaketune.budget import stagecost as sc
    from snaketune.budget.cost import estimate, steps_of

    config = config_with(tmp_path, 1000, gpu="a100-80gb", eval_dataset="e")
    shape = Shape.from_config(LLAMA_8B)
    assert shape.params == LLAMA_8B_PARAMS
    s = steps_of(config, "x", tmp_path)
    c = sc.costs_of(config, "x", shape, s, estimate(config, "x", tmp_path, shape, s), tmp_path)
    stages, size = c["stages"], LLAMA_8B_PARAMS * 2  # bf16 bytes
    assert list(stages) == ["shard_dataset", "train", "convert_checkpoint", "merge_lora",
                            "evaluate"]  # fmt: skip
    assert stages["merge_lora"]["s"] == pytest.approx(2 * size / 500e6)  # read + write
    assert stages["merge_lora"]["gpu_hours"] is None  # a CPU job
    # evaluate: eval: auto puts the 8B on one A100; 50 examples, 8 a batch: 7 batches of
    # 256 decode steps, each the larger of the weights read at half of 2.04 TB/s and
    # generate()'s floor (19.7 ms over gemma-2b's 18 layers a layer, 32 layers: the floor);
    # the load at 500 MB/s
    decode = 7 * 256 * max(size / (2.04e12 * 0.5), 32 * 19.7e-3 / 18)
    assert decode == pytest.approx(7 * 256 * 32 * 19.7e-3 / 18)
    assert stages["evaluate"]["s"] == pytest.approx(size / 500e6 + decode)
    assert stages["evaluate"]["gpu_hours"] == pytest.approx((size / 500e6 + decode) / 3600)
    assert stages["train"]["gpu_hours"] == pytest.approx(stages["train"]["s"] * 8 / 3600)
    assert c["total"]["s"] == pytest.approx(sum(x["s"] for x in stages.values()))
    shared = c["shared"]
    # m is a local model: copied at the disk rate (a Hub model: its download at 100 MB/s)
    assert shared["download_model m"]["s"] == pytest.approx(size / 500e6)
    assert "a local model copied" in shared["download_model m"]["basis"]
    tokenize = [k for k in shared if k.startswith("tokenize_dataset")]
    assert len(tokenize) == 2  # the training set and the eval set
    # each row's prompt and response bytes at 4 bytes a token (none near max_length), chat
    # rows at 98,000 tokens/s a core, one worker (fewer than 20,000 rows)
    train_bytes = sum(i % 7 + 1 + 1 for i in range(1000))
    assert sorted(shared[k]["s"] for k in tokenize) == pytest.approx([50 * 2 / 4 / 98_000,
                                                                      train_bytes / 4 / 98_000])  # fmt: skip
    (base,) = [k for k in shared if k.startswith("evaluate_base")]
    assert shared[base]["s"] == pytest.approx(size / 500e6 + decode)
    lines = sc.format_pipeline([c, c])  # a second run of the same base: counted once
    assert lines[-1].startswith("pipeline: every run and stage: about ")
    assert "not estimated" not in lines[-1]
    blind = {"stages": {}, "shared": {}, "total": sc.total([{}])}  # a CPU run, uncalibrated
    assert sc.format_pipeline([c, blind])[-1].endswith(
        "; 1 run(s) not estimated (their train time and stages)")  # fmt: skip
    want = 2 * c["total"]["gpu_hours"] + shared[base]["gpu_hours"]
    assert f", {want:.2f} GPU-hours" in lines[-1]
    # done: the weights downloaded, the sets tokenized, the base evaluated
    (tmp_path / "resources/models/m").mkdir(parents=True)
    (tmp_path / "resources/models/m/model.safetensors").write_bytes(b"x")
    from snaketune.plan.stages import tokenized

    for eval_set in (False, True):
        path = tmp_path / tokenized(config, "x", eval_set)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"length": [100] * 50}), path)
    key = base.split()[1]
    (tmp_path / "results/base_eval" / key).mkdir(parents=True)
    (tmp_path / "results/base_eval" / key / "metrics.json").write_text("{}")
    s = steps_of(config, "x", tmp_path)
    c = sc.costs_of(config, "x", shape, s, estimate(config, "x", tmp_path, shape, s), tmp_path)
    assert c["shared"] == {}
    # a full fine-tune converts its ZeRO checkpoint's fp32 weights and merges nothing
    (tmp_path / "f").mkdir()
    full = config_with(tmp_path / "f", 1000, gpu="a100-80gb", method="full")
    s = steps_of(full, "x", tmp_path / "f")
    c = sc.costs_of(full, "x", shape, s, estimate(full, "x", tmp_path / "f", shape, s),
                    tmp_path / "f")  # fmt: skip
    assert "merge_lora" not in c["stages"]
    assert c["stages"]["convert_checkpoint"]["s"] == pytest.approx(LLAMA_8B_PARAMS * 6 / 500e6)


def test_a_text_eval_set_is_planned_as_its_loss_with_no_decoding(tmp_path):
    """An evaluation of documents (format text) generates nothing: its stage is the model's
    load and one forward pass over its rows (2 FLOPs a weight a token, every row max_length
    long: at most, at the forward pass's assumed MFU), not 50 rows' worth of decode steps.
    The same run with a chat eval set decodes: generate()'s floor a step (32 layers)."""
    from snaketune.budget import stagecost as sc
    from snaketune.budget.cost import estimate, steps_of
    from snaketune.plan.config import validate_config

    written = config_with(tmp_path, 1000, gpu="h100-80gb", eval_dataset="e")
    size = LLAMA_8B_PARAMS * 2
    shape = Shape.from_config(LLAMA_8B)

    def evaluate(config):
        s = steps_of(config, "x", tmp_path)
        c = sc.costs_of(config, "x", shape, s, estimate(config, "x", tmp_path, shape, s),
                        tmp_path)  # fmt: skip
        return c["stages"]["evaluate"]

    chat = evaluate(written)
    assert chat["s"] == pytest.approx(size / 500e6 + 7 * 256 * 32 * 19.7e-3 / 18)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "w " * (i + 1)}) + "\n" for i in range(50)))
    raw = {**written, "datasets": {**written["datasets"],
                                   "e": {"source": "local", "path": str(docs), "format": "text"}}}  # fmt: skip
    text = evaluate(validate_config(raw, ROOT))
    forward = 2 * LLAMA_8B_PARAMS * 50 * 256 / (989e12 * 0.317)
    assert text["s"] == pytest.approx(size / 500e6 + forward)
    assert "no generation" in text["basis"] and "decode" not in text["basis"]


def test_a_corpus_s_tokenize_time_and_disk_are_its_tokens_at_a_measured_rate(tmp_path):
    """A corpus of 50,000 documents (format text): its tokens from the first 1,000 rows'
    bytes at 4 a token, at bench/corpus.py's 240,000 tokens/s a core, with a worker per
    20,000 rows a job; this machine's last tokenize job of documents (60 CPU-s or more) is
    the rate once there; the disk counts ids alone for documents (ids and labels for chat)."""
    import os

    from snaketune.budget.tokenizeplan import measured_rate, token_bytes, tokenize_cost

    config = config_with(tmp_path, 10)
    docs = [" ".join(["word"] * (i % 13 + 1)) for i in range(50_000)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config["datasets"]["t"] = {"source": "local", "path": str(tmp_path / "corpus.jsonl"),
                               "format": "text", "parts": 1}  # fmt: skip
    config["runs"]["y"] = {**config["runs"]["x"], "dataset": "t"}
    tokens = 50_000 * sum(len(d) for d in docs[:1000]) / 1000 / 4
    one = tokenize_cost(config, "t", 256, tmp_path)
    assert one["s"] == pytest.approx(tokens / (240_000 * 2))  # 2 workers of 20,000 rows
    assert "2 worker process(es) a job" in one["basis"]
    two = tokenize_cost(config, "t", 256, tmp_path, parts=2)
    assert two["s"] == pytest.approx(tokens / 2 / 240_000)  # 25,000 rows a part: 1 worker
    assert two["basis"].endswith("2 parts side by side (a part's time)")
    # the disk: the set and the shards, int32 ids; the chat run's set and shards with labels
    assert token_bytes(config, "y", tmp_path) == pytest.approx(2 * tokens * 4)
    chat_bytes = 10 * sum(i % 7 + 1 + 1 for i in range(10)) / 10 / 4
    assert token_bytes(config, "x", tmp_path) == pytest.approx(2 * chat_bytes * 8)

    # measured here: the newest job of documents that ran 60 CPU-s or more
    def job(key: str, cpu: float, tokens: int, conversations: int, age: int) -> None:
        bench = tmp_path / "benchmarks/tokenize_dataset" / f"{key}.tsv"
        bench.parent.mkdir(parents=True, exist_ok=True)
        bench.write_text(f"s\tcpu_time\n{cpu * 2}\t{cpu}\n")
        os.utime(bench, (1e9 - age, 1e9 - age))
        stats = tmp_path / "results/tokenized" / key / "stats.json"
        stats.parent.mkdir(parents=True, exist_ok=True)
        stats.write_text(json.dumps({"tokens": tokens, "conversations": conversations}))

    job("old", 120, 6_000_000, 0, age=30)  # 50,000 tokens/s
    job("chat", 100, 1_000_000, 5, age=20)  # chat rows: not the rate of documents
    job("short", 30, 3_000_000, 0, age=10)  # mostly imports: no rate
    rate, where = measured_rate(tmp_path, "documents")
    assert rate == pytest.approx(50_000) and "tokenize_dataset/old.tsv" in where
    assert measured_rate(tmp_path, "chat")[0] == pytest.approx(10_000)
    assert tokenize_cost(config, "t", 256, tmp_path)["s"] == pytest.approx(tokens / 100_000)
    part = tmp_path / "benchmarks/tokenize_part/k/00001-of-00002.tsv"  # a part's job, newer
    part.parent.mkdir(parents=True)
    part.write_text("s\tcpu_time\n70\t70\n")
    (tmp_path / "results/tokenized/k").mkdir(parents=True)
    (tmp_path / "results/tokenized/k/part-00001-of-00002.stats.json").write_text(
        json.dumps({"tokens": 7_000_000, "conversations": 0})
    )
    assert measured_rate(tmp_path, "documents")[0] == pytest.approx(100_000)


def test_the_disk_plan_counts_the_base_model_s_download_once(tmp_path):
    from snaketune.budget.diskplan import disk_plan_of, format_disk, shared_filesystems

    config = config_with(tmp_path, 1000, gpu="a100-80gb")
    config["runs"]["y"] = dict(config["runs"]["x"])
    (tmp_path / "resources/models").mkdir(parents=True)
    (tmp_path / "resources/models/m").symlink_to(tmp_path / "m")  # config.json, no weights
    plans = {n: disk_plan_of(config, n, tmp_path, ROOT) for n in ("x", "y")}
    download = plans["x"]["need_bytes"]["download"]
    assert download == LLAMA_8B_PARAMS * 2
    assert "the base model download 14.96 GiB" in format_disk("x", plans["x"])
    (group,) = shared_filesystems(plans)
    assert group["need_bytes"] == 2 * plans["x"]["need_bytes"]["total"] - download
    (tmp_path / "m/model.safetensors").write_bytes(b"x")  # downloaded: nothing to count
    assert disk_plan_of(config, "x", tmp_path, ROOT)["need_bytes"]["download"] == 0


def test_calibrate_writes_a_short_copy_of_the_run_from_its_base_model(tmp_path, capsys,
                                                                    monkeypatch):  # fmt: skip
    """`snaketune calibrate`: the run alone for N steps, its chain's model instead of the run
    it starts from, a sweep's first member, never published; the config it writes passes
    validation; an unknown run is one line."""
    import yaml

    from snaketune.app.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat.jsonl").write_text("")
    (tmp_path / "pairs.jsonl").write_text("")
    chain = yaml.safe_load(CHAIN)
    chain["runs"]["dpo"]["sweep"] = {"learning_rate": [1e-6, 2e-6], "lora.r": [8, 32]}
    chain["runs"]["dpo"]["publish"] = {"repo_id": "me/x"}
    (tmp_path / "chain.yaml").write_text(yaml.safe_dump(chain))
    assert main(["calibrate", "chain.yaml", "dpo", "--steps", "5", "--root", str(ROOT)]) == 0
    said = capsys.readouterr().out
    assert "run dpo_calibration, 5 steps" in said
    assert "snakemake --profile profiles/<cluster> --configfile calibrate-dpo.yaml" in said
    written = yaml.safe_load((tmp_path / "calibrate-dpo.yaml").read_text())
    (run,) = written["runs"].values()
    assert list(written["runs"]) == ["dpo_calibration"] and run["model"] == "llama"
    assert run["max_steps"] == 5 and "epochs" not in run and "init_from" not in run
    assert run["learning_rate"] == 1e-6 and run["lora"]["r"] == 8 and "publish" not in run
    assert {k: v for k, v in run.items() if k not in ("model", "max_steps", "learning_rate",
            "lora")} == {k: v for k, v in chain["runs"]["dpo"].items()
                         if k not in ("init_from", "epochs", "sweep", "publish",
                                      "learning_rate", "lora")}  # fmt: skip
    assert written["models"] == chain["models"]
    assert main(["calibrate", "chain.yaml", "nope", "--root", str(ROOT)]) == 2
    assert "calibrate: the config has no run 'nope' (its runs: dpo, sft)" in (
        capsys.readouterr().err)  # fmt: skip


def test_a_train_stage_over_its_time_limit_says_its_continuations(tmp_path, capsys):
    from snaketune.budget.planlines import check_steps

    config = config_with(tmp_path, 100_000, gpu="a100-80gb", max_continuations=3)
    from snaketune.plan.stages import tokenized

    path = tmp_path / tokenized(config, "x")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"length": [2048] * 100_000}), path)
    shape = Shape.from_config(LLAMA_8B)
    assert check_steps(config, {"x": shape}, tmp_path, {"x": 1440}) == []
    said = capsys.readouterr().err
    assert "x: 6,250 optimizer steps" in said and "x: train about " in said
    (line,) = check_steps(config, {"x": shape}, tmp_path, {"x": 60})
    jobs = int(line.split("about ")[1].split(" jobs")[0])
    assert line.startswith("runs.x: the train estimate (") and jobs - 1 > 3
    assert "more than max_continuations (3); raise it" in line
    config["runs"]["x"]["max_continuations"] = 500
    assert check_steps(config, {"x": shape}, tmp_path, {"x": 60}) == []
    assert f"about {jobs} jobs, {jobs - 1} continuation(s) (max_continuations 500)" in (
        capsys.readouterr().err)  # fmt: skip


def test_the_estimate_made_when_queued_is_compared_with_what_the_run_took(tmp_path):
    from snaketune.budget.cost import ESTIMATE, estimate_columns, keep

    keep(tmp_path / "results/x" / ESTIMATE, {"wall_s": 100.0, "basis": "calibrated from run a"})
    row = estimate_columns(tmp_path / "results/x", 125.0)
    assert row == {"estimated_train_wall_s": 100.0, "estimate_basis": "calibrated from run a",
                   "estimate_error": 0.25}  # fmt: skip
    assert estimate_columns(tmp_path / "results/y", 125.0) == {}
    from snaketune.train.progress import planned_note

    keep(tmp_path / "results/z" / ESTIMATE, {"wall_s": 130.0, "train_s": 95.0, "steps": 400,
                                             "basis": "calibrated from run a"})  # fmt: skip
    assert planned_note(tmp_path / "results/z") == " (planned: 1.6 min for 400 steps)"
    assert planned_note(tmp_path / "results/y") == ""


def test_plan_reads_a_hub_model_s_config_json_given_on_the_command_line(tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    from snaketune.app.cli import main

    monkeypatch.chdir(tmp_path)
    # the example's sweep writes about 66 GiB of exports: a disk plan of this machine's free
    # space is not what this test reads (stop 68's CI had 65.6 GiB free)
    monkeypatch.setattr("snaketune.budget.diskplan.free_bytes", lambda path: 2**50)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama/config.json").write_text(json.dumps(LLAMA_8B))
    example = ROOT / "config/examples/llama3.1-8b-chat-lora-sweep-grpo-2x4.yaml"
    name = "llama31_8b_instruct"
    code = main(["plan", str(example), "--root", str(ROOT), "--model-config",
                 f"{name}={tmp_path / 'llama'}", "--json"])  # fmt: skip
    plans = json.loads(capsys.readouterr().out)
    assert code == 0 and plans and all(p["per_gpu_gib"]["weights"] > 10 for p in plans)
    assert all("steps" in p and "estimate" in p for p in plans)
    assert main(["plan", str(example), "--root", str(ROOT), "--model-config", "nope=x"]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --model-config nope=x: the config has no model 'nope'")  # fmt: skip
    assert main(["plan", str(example), "--root", str(ROOT), "--model-config",
                 f"{name}=/nowhere"]) == 2  # fmt: skip
    assert "/nowhere is not a file; give a model's config.json" in capsys.readouterr().err


CHAIN = """
gpu: a100-80gb
models:
  llama:
    source: hub
    id: meta-llama/Llama-3.1-8B-Instruct
datasets:
  chat: {source: local, path: chat.jsonl, format: messages}
  pairs: {source: local, path: pairs.jsonl, format: preference}
runs:
  sft:
    model: llama
    dataset: chat
    method: lora
    nodes: 2
    gpus_per_node: 4
    max_length: 1024
    micro_batch_size: 4
    learning_rate: 1.0e-4
    epochs: 3
  dpo:
    init_from: sft
    dataset: pairs
    method: dpo
    lora: {r: 16}
    nodes: 2
    gpus_per_node: 4
    max_length: 1024
    micro_batch_size: 2
    learning_rate: 5.0e-6
    epochs: 1
"""


def test_the_dry_run_of_an_8b_chain_says_its_steps_time_and_gpu_hours(tmp_path):
    """The issue's chain: an 8B LoRA SFT then DPO on 2 nodes x 4 A100-80GB, 40 chat examples
    and 40 pairs of the user's, the model's config.json alone (no weights), through the
    SLURM profile against a stand-in SLURM: before anything is queued, each run's steps,
    the warning of one step per epoch, its train time and GPU-hours."""
    import subprocess

    from conftest import BIN, ENV, SHAPES, stand_in_slurm

    work = tmp_path / "w"
    (work / "resources/models/llama").mkdir(parents=True)
    (work / "resources/models/llama/config.json").write_text(
        json.dumps(SHAPES["meta-llama/Llama-3.1-8B-Instruct"]))  # fmt: skip
    turns = [{"messages": [{"role": "user", "content": "q" * (i % 50 + 1)},
                           {"role": "assistant", "content": "a" * (i % 70 + 1)}]}
             for i in range(40)]  # fmt: skip
    (work / "chat.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    pairs = [{"prompt": "q" * (i % 50 + 1), "chosen": "a" * (i % 30 + 1),
              "rejected": "b" * (i % 20 + 1)} for i in range(40)]  # fmt: skip
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (work / "chain.yaml").write_text(CHAIN)
    env = {**ENV, "PATH": f"{stand_in_slurm(tmp_path / 'bin')}:{ENV['PATH']}"}
    proc = subprocess.run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--configfile",
                           str(work / "chain.yaml"), "-n", "--directory", str(work)],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    assert "plan: sft: 3 optimizer steps (1 per epoch x 3 epochs; 40 examples" in said
    assert "plan: sft: warning: one optimizer step per epoch" in said
    (line,) = [x for x in said.splitlines() if x.startswith("plan: sft: train about ")]
    assert "on 8 device(s)" in line and "GPU-hours (assumed MFU 25.2% of a100-80gb" in line
    assert "plan: dpo: 2 optimizer steps" in said
    # every stage besides training, the shared ones once, and the whole pipeline
    assert "GPU-hours on 8 GPU(s) (a forward pass over one epoch" in next(
        x for x in said.splitlines() if x.startswith("plan: dpo: reference_logps: about ")
    )
    assert "plan: sft: merge_lora: about 64 s (the base read and the merged" in said
    assert "plan: pipeline: download_model llama: about 2.7 min (16.1 GB at 100 MB/s" in said
    assert "plan: pipeline: every run and stage: about " in said


def plan_lines(text: str) -> list[str]:
    """The plan's lines of a dry run's stderr (or of `snaketune plan`'s stdout), their
    prefixes off; the free space measured at each call (not a figure of the plan) masked."""
    import re

    found = re.findall(r"^(?:error: )?(?:(?:memory plan|disk plan|plan): )?(.*)$", text, re.M)
    return sorted(
        re.sub(r"[\d.]+ GiB (free|short)", r"_ GiB \1", line)
        for line in found
        if ": retrains: " not in line and not line.startswith(("error: ", "Using ", "["))
    )


@pytest.mark.parametrize("which", ["demo", "cpt example"])
def test_the_dry_run_and_the_plan_print_the_same_figures(which, fixtures_dir, tmp_path):
    """One code path: every line of the plan a dry run prints before anything is run is the
    line `snaketune plan` prints, figure for figure, in the same directory. The demo on the
    local profile (a CPU run: fp32 checkpoints, this machine's memory) before any download;
    the continued pre-training example through profiles/slurm (its header's dry run: GPU
    runs, every corpus planned from its stated size). They disagreed: the plan counted a
    CPU run's checkpoints in bf16 (1.4 against 1.7 MiB) and its memory per GPU."""
    import re
    import shutil
    import subprocess

    from conftest import BIN, ENV, snakemake

    if which == "demo":
        work = tmp_path / "w"
        shutil.copytree(fixtures_dir, work / "resources/fixtures")
        (work / "config").mkdir()
        shutil.copy(ROOT / "config/config.yaml", work / "config")
        dry = snakemake("-n", "--directory", str(work)).stderr
        config = ROOT / "config/config.yaml"
    else:  # its header's dry run, its model's config.json where the download puts it
        from conftest import SHAPES, stand_in_slurm

        config = ROOT / "config/examples/llama3.2-1b-cpt-fineweb-edu-sft-4x8.yaml"
        work = tmp_path / "w"
        (work / "resources/models/llama32_1b").mkdir(parents=True)
        (work / "resources/models/llama32_1b/config.json").write_text(
            json.dumps(SHAPES["meta-llama/Llama-3.2-1B"]))  # fmt: skip
        shutil.copytree(ROOT / "config/templates", work / "config/templates")
        env = {**ENV, "PATH": f"{stand_in_slurm(tmp_path / 'bin')}:{ENV['PATH']}"}
        proc = subprocess.run([str(BIN / "snakemake"), "--profile", "profiles/slurm",
                               "--configfile", str(config), "-n", "--directory", str(work)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        # its two runs' checkpoints together need more than this disk has: refused
        assert "does NOT fit" in proc.stderr, (proc.stdout + proc.stderr)[-5000:]
        dry = proc.stderr
    plan = subprocess.run([str(BIN / "snaketune"), "plan", str(config), "--root", str(ROOT)],
                          cwd=work, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    said = [line for line in plan_lines(dry) if line in set(plan_lines(plan.stdout)) or
            re.match(r"(demo|cpt|chat_sft|pipeline|\d runs?)[: ]", line)]  # fmt: skip
    assert len(said) > 8, dry[-3000:]
    assert said == plan_lines(plan.stdout), (dry[-3000:], plan.stdout, plan.stderr)


def test_a_run_calibrated_from_another_method_is_its_tokens_scoring_and_generation(tmp_path):
    """A CPU GRPO run whose only calibration is an SFT run of the same model (1,000
    tokens/s, 2 s a step): a step's update is the fixed 0.03 s of a CPU step and its
    sequences' tokens (8 prompts x 4 completions, each its prompt at max_length 256 before
    tokenization and 12 generated) at the rate of the rest of the calibration's step
    (2,000 tokens in 1.97 s), its reference's pass (beta > 0: the model's own size) a third
    of that, and its 12 decode steps at generate()'s CPU floor (32 layers x 0.46 ms + 0.8
    ms), all by hand; its start-up 6 s longer than a run's that does not generate."""
    from snaketune.budget.calibrate import from_other_method
    from snaketune.budget.cost import startup_change, steps_of

    config = config_with(tmp_path, 1000, method="grpo", max_steps=10,
                         grpo={"num_generations": 4, "max_completion_length": 12,
                               "beta": 0.04})  # fmt: skip
    shape = Shape.from_config(LLAMA_8B)
    s = steps_of(config, "x", tmp_path)
    assert s["per_step"] == 8  # 8 devices x 4 rows a micro batch / 4 completions a prompt
    cal = {"run": "c", "method": "lora", "tokens_per_s": 1000.0, "step_s": 2.0, "device": "cpu",
           "devices": 2, "nodes": 2, "startup_s": 16.0, "launch_s": 4.0}  # fmt: skip
    e = from_other_method(config, "x", tmp_path, shape, s, None, cal)
    tokens, rate = 32 * (256 + 12), 2000 / 1.97
    decode = 32 * 0.46e-3 + 0.8e-3
    step = 0.03 + tokens / rate + tokens / (3 * rate) + 12 * decode
    assert e["train_s"] == pytest.approx(10 * step, rel=1e-12)
    lora = {**config["runs"]["x"], "method": "lora"}
    assert startup_change(cal, config["runs"]["x"]) - startup_change(cal, lora) == 0.5
    assert startup_change({**cal, "method": "grpo"}, lora) - startup_change(cal, lora) == -0.5
    assert e["basis"].startswith("calibrated from run c of method lora (its 1,000 tokens/s)")
    assert "12 decode steps of 15.5 ms" in e["basis"]


def test_a_decode_step_is_its_bytes_its_flops_or_generate_s_floor():
    """A decode step by hand: a 1B-shaped Llama on an H100 is generate()'s floor (16 layers
    at 19.7 / 18 ms), the 8B's too (32 layers: 35 ms against its 9.6 ms of bytes), and on
    this CPU the floor measured here (0.46 ms a layer and 0.8 ms a step); where vLLM
    generates there is no floor: the 8B's bytes at half of 3.35 TB/s."""
    from snaketune.budget.rates import decode_step

    small = Shape.from_config({**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192,
                               "head_dim": 64, "num_hidden_layers": 16})  # fmt: skip
    big = Shape.from_config(LLAMA_8B)
    assert decode_step(small, 8, "h100-80gb")[0] == pytest.approx(16 * 19.7e-3 / 18)
    step, why = decode_step(big, 8, "h100-80gb")
    assert step == pytest.approx(32 * 19.7e-3 / 18) and why.startswith("the floor of 32 layers")
    assert decode_step(big, 8, None)[0] == pytest.approx(32 * 0.46e-3 + 0.8e-3)
    step, why = decode_step(big, 8, "h100-80gb", server=True)
    assert step == pytest.approx(LLAMA_8B_PARAMS * 2 / (3.35e12 * 0.5))
    assert why == "the weights read at the memory bandwidth"


def test_a_cpu_run_s_other_stages_before_a_calibration_are_worked_out_by_hand(tmp_path):
    """A CPU LoRA run with no calibration: its shard job's start (0.6 s) and an epoch's tokens
    at 16 bytes each at 500 MB/s; conversion a job's start (3.5 s: the adapter alone); the
    merge a job's start and the fp32 model read and written; its evaluation a job's start,
    the fp32 model read, the 50 rows' loss at a third of the CPU's assumed rate (every row
    max_length) and 7 batches of 256 decode steps at generate()'s CPU floor (32 layers)."""
    from snaketune.budget import stagecost as sc
    from snaketune.budget.cost import estimate, steps_of

    config = config_with(tmp_path, 1000, eval_dataset="e")
    shape = Shape.from_config(LLAMA_8B)
    s = steps_of(config, "x", tmp_path)
    c = sc.costs_of(config, "x", shape, s, estimate(config, "x", tmp_path, shape, s), tmp_path)
    stages, fp32 = c["stages"], LLAMA_8B_PARAMS * 4
    assert list(stages) == ["shard_dataset", "train", "convert_checkpoint", "merge_lora",
                            "evaluate"]  # fmt: skip
    epoch = s["per_step"] * 256 * s["steps_per_epoch"]  # before tokenization: max_length
    assert stages["shard_dataset"]["s"] == pytest.approx(0.6 + epoch * 16 / 500e6)
    assert stages["convert_checkpoint"]["s"] == 3.5
    assert stages["merge_lora"]["s"] == pytest.approx(3.5 + 2 * fp32 / 500e6)
    n = LLAMA_8B_PARAMS - 128256 * 4096  # the input embedding: a lookup
    rate = 1 / (59e-6 + 4 * n / 1.35e11)
    loss = 50 * 256 / rate / 3
    decode = 7 * 256 * (32 * 0.46e-3 + 0.8e-3)  # 50 rows, 8 a batch (the schema's default)
    assert config["runs"]["x"]["eval"]["batch_size"] == 8
    assert stages["evaluate"]["s"] == pytest.approx(3.5 + fp32 / 500e6 + loss + decode, rel=1e-4)
    assert all(v["gpu_hours"] is None for v in stages.values())


def opd_on_cpu(tmp_path: Path) -> tuple[dict, dict]:
    """A CPU on-policy distillation run x (LoRA on a 1B-shaped student with a tied head, the
    8B its teacher t, eval set e) and its student's config.json."""
    small = {**LLAMA_8B, "hidden_size": 2048, "intermediate_size": 8192, "head_dim": 64,
             "num_hidden_layers": 16, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "t").mkdir()
    (tmp_path / "t/config.json").write_text(json.dumps(LLAMA_8B))
    teacher = {"t": {"source": "local", "path": str(tmp_path / "t")}}
    block = {"opd": {"teacher": "t", "max_completion_length": 32}, "lora": {"r": 8}}
    config = config_with(tmp_path, 200, teacher, method="opd", eval_dataset="e", max_steps=4,
                         **block)  # fmt: skip
    (tmp_path / "m/config.json").write_text(json.dumps(small))
    return config, small


def teacher_pass_by_hand(examples: int = 50) -> float:
    """The 8B teacher read in fp32 and its NLL of 2 x ``examples`` completions, one at a
    time: generate()'s CPU floor of its 32 layers and 256 tokens at a third of its assumed
    rate (cpu_tokens_per_s by hand: 4 FLOPs a weight, its input embedding a lookup)."""
    big = llama_params(LLAMA_8B)
    rate = 1 / (59e-6 + 4 * (big - 128256 * 4096) / 1.35e11)
    return big * 4 / 500e6 + 2 * examples * (32 * 0.46e-3 + 0.8e-3 + 256 / (3 * rate))


def test_an_on_policy_distillation_s_cpu_evaluation_also_reads_and_runs_its_teacher(tmp_path):
    """A CPU opd run's own evaluation (before a calibration) is a job's start (3.5 s), its student
    read, the 50 rows' loss and their greedy decode steps, as any generating run's, and then
    its live teacher (the 8B) read in fp32 and its NLL of the run's 50 completions and of the
    base's 50 (the base is evaluated too: evaluate_base), one at a time: generate()'s CPU
    floor of the teacher's 32 layers and max_length tokens at a third of its assumed rate;
    the base's evaluation has no teacher. Worked out by hand from the rates' constants."""
    from snaketune.budget import stagecost as sc
    from snaketune.budget.cost import estimate, steps_of

    config, small = opd_on_cpu(tmp_path)
    shape = Shape.from_config(small)
    s = steps_of(config, "x", tmp_path)
    c = sc.costs_of(config, "x", shape, s, estimate(config, "x", tmp_path, shape, s), tmp_path)
    stages = {**c["stages"], **{k.split()[0]: v for k, v in c["shared"].items()}}
    assert {"evaluate", "evaluate_base"} <= set(stages)

    def rate(params, untied_embedding):  # cpu_tokens_per_s by hand: 4 FLOPs a weight (LoRA)
        return 1 / (59e-6 + 4 * (params - untied_embedding) / 1.35e11)

    student = llama_params(small)
    own = 3.5 + student * 4 / 500e6 + 50 * 256 / rate(student, 0) / 3
    own += 7 * 256 * (16 * 0.46e-3 + 0.8e-3)  # 50 rows, 8 a batch, 256 new tokens at most
    assert config["runs"]["x"]["eval"]["max_new_tokens"] == 256
    teacher_pass = teacher_pass_by_hand()
    assert stages["evaluate_base"]["s"] == pytest.approx(own, rel=1e-9)
    assert stages["evaluate"]["s"] == pytest.approx(own + teacher_pass, rel=1e-9)
    assert "the teacher read and its NLL of 2 x 50 completions" in stages["evaluate"]["basis"]


def test_a_calibrated_cpu_run_s_evaluation_adds_what_it_does_beyond_the_calibration_s(tmp_path):
    """Calibrated from a finished LoRA run of the same model and eval set (its evaluate stage
    took 30.5 s), an on-policy distillation's own evaluation is those 30.5 s and its
    teacher's pass at the assumed rates (the 8B read in fp32, its NLL of 2 x 50
    completions); its base's evaluation, which the calibration did not run (its base
    evaluated before it) and which does what the calibration's did, is the calibration's
    30.5 s; a run that evaluates alike is the calibration's alone."""
    from snaketune.budget import stagecost as sc
    from snaketune.budget.cost import estimate, steps_of
    from snaketune.plan.config import validate_config

    config, small = opd_on_cpu(tmp_path)
    earlier = {"model": "m", "dataset": "d", "eval_dataset": "e", "method": "lora",
               "max_length": 256, "micro_batch_size": 4, "learning_rate": 1e-4,
               "max_steps": 4, "nodes": 2, "gpus_per_node": 4}  # fmt: skip
    config = validate_config({**config, "runs": {**config["runs"], "earlier": earlier}}, ROOT)
    finished(tmp_path, "earlier", config["runs"]["earlier"], 80.0, 45.0, 1_280_000, 20, 40,
             "cpu", small)  # fmt: skip
    (tmp_path / "benchmarks/evaluate").mkdir(parents=True)
    (tmp_path / "benchmarks/evaluate/earlier.tsv").write_text("s\th:m:s\n30.5\t0\n")
    shape = Shape.from_config(small)

    def stages_of(name):
        s = steps_of(config, name, tmp_path)
        e = estimate(config, name, tmp_path, shape, s)
        assert e["calibrated_from"] == "earlier"
        c = sc.costs_of(config, name, shape, s, e, tmp_path)
        return {**c["stages"], **{k.split()[0]: v for k, v in c["shared"].items()}}

    teacher_pass = teacher_pass_by_hand()
    x = stages_of("x")
    assert x["evaluate"]["s"] == pytest.approx(30.5 + teacher_pass, rel=1e-9)
    assert x["evaluate"]["basis"].startswith(f"as run earlier's took, +{teacher_pass:.1f} s ")
    assert x["evaluate_base"] == {"s": 30.5, "gpu_hours": None, "gpus": 0,
                                  "basis": "as run earlier's evaluate took"}  # fmt: skip
    # a third run evaluating as the calibration does: its times as they are
    config["runs"]["y"] = {**config["runs"]["earlier"], "learning_rate": 2e-4}
    assert stages_of("y")["evaluate"]["s"] == 30.5
