"""Every benchmark command docs/benchmarks.md gives runs, in a short form, so a broken
benchmark fails the full suite instead of waiting for the next person who needs its
figure. Each command is taken from the doc as written; arguments that only shrink it (fewer
steps, repeats, rows or layers) are appended (argparse keeps the last value), and the
placeholders name the suite's own finished pipelines. Commands that differ only in such
size flags run the same code and run once. The figures themselves are not
judged here: a benchmark prints them; the doc records them."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
from conftest import ENV, ROOT

pytestmark = pytest.mark.slow

DOC = ROOT / "docs/benchmarks.md"
# Appended to each benchmark's documented command: the same code paths, tiny sizes.
SHORT = {
    "allreduce.py": ["--mib", "1"],
    "chat_masks.py": ["--rows", "100"],
    "clean_corpus.py": ["--docs", "2000", "--parts", "2"],
    "checkpoint_disk.py": ["--keep", "1"],
    "convert.py": ["--layers", "2", "--hidden", "128", "--repeat", "1"],
    "corpus.py": ["--docs", "600"],
    "cost_estimate.py": ["--demo-steps", "16", "--steps", "8"],
    "decode_floor.py": ["--tokens", "8", "--layers", "2", "4", "--batches", "1", "--repeats", "1"],
    "dpo_reference.py": ["--steps", "4", "--pairs", "512"],  # step time: median of steps 2..n
    "eval_memory.py": ["--short"],
    "plan_matrix.py": ["--steps", "8"],
    "tokenize_startup.py": [],
    "extension_cache.py": ["--rounds", "2"],  # builds the op 3 times and more: heavy
    "gpu_check.py": [],  # its CPU form is the short one (test_the_gpu_check_s_cpu_form_runs)
    "gpu_prepare.py": ["--dry-run"],  # the list of what to carry, nothing fetched
    "heldout_cost.py": ["--pairs", "1", "--max-steps", "4", "--every", "2"],
    "import_cost.py": ["--repeats", "1"],
    "launch_startup.py": ["--repeats", "1"],
    "load_memory.py": ["--short"],
    "memory_timing.py": [],  # two small trainings (tests/test_memplan.py runs it)
    "omp_wait.py": ["--steps", "3", "--side-by-side", "1"],  # both policies, one run each
    "pipeline_cpu.py": ["--steps", "4"],  # the demo pipeline, 4 steps
    "qlora_memory.py": ["--steps", "1", "--cases", "demo"],
    "qlora_merge.py": [],
    "sequence_plan.py": [],  # the plan only: no training
    "tokenize.py": ["--rows", "2000"],
    "train_overhead.py": ["--steps", "12", "--warmup", "2", "--repeats", "1"],
    "train_throughput.py": ["--steps", "3", "--warmup", "1", "--layers", "2",
                            "--layout-batches", "1"],
}  # fmt: skip


# The benchmarks whose short form trains, converts or loads models: each starts several
# trainings or model processes (together ~1,000 CPU-seconds). They run in `make test-bench`
# (marker bench); the others are in the extended tier (docs/testing.md).
HEAVY = {"checkpoint_disk.py", "convert.py", "corpus.py", "cost_estimate.py", "dpo_reference.py",
         "extension_cache.py",
         "heldout_cost.py", "omp_wait.py", "pipeline_cpu.py", "plan_matrix.py", "qlora_memory.py", "qlora_merge.py", "tokenize.py",
         "train_overhead.py", "train_throughput.py"}  # fmt: skip

# Benchmarks another slow test already runs, in the documented short form (its table printed,
# then the figures as JSON it judges): not run twice. The test named must run the script.
RUN_BY = {
    "gpu_check.py": ("tests/test_bench.py", "test_the_gpu_check_s_cpu_form_runs"),
    "eval_memory.py": ("tests/test_big_models.py",
                       "test_the_evaluate_stages_plan_is_what_evaluation_holds"),
    "load_memory.py": ("tests/test_memplan.py",
                       "test_what_loading_holds_of_cpu_memory_is_what_the_plan_counts"),
    "memory_timing.py": ("tests/test_memplan.py",
                         "test_a_zero2_step_holds_its_gradients_only_under_accumulation"),
}  # fmt: skip


def script_of(command: str) -> str:
    """The benchmark a documented command runs (its file name under bench/)."""
    return command.split()[0].removeprefix("bench/")


def documented() -> list[str]:
    """Each distinct `python bench/...` command of the doc (code blocks and inline code)."""
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"python (bench/[\w.]+\.py[^`\n#]*)", text)
    return sorted({" ".join(c.split()) for c in found})


# Flags that only size a benchmark: commands that differ in these alone run the same code,
# so each such group runs once (its first command, shortened). Flags that only add to what a
# benchmark runs (heldout_cost.py --answers scores answers beside the loss pass it always
# runs): the command with them covers the one without, and runs in its place.
SIZE = {"--steps", "--warmup", "--repeats", "--repeat", "--micro-batch-size", "--pairs",
        "--every", "--rows", "--layers", "--keep", "--mib", "--ranks", "--layout-batches",
        "--max-steps", "--side-by-side", "--hidden", "--rounds"}  # fmt: skip
ADDS = {"--answers"}


def shape(command: str) -> tuple[str, ...]:
    """The command without its size flags and their values."""
    words, out, skip = shlex.split(command), [], False
    for word in words:
        if skip and not word.startswith("--"):
            continue
        skip = word in SIZE
        if not skip and word not in ADDS:
            out.append(word)
    return tuple(out)


def runs() -> list[str]:
    """One documented command per shape: the first with the most of ADDS's flags; none of a
    benchmark RUN_BY names (but its --gpu forms, which those tests do not run)."""
    chosen: dict[tuple[str, ...], str] = {}
    for command in documented():
        if script_of(command) in RUN_BY and "--gpu" not in command:
            continue
        adds = len(ADDS & set(shlex.split(command)))
        best = chosen.get(shape(command))
        if best is None or adds > len(ADDS & set(shlex.split(best))):
            chosen[shape(command)] = command
    return list(chosen.values())


def test_every_benchmark_is_known_here():
    """A benchmark added to the doc needs its short form above (and one removed, its entry
    dropped)."""
    scripts = {script_of(c) for c in documented()}
    assert scripts == set(SHORT), scripts ^ set(SHORT)
    assert scripts >= HEAVY, HEAVY - scripts
    assert scripts >= {p.name for p in (ROOT / "bench").glob("*.py")}  # each bench documented
    ran = {shape(c) for c in documented() if script_of(c) not in RUN_BY
           or "--gpu" in c}  # fmt: skip
    assert ran == {shape(c) for c in runs()}  # each one runs, here or in the test RUN_BY names
    for script, (path, test) in RUN_BY.items():
        source = (ROOT / path).read_text(encoding="utf-8")
        body = source.split(f"def {test}(")[1].split("\ndef ")[0]
        assert f'"bench/{script}"' in body and "@pytest.mark.slow" in source, (script, path)


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.gpu) if "--gpu" in c
     else pytest.param(c, marks=pytest.mark.bench) if script_of(c) in HEAVY
     else pytest.param(c, marks=pytest.mark.extended) for c in runs()],
)  # fmt: skip
def test_documented_benchmark_runs(command, request, tmp_path):
    for placeholder, fixture in (("<finished demo workdir>", "demo"), ("<workdir>", "qlora_chain")):
        if placeholder in command:
            command = command.replace(placeholder, str(request.getfixturevalue(fixture)))
    script, *args = shlex.split(command)
    script = script.removeprefix("bench/")
    cmd = [sys.executable, str(ROOT / "bench" / script), *args, *SHORT[script]]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), "a benchmark prints its figures"


@pytest.mark.extended
def test_the_gpu_check_s_cpu_form_runs(tmp_path):
    """bench/gpu_check.py without --gpu (its CPU form, tiny sizes; the extended tier runs it,
    and CI's touched tests whenever a change reaches what it loads, so that the GPU check
    cannot rot between GPU runs): full fine-tuning, LoRA and (where
    bitsandbytes imports) a 4-bit base each train through the stage with their tokens/s,
    step time, peak memory, the plan's figure and the kernels the worker used, and the
    profiler's top operators add up to at most the whole step."""
    import importlib.util
    import json

    cmd = [sys.executable, str(ROOT / "bench/gpu_check.py"), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    methods = {"full", "lora"} | ({"qlora"} if importlib.util.find_spec("bitsandbytes") else set())
    assert set(result["runs"]) == methods, result["runs"]
    for name, run in result["runs"].items():
        assert run["tokens_per_s_per_gpu"] > 0 and run["step_s"] > 0, (name, run)
        assert run["peak_gib"] > 0 and run["plan_gib"] > run["plan_without_margin_gib"] > 0
        assert "attention" not in run["kernels"] and run["kernels"] != "not logged", run
        assert run["loss_first_last"][0] > 0
        # a micro batch is micro_batch_size examples of max_length tokens, the batch the plan
        # and the MFU goal are about (the first GPU run trained a tenth of it: ~150-token
        # examples, micro_batch_size counting examples)
        tokens = run["tokens_per_s_per_gpu"] * run["step_s"]
        assert tokens == pytest.approx(result["micro_batch_size"] * result["max_length"],
                                       rel=0.05), (name, run)  # fmt: skip
    shares = [p["share"] for p in result["profile"]]
    assert len(shares) == 10 and 0 < sum(shares) <= 1.0001, result["profile"]
    assert "| full |" in proc.stdout and "pytest -m gpu: not run" in proc.stdout


def test_the_carried_bitsandbytes_keeps_the_gpu_machines_cuda_and_the_cpu_library(tmp_path):
    """gpu_prepare's slim: bitsandbytes' wheel (43 MB, a library per CUDA, ROCm and XPU
    release) keeps the GPU machines' CUDA libraries and the CPU one, and its RECORD names
    exactly the files left, so that everything a GPU machine lacks travels in one call."""
    import importlib.util
    import zipfile

    spec = importlib.util.spec_from_file_location("gpu_prepare", ROOT / "bench/gpu_prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    libs = ["cpu", "cuda118", "cuda128", "cuda130", "cuda132", "rocm72", "xpu2025"]
    names = ["bitsandbytes/__init__.py", *(f"bitsandbytes/libbitsandbytes_{x}.so" for x in libs)]
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    record = "bitsandbytes-0.50.2.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in names:
            z.writestr(name, name * 100)
        z.writestr(record, "".join(f"{n},sha256=x,1\n" for n in [*names, record]))
    prepare.slim(wheel)
    with zipfile.ZipFile(wheel) as z:
        kept = set(z.namelist())
        listed = {line.split(",")[0] for line in z.read(record).decode().splitlines()}
        assert z.read("bitsandbytes/libbitsandbytes_cuda130.so") == names[4].encode() * 100
    expected = {"bitsandbytes/__init__.py", record, *(f"bitsandbytes/libbitsandbytes_{x}.so"
                                                     for x in ("cpu", "cuda130", "cuda132"))}  # fmt: skip
    assert kept == listed == expected


@pytest.mark.bench
def test_the_levers_cpu_form_runs(tmp_path):
    """bench/gpu_check.py --levers without --gpu (its levers at the check's tiny
    sizes, 3 steps): every lever trains through the stage (flash-attention 2 left out where
    flash_attn is not installed: this machine) with its figures and the kernels the worker
    said it used; a micro batch holds the tokens the lever names; the two rows of the
    product's defaults are marked."""
    import json

    cmd = [sys.executable, str(ROOT / "bench/gpu_check.py"), "--levers", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=1200)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads((tmp_path / "levers.json").read_text())
    levers = result["levers"]
    assert levers.pop("full, flash-attention 2") == {"skipped": "flash_attn is not installed here"}
    assert len(levers) == 11 and [k for k, v in levers.items() if v["defaults"]] == [
        "full, defaults", "lora, defaults"]  # fmt: skip
    for name, got in levers.items():
        assert got["tokens_per_s_per_gpu"] > 0 and got["peak_gib"] > 0, (name, got)
        tokens = got["tokens_per_s_per_gpu"] * got["step_s"]
        assert tokens == pytest.approx(got["tokens_per_micro_batch"], rel=0.05), (name, got)
    assert levers["full, 32k tokens"]["tokens_per_micro_batch"] == 4 * levers[
        "full, defaults"]["tokens_per_micro_batch"]  # fmt: skip
    assert "| full, defaults (**defaults**) |" in proc.stdout
