"""Sequence parallelism (``sequence_parallel: N``, snaketune.data.sequence): the checks before
anything runs, the split of a packed row, the plan's figures, and on CPU (gloo) a run whose
sequences are split across 2 emulated GPUs against the same run on one GPU, and a probe of
document isolation and of an all-padding slice against plain transformers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from snaketune.data.sequence import Slices, check_model, check_run, split
from snaketune.methods import method_of

HERE = Path(__file__).parent
ROOT = HERE.parent


def sp_run(**keys) -> dict:
    run = {"method": "lora", "packing": True, "gpus_per_node": 4, "model": "m",
           "attn_implementation": "auto", "sequence_parallel": 2}  # fmt: skip
    return {**run, **keys}


@pytest.mark.parametrize(
    "keys, needle",
    [
        ({"method": "dpo"}, "method dpo scores whole sequences"),
        ({"method": "grpo"}, "method grpo scores whole sequences"),
        ({"packing": False}, "needs packing: true"),
        ({"gpus_per_node": 3, "sequence_parallel": 2}, "must divide gpus_per_node (3)"),
        ({"gpus_per_node": 2, "sequence_parallel": 4}, "must divide gpus_per_node (2)"),
        ({"attn_implementation": "eager"}, "cannot split eager attention"),
    ],
)
def test_a_run_sequence_parallelism_cannot_split_is_one_line(keys, needle):
    run = sp_run(**keys)
    line = check_run("runs.r", run, method_of(run).splits_sequences)
    assert line is not None and needle in line and line.startswith("runs.r.sequence_parallel")
    assert "\n" not in line


def test_runs_it_can_split_pass_and_heads_must_divide():
    assert check_run("runs.r", sp_run(), splits=True) is None
    for method in ("lora", "full"):
        assert method_of(sp_run(method=method)).splits_sequences
    assert check_run("runs.r", sp_run(sequence_parallel=1, packing=False), splits=True) is None
    assert check_model("runs.r", sp_run(sequence_parallel=8), 32, 8) is None
    assert check_model("runs.r", sp_run(sequence_parallel=8), 32, 4) is None  # KV repeated
    assert "32 attention heads / 8 KV heads" in check_model("runs.r", sp_run(sequence_parallel=3),
                                                          32, 8)  # fmt: skip
    assert check_model("runs.r", sp_run(sequence_parallel=4), 4, 2) is None
    assert "6 attention heads" in check_model("runs.r", sp_run(sequence_parallel=4), 6, 6)


def test_the_workflow_refuses_a_split_dpo_run_before_any_job(tmp_path):
    from conftest import quick_config, snakemake

    config = quick_config(tmp_path / "c.yaml", method="dpo", sequence_parallel=2)
    proc = snakemake("--configfile", str(config), "--directory", str(tmp_path), "-n",
                     check=False)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "sequence_parallel: 2 splits supervised" in out, out[-2000:]


def test_split_pads_to_a_multiple_shifts_over_the_row_and_keeps_one_slice():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])  # two examples: 3 and 4 tokens
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[-100, 6, 7, -100, 9, 10, 11]])
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels,
             "cu_seq_lens_q": torch.tensor([0, 3, 7]), "use_cache": False}  # fmt: skip
    parts = [split(dict(batch), 4, r, pad_id=0) for r in range(4)]  # 7 -> 8 tokens, 2 each
    assert [p["input_ids"].tolist() for p in parts] == [[[5, 6]], [[7, 8]], [[9, 10]], [[11, 0]]]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1]], [[2, 0]], [[1, 2]], [[3, 0]]]
    # token t's target is token t + 1 across slice bounds; an example's first token and the
    # padding are never targets
    assert [p["shift_labels"].tolist() for p in parts] == [
        [[6, 7]], [[-100, 9]], [[10, 11]], [[-100, -100]]]  # fmt: skip
    assert all(torch.equal(p["labels"], p["shift_labels"]) for p in parts)
    assert all("cu_seq_lens_q" not in p and p["use_cache"] is False for p in parts)


def test_each_gpu_of_a_group_cuts_its_own_slice_and_only_the_first_counts():
    """4 GPUs in 2 groups of 2 (global ranks 0-3): every GPU of a group reads the same packed
    row; GPU r takes slice r mod 2 of it, so a group's slices put together are the whole
    row, once; only each group's first GPU reports the counts the step sums over ranks."""

    class Packed:  # the inner collator: one packed row of 6 tokens for every GPU
        layout = "packed"
        tokens, padded, samples, squares = 6, 0, 2, 18

        def __call__(self, examples):
            return {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10]]),
                    "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
                    "labels": torch.tensor([[-100, 6, 7, -100, 9, 10]])}  # fmt: skip

    gpus = [Slices(Packed(), 2, rank, pad_id=0) for rank in range(4)]
    ids = [g([])["input_ids"].tolist()[0] for g in gpus]
    assert ids == [[5, 6, 7], [8, 9, 10], [5, 6, 7], [8, 9, 10]]
    assert [g.tokens for g in gpus] == [6, 0, 6, 0]
    assert [g.samples for g in gpus] == [2, 0, 2, 0]
    assert all(g.layout == "packed" for g in gpus)


def test_the_plan_splits_activations_and_logits_not_model_states():
    from snaketune.budget.memplan import Setup, Shape, activations, model_states

    shape = Shape.from_config({"hidden_size": 4096, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "num_hidden_layers": 32,
                               "intermediate_size": 14336, "vocab_size": 128256,
                               "model_type": "llama"})  # fmt: skip
    one = Setup(adapter="lora", stage=3, offload_optimizer=False, offload_params=False, nodes=1,
                gpus_per_node=8, micro_batch_size=1, max_length=32768, gradient_checkpointing=True,
                attention="flash_attention_2", liger=False, bytes_per_weight=2, lora_r=16)  # fmt: skip
    from dataclasses import replace

    for n in (2, 4, 8):
        split_n = replace(one, sequence_parallel=n)
        assert activations(shape, split_n) == pytest.approx(activations(shape, one) / n)
        assert model_states(shape, split_n) == model_states(shape, one)


@pytest.mark.slow
def test_document_isolation_and_an_all_padding_slice_against_plain_transformers(tiny_model):
    """tests/sequence_probe.py on 2 gloo ranks: per-token NLL of a packed row split in two
    equals the unsplit row's; changing the third document leaves the first two's NLL
    unchanged; a row whose second half is padding gives rank 1 a loss of 0, finite."""
    from conftest import ENV

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(HERE / "sequence_probe.py"), str(tiny_model)],
        capture_output=True, text=True, timeout=300, env={**ENV, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "probe: ok" in proc.stdout, proc.stdout[-2000:]


EXAMPLES, EPOCHS, SAVE = 24, 2, 4  # 6 steps of 4 examples an epoch: 12 steps, saves 4, 8, 12
STEPS = EXAMPLES // 4 * EPOCHS


def _shard_and_train(tmp_path: Path, tiny_model: Path, n: int) -> tuple[dict, Path, Path]:
    """The packed LoRA run on 1 node x n GPUs with sequence_parallel n (one data-parallel
    rank either way), fp32, 2 threads: (its spec, its shards, its results/x/train)."""
    from conftest import ENV, run_spec, train

    from snaketune.core.heldout import spec_of

    where = tmp_path / f"sp{n}"
    extra = ["--sequence-parallel", str(n)] if n > 1 else []
    subprocess.run([sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized",
                    str(tmp_path / "chosen.tok.parquet"), "--nodes", "1", "--gpus-per-node",
                    str(n), "--micro-batch-size", "2", "--gradient-accumulation-steps", "2",
                    "--seed", "2", "--packing", *extra, "--out", str(where / "shards")],
                   check=True, env=ENV, capture_output=True)  # fmt: skip
    run = run_spec(nodes=1, gpus_per_node=n, sequence_parallel=n, micro_batch_size=2,
                   gradient_accumulation_steps=2, epochs=EPOCHS, save_steps=SAVE,
                   save_total_limit=2, checkpoints={"optimizer": "all"},
                   precision="fp32", eval_steps=6)  # fmt: skip
    run["heldout"] = spec_of(
        run, str(tmp_path / "chosen.tok.parquet")
    )  # unsplit, each rank a share
    return run, where / "shards", train(where, run, where / "shards", tiny_model, "zero2",
                                        threads=2)  # fmt: skip


@pytest.fixture(scope="module")
def split_and_unsplit(tmp_path_factory, tiny_model, fixtures_dir):
    """The packed LoRA run, fp32, micro batch 2 x accumulation 2 over 2 epochs of 24 of the
    fixture's answers (57 to 331 tokens), on 1 GPU and on 2 emulated GPUs with
    sequence_parallel 2 (the same global batch of 4, the same plan): (the folder, each run's
    (spec, shards, results/x/train) by GPU count, each run's logged rows, each run's
    training steps' rows)."""
    from conftest import read_jsonl
    from test_tokenize import run_tokenize

    tmp_path = tmp_path_factory.mktemp("sequence")
    spec = {"format": "prompt_response", "columns": {"prompt": "question", "response": "chosen"}}
    rows = read_jsonl(fixtures_dir / "gsm8k-demo/pairs-train.jsonl")[:EXAMPLES]
    run_tokenize(tmp_path, "chosen", spec, rows, tiny_model)
    runs = {n: _shard_and_train(tmp_path, tiny_model, n) for n in (1, 2)}
    logged = {n: read_jsonl(out / "metrics.jsonl") for n, (_, _, out) in runs.items()}
    steps = {n: [m for m in rows if "loss" in m] for n, rows in logged.items()}
    return tmp_path, runs, logged, steps


def same(got: list[dict], want: list[dict], after: int, rel: float) -> float:
    """Every training step's loss after step ``after`` of ``got`` within ``rel`` of
    ``want``'s (each run's steps all there): the worst relative difference."""
    pairs = [(g["loss"], w["loss"]) for g, w in zip(got, want, strict=True)
             if g["step"] > after]  # fmt: skip
    assert len(pairs) == STEPS - after
    for g, w in pairs:
        assert g == pytest.approx(w, rel=rel), (got, want)
    return max(abs(g - w) / w for g, w in pairs)


@pytest.mark.slow
def test_two_gpus_sharing_each_sequence_train_as_one(split_and_unsplit):
    """The run on 2 GPUs sharing each sequence against the same run on 1 GPU: every step's
    loss within 1e-4 relative (what bounds it: the float sums of 2 slices and an all-to-all
    in another order, ~1e-7 measured), the same steps and epochs; the held-out pass (every
    6 steps, unsplit: the attention's split is off in eval mode) gives the same held-out
    loss."""
    _, runs, rows, metrics = split_and_unsplit
    heldout = {n: [(m["step"], m["heldout_loss"]) for m in rows[n] if "heldout_loss" in m]
               for n in rows}  # fmt: skip
    assert [s for s, _ in heldout[2]] == [s for s, _ in heldout[1]] and len(heldout[1]) >= 2
    for (_, one), (_, two) in zip(heldout[1], heldout[2], strict=True):
        assert two == pytest.approx(one, rel=1e-4)
    log = (runs[2][2] / "logs/attempt-1.log").read_text()
    assert "1 groups of 2 devices (sequence_parallel 2)" in log, log[-3000:]
    assert "attention sdpa_segments" in log
    for key in ("step", "epoch"):
        assert [m[key] for m in metrics[1]] == [m[key] for m in metrics[2]], key
    assert [m["step"] for m in metrics[1]] == list(range(1, STEPS + 1))
    assert metrics[1][-1]["epoch"] == pytest.approx(EPOCHS)
    worst = same(metrics[2], metrics[1], 0, 1e-4)
    print(f"{STEPS} steps, loss {metrics[1][0]['loss']:.4f} -> {metrics[1][-1]['loss']:.4f}; "
          f"worst relative difference split against unsplit {worst:.1e}")  # fmt: skip


@pytest.mark.extended
@pytest.mark.slow
def test_a_split_run_resumes_exactly_and_continues_unsplit_on_one_gpu(
    split_and_unsplit, tiny_model
):
    """The split run killed two steps after its checkpoint-8 and rerun resumes there, each
    step once, its losses those of the uninterrupted split run (rel 1e-6); its checkpoint-8
    continued on 1 GPU without the split (sequence_parallel 2 -> 1, the rule: the split is
    topology, the global batch is kept) gives the unsplit losses (rel 1e-4)."""
    from conftest import kill_and_resume, read_jsonl, train

    tmp_path, runs, _, metrics = split_and_unsplit
    run2, shards2, out2 = runs[2]
    start, resumed = kill_and_resume(out2, tmp_path / "killed", run2, shards2, tiny_model)
    assert start == 2 * SAVE
    killed = same([m for m in resumed if "loss" in m], metrics[2], start, 1e-6)
    run1, shards1, _ = runs[1]
    moved = tmp_path / "moved/results/x/train/checkpoints"
    moved.mkdir(parents=True)
    shutil.copytree(out2 / f"checkpoints/checkpoint-{start}", moved / f"checkpoint-{start}")
    for name in ("fingerprint", "metrics.jsonl"):
        shutil.copy(out2 / "checkpoints" / name, moved / name)
    out = train(tmp_path / "moved", run1, shards1, tiny_model, "zero2", threads=2)
    log = (out / "logs/attempt-1.log").read_text()
    assert f"continuing x at step {start} on 1 node x 1 GPU (was 1 node x 2 GPUs " in log
    assert f"resuming from checkpoint-{start}" in log, log[-3000:]
    assert "ZeRO states of 2 ranks turned into" in log  # the split run's 2 ranks, for 1
    continued = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    continued = same(continued, metrics[1], start, 1e-4)
    print(f"worst relative difference: killed and resumed {killed:.1e}, "
          f"continued unsplit {continued:.1e}")  # fmt: skip


SP_EXAMPLE = ROOT / "config/examples/llama3.1-8b-32k-lora-sp-1x8.yaml"


def test_the_32k_example_dry_runs_on_one_8_gpu_node_with_split_shards(tmp_path):
    """config/examples/llama3.1-8b-32k-lora-sp-1x8.yaml's dry run as its header gives it
    (profiles/slurm, against a stand-in SLURM, the model's config.json where the download
    puts it): the train job asks for one node of 8 GPUs, the shards are made for
    sequence_parallel 4 (2 data-parallel ranks)."""
    from conftest import header_dry_run

    proc, jobs = header_dry_run(SP_EXAMPLE, "llama31_8b", tmp_path, "-p")
    out = proc.stdout + proc.stderr
    assert "nodes=1," in jobs["train"] and "gres=gpu:8" in jobs["train"], jobs["train"]
    assert "--sequence-parallel 4" in out, out[-5000:]
    assert "llama8b_32k: 20.3 GiB per GPU" in out, out[-3000:]  # the plan of the header
