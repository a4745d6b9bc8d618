"""Shared test fixtures: the offline model/dataset fixtures, built once per session."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile as _tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# The suite runs many ranks on 2 cores (emulated nodes, three pytest runs side by side):
# OpenMP threads that spin while they wait take the cores from the ranks they wait for.
# Sleeping instead changes no figure (the same threads sum in the same order) and cut three
# demo-sized runs side by side from 60 s to 44 s (docs/benchmarks.md). The local launcher
# does the same for the jobs it starts (snaketune.train.agents); this covers every process the
# tests start (SLURM jobs, evaluation, direct launches).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The tier these tests run in (tests/run.sh sets it): "ci" trains the chains short (CI_RUNS);
# any other value, or none (a plain pytest run), at their documented lengths, which the
# learning thresholds of the extended tier need.
TIER = os.environ.get("SNAKETUNE_TIER", "")
# What each chain's runs train in the CI tier: enough steps for every stage and mechanism
# (a held-out pass, a checkpoint, the export, the evaluation), not enough to learn.
CI_RUNS = {
    "sft_demo": {"max_steps": 16},
    "rl_demo": {"max_steps": 8, "eval_steps": 4},
    "dpo_demo": {"max_steps": 16},
    "rm_demo": {"max_steps": 24},
    "qlora_demo": {"epochs": 1},
}


# The GRPO chain's RLOO run (the GRPO run's settings as method rloo): enough steps for a
# checkpoint, the merge and the evaluation, in both tiers.
RLOO_CHAINED = {"max_steps": 8, "save_steps": 4}


# The batch settings of the pair trainers' weighting tests (PlannedPairs): micro batches of
# 2 pairs, 2 of them a step (the weighting is by a micro batch's pairs, not a step's).
RUN_OF_TWO = {"micro_batch_size": 2, "gradient_accumulation_steps": 2}


def ci_tier() -> bool:
    """True in the CI tier's pytest runs (tests/run.sh ci), where the chains are short."""
    return TIER == "ci"


def chain_runs(*runs: str, whole: tuple[str, ...] = (), **changes: dict) -> str:
    """The ``--config`` value of a chain's snakemake calls: the demo's checkpoints and those
    of the ``whole`` runs keep their optimizer states (as the fixtures ran them: a test
    resumes from the older one), ``changes`` per run, and in the CI tier each of ``runs``
    at its CI length (CI_RUNS). A later call on the same workdir must pass the same value,
    or snakemake sees changed params and trains again."""
    out: dict[str, dict] = {"demo": {"checkpoints": {"optimizer": "all"}}}  # as the demo ran
    for name in (*runs, *whole, *changes):
        entry = out.setdefault(name, {})
        if name in whole:
            entry["checkpoints"] = {"optimizer": "all"}
        if ci_tier():
            entry.update(CI_RUNS.get(name, {}))
        entry.update(changes.get(name, {}))
    return f"runs={out!r}"


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    """resources/fixtures as make_fixtures writes it (tiny-llama/, gsm8k-demo/)."""
    from snaketune.app.fixtures import make_fixtures

    out = tmp_path_factory.mktemp("fixtures")
    make_fixtures(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(fixtures_dir) -> Path:
    return fixtures_dir / "tiny-llama"


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from snaketune.data.tokens import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="session")
def qwen_tokenizer(tmp_path_factory):
    """Qwen3.5's tokenizer (its <|im_start|> and <|im_end|> special tokens), for the tests of
    the chat renderer's rules on templates built to hit each."""
    from families import build
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        build("qwen3.5", ["hi yo and ok"] * 4, tmp_path_factory.mktemp("qwen"))
    )


def failing_load(exc: BaseException, asked: dict):
    """A ``from_pretrained`` stand-in that notes its keyword arguments in ``asked`` and
    raises ``exc`` (a model folder that cannot load)."""

    def load(path, **kwargs):
        asked.update(kwargs)
        raise exc

    return load


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# The config.json values of the models the config examples name (as published on the Hub).
SHAPES = {
    "meta-llama/Llama-3.2-1B": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
    },
    "deepseek-ai/deepseek-coder-6.7b-instruct": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32256, "tie_word_embeddings": False,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
    },
    "Qwen/Qwen2.5-32B-Instruct": {
        "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648,
        "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "tie_word_embeddings": False,
    },
}  # fmt: skip
SHAPES["Qwen/Qwen3-30B-A3B"] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "vocab_size": 151936, "tie_word_embeddings": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "dtype": "bfloat16",
}  # fmt: skip
SHAPES["meta-llama/Llama-3.1-70B-Instruct"] = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "tie_word_embeddings": False, "dtype": "bfloat16",
}  # fmt: skip
SHAPES["meta-llama/Llama-3.2-1B-Instruct"] = SHAPES["meta-llama/Llama-3.2-1B"]
# The vision-language examples' models (their published config.json fields, nested: the
# text model's and the vision tower's), kept apart from SHAPES (the plan's tests of flat
# language models): tests/test_docs.py plans every example.
VLM_SHAPES = {
    "google/gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 256, "dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024,
            "vocab_size": 262208, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
            "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
            "patch_size": 14, "vision_use_head": False,
        },
    },
    "Qwen/Qwen3.5-9B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 256, "full_attention_interval": 4, "attn_output_gate": True,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_value_head_dim": 128, "vocab_size": 248320,
            "mtp_num_hidden_layers": 1, "tie_word_embeddings": False, "dtype": "bfloat16",
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                "rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25},
        },
        "vision_config": {
            "model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "in_channels": 3,
            "intermediate_size": 4304, "num_heads": 16, "num_position_embeddings": 2304,
            "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    },
}  # fmt: skip


BIN = Path(sys.executable).parent
# Recognisable fake secrets in the environment of every pipeline the tests run; no file the
# pipeline writes may contain one (tests/test_secrets.py, tests/test_slurm.py).
FAKE_SECRETS = {
    "HF_TOKEN": "hf_FAKEtokenSnaketuneTest0123456789abcd",
    "WANDB_API_KEY": "fakewandbkey0123456789abcdef0123456789ab",
    "MY_SERVICE_TOKEN": "fake-service-token-7f3a9c",
    "AWS_SECRET_ACCESS_KEY": "fakeAwsSecretAccessKey/7f3a9cSNAKETUNE",
    "DB_PASSWORD": "fake-db-password-7f3a9c",
    "OPENAI_API_KEY": "sk-fakeOpenAiKeySnaketune7f3a9c",
}
# Offline check (tests/offline/sitecustomize.py, tests/test_offline.py): every Python
# process the tests start, and this one, log each lookup or connection that would leave the
# machine here. Under tests/run.sh the two pytest runs share the file.
if "SNAKETUNE_NET_LOG" not in os.environ:
    _net = os.environ.get("SNAKETUNE_SHARED_DIR") or _tempfile.mkdtemp(prefix="snaketune-net-")
    os.environ["SNAKETUNE_NET_LOG"] = str(Path(_net) / "net.log")
NET_LOG = Path(os.environ["SNAKETUNE_NET_LOG"])
# The library's caches of model counts and model-class facts (snaketune.core.cache) in a
# folder of the test session's own, never the user's (~/.cache/snaketune): a change to the
# counting must not pass on figures an earlier run left there. The side-by-side runs of a
# tier share theirs (tests/run.sh), so a fact is computed once a tier, as on a fresh machine.
_cache = os.environ.get("SNAKETUNE_SHARED_DIR") or _tempfile.mkdtemp(prefix="snaketune-")
os.environ["SNAKETUNE_CACHE"] = str(Path(_cache) / "cache")
OFFLINE = ROOT / "tests/offline"
ENV = {
    **os.environ,
    **FAKE_SECRETS,
    "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
    "PYTHONWARNINGS": "ignore::FutureWarning",
    "PYTHONPATH": os.pathsep.join([str(OFFLINE), *filter(None, [os.environ.get("PYTHONPATH")])]),
}
sys.path.insert(0, str(OFFLINE))
import sitecustomize  # noqa: E402  (the same watch on this process)

sys.path.remove(str(OFFLINE))
if not hasattr(sitecustomize, "cpu_seconds"):  # Python's site imported another one first
    _spec = importlib.util.spec_from_file_location("sitecustomize", OFFLINE / "sitecustomize.py")
    sitecustomize = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sitecustomize)


def pytest_runtest_setup(item) -> None:
    """Name the test in the environment of every process it starts (before its fixtures are
    built, so a session fixture's pipeline counts for the first test that needs it): the
    CPU accounting of tests/offline/sitecustomize.py and tests/durations.py."""
    os.environ["SNAKETUNE_TEST"] = ENV["SNAKETUNE_TEST"] = item.nodeid
    sitecustomize.counted_per_test = True
    item.cpu_began = sitecustomize.cpu_seconds()


class FixtureNames:
    """A session or module fixture's processes count for the fixture ("fixture:NAME"), not
    for whichever test first needed it: its CPU in tests/durations.py, its modules in
    tests/touched.py's map for every test that uses it. A plugin registered in
    pytest_configure, not a hook of this file: a session fixture is set up through the
    session's hooks, which a conftest below the rootdir does not take part in."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope not in ("session", "module"):
            yield
            return
        before = ENV.get("SNAKETUNE_TEST", "")
        os.environ["SNAKETUNE_TEST"] = ENV["SNAKETUNE_TEST"] = f"fixture:{fixturedef.argname}"
        try:
            yield
        finally:
            os.environ["SNAKETUNE_TEST"] = ENV["SNAKETUNE_TEST"] = before


# snaketune.core.imports.loading for this process, from configure to the end of collection:
# the collector off while collection imports the test modules (torch, transformers, ...),
# then what they made frozen, out of the session's later collections
COLLECTING = contextlib.ExitStack()


def pytest_configure(config) -> None:
    from snaketune.core.imports import loading

    config.pluginmanager.register(FixtureNames(), "snaketune-fixture-names")
    COLLECTING.enter_context(loading())


def pytest_collection_finish(session) -> None:
    COLLECTING.close()


def pytest_runtest_teardown(item, nextitem) -> None:
    """This process's own CPU seconds in the test (its setup and call), for the same
    accounting."""
    if hasattr(item, "cpu_began"):
        sitecustomize.cpu_line(sitecustomize.cpu_seconds() - item.cpu_began, item.nodeid,
                               "pytest")  # fmt: skip


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``gpu`` run where a CUDA GPU is and are skipped elsewhere (CI here has
    none); the GPU-aware tests without the mark check the right thing on either machine."""
    import torch

    log = os.environ.get("SNAKETUNE_CPU_LOG")
    if log:  # each test's fixtures (their closure), for tests/touched.py's map
        with open(f"{log}.fixtures", "a", encoding="utf-8") as out:
            out.writelines(f"{item.nodeid}\t{','.join(item.fixturenames)}\n" for item in items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def leaked_secrets(root: Path) -> list[str]:
    """'path: NAME' for every file under ``root`` holding one of the fake secrets."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path}: {k}" for k, v in FAKE_SECRETS.items() if v.encode() in data]
    return found


@contextlib.contextmanager
def tmpfs(path: Path, mib: float):
    """A tmpfs of ``mib`` MiB mounted on ``path`` (the tests run as root, as CI does)."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(mib * 1024)}k", "tmpfs",
                    str(path)], check=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def snakemake(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """Run snakemake with the local profile; fail with its output when ``check``. Its time
    limit is a hang's bound, not a speed check: a chain of several trainings on a loaded
    2-core machine has taken over 15 minutes (the DPO chain on a slow CI machine)."""
    cmd = [
        str(BIN / "snakemake"),
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--profile",
        str(ROOT / "profiles" / "local"),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=1800)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def started(out: str, rule: str) -> list[str]:
    """The wildcards (``run=demo``) of each ``rule`` job a pipeline's terminal says it
    started (snaketune's terminal: ``[12:00:00] started rule train (run=demo), job 4``)."""
    pattern = rf"(?m)^\[[\d:]+\] started rule {rule}(?: \((.*)\))?, job \d+$"
    return re.findall(pattern, out)


STAND_IN_SLURM = {
    # partition: (nodes, CPUs, memory MB, GPUs per node), time limit
    "tupi": ((4, 64, 512000, 4), "2-00:00:00"),
    "boost_usr_prod": ((4, 32, 494000, 4), "1-00:00:00"),
    "gpu": ((4, 128, 2000000, 8), "2-00:00:00"),
}


def stand_in_slurm(bin_dir: Path) -> Path:
    """`sinfo` and `scontrol` answering for the partitions of the shipped SLURM profiles,
    as their real counterparts print them (what snaketune.budget.slurmfit reads), for dry runs."""
    bin_dir.mkdir()
    nodes = "\n".join(
        f'    {name}) for i in $(seq 1 {n}); do echo "{name}$i|{cpus}|{mem}|gpu:{gpus}"; done ;;'
        for name, ((n, cpus, mem, gpus), _) in STAND_IN_SLURM.items()
    )
    limits = "\n".join(
        f'    {name}) echo "PartitionName={name} MaxNodes=UNLIMITED MaxTime={limit}" ;;'
        for name, (_, limit) in STAND_IN_SLURM.items()
    )
    (bin_dir / "sinfo").write_text(f"""#!/bin/bash
case "$*" in
  *%P*) echo "tupi*"; echo boost_usr_prod; echo gpu; exit 0 ;;
esac
part=$(echo "$*" | sed -n 's/.*-p \\([^ ]*\\).*/\\1/p')
case "$part" in
{nodes}
esac
""")
    (bin_dir / "scontrol").write_text(f"""#!/bin/bash
case "$3" in
{limits}
esac
""")
    # the SLURM plugin looks for a status command where sinfo is; nothing is ever queued
    (bin_dir / "squeue").write_text("#!/bin/bash\nexit 0\n")
    for tool in ("sinfo", "scontrol", "squeue"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def header_dry_run(example: Path, model: str, tmp_path: Path,
                   *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:  # fmt: skip
    """An example config's dry run as its header gives it (`snakemake --profile
    profiles/slurm --configfile <it> -n`, asserted), against a stand-in SLURM, in
    ``tmp_path/w`` with the config.json of its model ``model`` (the name in its `models`)
    where the download puts it, and its weights there (an empty stand-in). Returns the process (asserted 0) and each rule's resources."""
    import re
    import shlex

    import yaml

    spec = yaml.safe_load(example.read_text())["models"][model]
    where = tmp_path / "w/resources/models" / model
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(SHAPES[spec["id"]]))
    # downloaded, as the header's `--until download_model` leaves it: its weights stand in
    # by an empty file (else the disk plan counts the download still to come)
    (where / "model.safetensors").write_bytes(b"")
    (command,) = [line.strip("# ") for line in example.read_text().splitlines()
                  if "snakemake --profile" in line]  # fmt: skip
    args = shlex.split(command)[1:]
    assert args == ["--profile", "profiles/slurm", "--configfile",
                    str(example.relative_to(ROOT)), "-n"]  # fmt: skip
    env = {**ENV, "PATH": f"{stand_in_slurm(tmp_path / 'bin')}:{ENV['PATH']}"}
    proc = subprocess.run([str(BIN / "snakemake"), *args, *extra, "--directory", str(tmp_path / "w")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return proc, dict(re.findall(r"\nrule (\w+):.*?\n    resources: ([^\n]+)", proc.stdout, re.S))


def quick_config(path: Path, **run: object) -> Path:
    """Write the demo config with a short run (2 optimizer steps, 8 eval examples, ``run``
    overrides) to ``path``: for tests of scheduling and failure handling, not learning."""
    import yaml

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    demo = cfg["runs"]["demo"]
    del demo["epochs"]
    demo.update({"max_steps": 2, "save_steps": 1,
                 "eval": {"limit": 8, "max_new_tokens": 8, "batch_size": 8}, **run})  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def shared_build(name: str, build, tmp_path_factory) -> Path:
    """A workdir ``build(workdir)`` fills, once for the session; under tests/run.sh
    (SNAKETUNE_SHARED_DIR set) once for all its pytest runs: the first to need it builds it,
    the others wait on its lock. Tests copy it before changing it."""
    shared = os.environ.get("SNAKETUNE_SHARED_DIR")
    if not shared:
        workdir = tmp_path_factory.mktemp(name) / "w"
        build(workdir)
        return workdir
    import fcntl
    import shutil

    workdir = Path(shared) / name
    with open(Path(shared) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (Path(shared) / f"{name}.complete").exists():
            shutil.rmtree(workdir, ignore_errors=True)  # a failed attempt of another run
            build(workdir)
            (Path(shared) / f"{name}.complete").touch()
    return workdir


@pytest.fixture(scope="session")
def demo(tmp_path_factory) -> Path:
    """The whole demo (LoRA + ZeRO-2, 2 nodes x 1) through snakemake, uninterrupted; its
    kept checkpoints keep their optimizer states (tests continue from the older one)."""
    return shared_build("demo", run_demo, tmp_path_factory)


def run_demo(workdir: Path) -> Path:
    workdir.mkdir(parents=True)
    proc = snakemake(
        "--configfile", str(ROOT / "config" / "config.yaml"), "--directory", str(workdir),
        "--config", "runs={'demo': {'checkpoints': {'optimizer': 'all'}}}",
    )  # fmt: skip
    (workdir / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return workdir


def run_spec(**overrides) -> dict:
    """The demo run's config entry (validated, defaults filled) with ``overrides``."""
    from snaketune.plan.config import load_yaml, validate_config

    config = load_yaml(ROOT / "config" / "config.yaml")
    run = config["runs"]["demo"]
    run.update(overrides)
    if "max_steps" in overrides:
        del run["epochs"]
    if overrides.get("method") == "full":
        del run["lora"]
    return validate_config(config, ROOT)["runs"]["demo"]


# The keys the schema requires of every run besides its model, dataset and method.
REQUIRED = {"nodes": 2, "gpus_per_node": 1, "max_length": 128, "micro_batch_size": 4,
            "learning_rate": 1e-3}  # fmt: skip


def defaults_spec(method: str = "lora", **written) -> dict:
    """A run as a user's first config writes it: only the required keys (a model, a dataset,
    the method, ``REQUIRED``) and ``written``; every other key is the schema's default
    (validated)."""
    from snaketune.plan.config import validate_config

    config = {
        "models": {"m": {"source": "local", "path": "resources/models/m"}},
        "datasets": {"d": {"source": "local", "path": "data/train.jsonl",
                           "format": "prompt_response"}},
        "runs": {"x": {"model": "m", "dataset": "d", "method": method, **REQUIRED, **written}},
    }  # fmt: skip
    if "max_steps" not in written:  # one of the two is required
        config["runs"]["x"]["epochs"] = 1
    return validate_config(config, ROOT)["runs"]["x"]


def launch_train(workdir: Path, spec: dict, shards: Path, model: Path, preset: str, *extra: str,
                 threads: int | None = None):  # fmt: skip
    """scripts/train.py in ``workdir`` writing results/x/train, as a running process, with
    the threads Snakemake gives the train rule's job of the same run: OMP_NUM_THREADS = the
    rule's threads (nodes x gpus_per_node, at most the cores), which each worker keeps. Runs
    compared step by step must use the same count (float sums in another count differ in
    the last bits: measured 1e-7 at step 4 of the demo, past 1e-6 by step 53); ``threads``
    sets it for a run compared with one of another topology."""
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--run-spec", json.dumps(spec),
           "--shards", str(shards), "--model", str(model),
           "--deepspeed", str(ROOT / f"config/deepspeed/{preset}.json"), "--out", "results/x/train", *extra]  # fmt: skip
    threads = threads or min(spec["nodes"] * spec["gpus_per_node"], os.cpu_count() or 1)
    env = {**ENV, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def train_as_planned(workdir: Path, spec: dict, shards: Path, model: Path,
                     plan: list[list[list[dict]]], *extra: str) -> list[dict]:  # fmt: skip
    """Train ``spec`` (ZeRO-2) on ``shards`` to its max_steps, each rank logging the example
    ids it trains on; asserts it ends well, logs every step once and each rank trained the
    rows ``plan`` (oracles.planned_steps) gave it, step by step. Returns its metrics.
    ``extra``: more arguments of scripts/train.py (a scoring stage's --stage-input)."""
    proc = launch_train(workdir, spec, shards, model, "zero2",
                        "--log-example-ids", str(workdir / "ids"), *extra)  # fmt: skip
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    metrics = read_jsonl(workdir / "results/x/train/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, spec["max_steps"] + 1))
    for q in range(len(plan[0])):
        trained = (workdir / "ids" / f"rank-{q}.txt").read_text().split()
        assert trained == [r["example_id"] for step in plan for r in step[q]]
    return metrics


def workers_after(proc: subprocess.Popen, done: Path, timeout: float = 300) -> list:
    """Once file ``done`` exists (e.g. a checkpoint's COMPLETE mark; a glob pattern: once one
    matches), the worker processes (psutil) of the training ``proc`` started; fails if it
    ends or ``timeout`` passes first."""
    import glob
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while not glob.glob(str(done)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    return [p for p in psutil.Process(proc.pid).children(recursive=True)
            if "--worker" in p.cmdline()]  # fmt: skip


def pipeline_spec(pipeline_train: Path, workdir: Path) -> dict:
    """The spec a pipeline's train job ran with (its run_config.json: what a rerun of the
    same run gets, every default as the pipeline resolved it), for a training started in
    ``workdir``. Its paths (the held-out set, reference log-probs) are relative to the
    pipeline's directory: ``workdir`` gets links to its resources/ and results/ folders."""
    w = pipeline_train.parents[2]
    (workdir / "results").mkdir(parents=True, exist_ok=True)
    (workdir / "resources").symlink_to(w / "resources")
    for folder in (w / "results").iterdir():
        if folder.is_dir():
            (workdir / "results" / folder.name).symlink_to(folder)
    return json.loads((pipeline_train / "run_config.json").read_text())


def pipeline_inputs(pipeline_train: Path) -> list[str]:
    """The scoring stages' outputs a pipeline's train job read (its job.json), as the
    --stage-input arguments of scripts/train.py (paths relative to the pipeline's directory:
    pipeline_spec links them)."""
    from snaketune.budget.scoring import STAGES

    job = json.loads((pipeline_train / "job.json").read_text())
    read = [s.name for s in STAGES if s.name in job["inputs"]]
    return [a for k in read for a in ("--stage-input", f"{k}={job['inputs'][k]}")]


def kill_two_steps_on(proc: subprocess.Popen, live: Path, start: int, steps: int) -> bool:
    """SIGKILL the launcher ``proc`` of a training resumed from checkpoint ``start`` once its
    live rows (``live``) reach step ``start`` + 2, before its last step ``steps``; asserts no
    worker outlives it. False when it did not get there (it started over, ended or took
    300 s)."""
    import time

    import psutil

    reached = False
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            rows = read_jsonl(live) if live.exists() and live.read_text() else []
            if rows and rows[-1]["step"] < start:  # started over: the checkpoint not taken
                break
            if rows and start + 2 <= rows[-1]["step"] < steps:
                reached = True
                break
            time.sleep(0.05)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, [p.cmdline() for p in alive]  # no orphan worker
    finally:
        proc.kill()
        proc.communicate()
    return reached


def kill_and_resume(pipeline_train: Path, workdir: Path, spec: dict, shards: Path,
                    model: Path) -> tuple[int, list[dict]]:  # fmt: skip
    """A pipeline run's training again from its next-to-last checkpoint (its checkpoints
    directory copied, the last checkpoint left out): asserts it resumes there (``spec``
    must be the run's own: pipeline_spec), kills the launcher two steps later (asserting no
    orphan worker), then reruns it; asserts it resumes there again and logs every step
    once. Returns (that step, the resumed run's metrics) for the caller's figures."""
    import shutil

    from snaketune.core.checkpoints import is_reduced

    ckpt = workdir / "results/x/train/checkpoints"
    shutil.copytree(pipeline_train / "checkpoints", ckpt)
    steps = spec.get("max_steps") or read_jsonl(pipeline_train / "metrics.jsonl")[-1]["step"]
    every = spec["save_steps"]
    start = (steps - 1) // every * every  # the last periodic save before the final one
    saved = sorted(int(p.name.split("-")[1]) for p in ckpt.glob("checkpoint-*"))
    assert saved == [start, steps], saved
    # reduced to its weights (checkpoints.optimizer: last, the default) it cannot be resumed
    assert not is_reduced(ckpt / f"checkpoint-{start}"), "run it with checkpoints.optimizer: all"
    shutil.rmtree(ckpt / f"checkpoint-{steps}")
    live = ckpt / "metrics.jsonl"  # the pipeline's rows, cut back to `start` on resuming
    inputs = pipeline_inputs(pipeline_train)  # the scoring stages' outputs it read
    proc = launch_train(workdir, spec, shards, model, "zero2", *inputs)
    reached = kill_two_steps_on(proc, live, start, steps)
    first = (workdir / "results/x/train/logs/attempt-1.log").read_text()  # as it was written
    assert f"resuming from checkpoint-{start}" in first and reached, first[-3000:]
    out, _ = launch_train(workdir, spec, shards, model, "zero2", *inputs).communicate(timeout=600)
    assert f"resuming from checkpoint-{start}" in out, out[-3000:]
    resumed = read_jsonl(workdir / "results/x/train/metrics.jsonl")
    uninterrupted = read_jsonl(pipeline_train / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [m["step"] for m in uninterrupted]  # each step once
    return start, resumed


def train(workdir: Path, spec: dict, shards: Path, model: Path, preset: str, *extra: str,
          threads: int | None = None) -> Path:  # fmt: skip
    """Run scripts/train.py to the end; return results/x/train."""
    proc = launch_train(workdir, spec, shards, model, preset, *extra, threads=threads)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    return workdir / "results/x/train"


@pytest.fixture(scope="session")
def full_zero3(demo, tmp_path_factory) -> Path:
    """Full fine-tuning with ZeRO-3 on 2 nodes x 2 processes, one epoch of the demo's 2048
    examples (32 steps of 64), example ids logged, checkpoints 20 and 32 kept whole."""
    workdir = tmp_path_factory.mktemp("full_zero3")
    tokenized = next((demo / "results/tokenized").glob("arith__*/data.parquet"))
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/shard_dataset.py"), "--tokenized", str(tokenized),
         "--nodes", "2", "--gpus-per-node", "2", "--micro-batch-size", "16",
         "--gradient-accumulation-steps", "1", "--seed", "7", "--out", str(workdir / "shards")],
        check=True, env=ENV, capture_output=True,
    )  # fmt: skip
    spec = run_spec(method="full", nodes=2, gpus_per_node=2, gradient_accumulation_steps=1,
                    micro_batch_size=16, epochs=1,
                    learning_rate=1e-3, deepspeed="zero3", save_steps=20,
                    checkpoints={"optimizer": "all"})  # fmt: skip
    train(workdir, spec, workdir / "shards", demo / "resources/models/tiny", "zero3",
          "--log-example-ids", str(workdir / "ids"))  # fmt: skip
    (workdir / "base").write_text(str(demo / "resources/models/tiny"))  # what it started from
    return workdir


BASE_EOS = "<|endoftext|>"


def base_variant(model: Path, out: Path) -> Path:
    """A copy of the tiny model shaped like a Qwen base model: its own end-of-text token
    (a new special token, embeddings resized) is its eos and the only id its generation
    config stops on; its chat template still ends a turn with <|im_end|>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.add_special_tokens({"eos_token": BASE_EOS})
    m = AutoModelForCausalLM.from_pretrained(model)
    m.resize_token_embeddings(len(tok))
    eos = tok.convert_tokens_to_ids(BASE_EOS)
    m.config.eos_token_id = m.generation_config.eos_token_id = eos
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return out


STOP_SWEEP = {"learning_rate": [2.0e-3, 6.0e-3], "lora.r": [8]}
# its members' steps: 96 learn to stop on the template's end of turn (the extended tier's
# test of it); the CI tier's 16 train, export, evaluate and pick the best
STOP_SWEEP_STEPS = {"documented": 96, "ci": 16}


@pytest.fixture(scope="session")
def stop_sweep(demo, tmp_path_factory) -> Path:
    """A sweep through the local profile, on a base model that stops on another token than
    its chat template's end of turn (Qwen base models): the demo's LoRA run on 1 node, 96
    steps, as members of learning rate x LoRA rank (2e-3 or the demo's 6e-3; rank 8: a key
    of one value still names the members), 16 eval examples each; 96 steps, 16 in the CI
    tier (STOP_SWEEP_STEPS)."""
    import shutil

    import yaml

    work = tmp_path_factory.mktemp("stop_sweep")
    shutil.copytree(demo / "resources", work / "resources", symlinks=True)
    base = base_variant(demo / "resources/models/tiny", work / "qwen-like-base")
    cfg = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    cfg["models"]["qwen_like"] = {"source": "local", "path": str(base)}
    run = cfg["runs"].pop("demo")
    del run["epochs"]
    steps = STOP_SWEEP_STEPS["ci" if ci_tier() else "documented"]
    run.update(model="qwen_like", nodes=1, gradient_accumulation_steps=2, max_steps=steps,
               save_steps=steps, eval={"limit": 16, "max_new_tokens": 24, "batch_size": 16},
               sweep=STOP_SWEEP)  # fmt: skip
    cfg["runs"] = {"stops": run}
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # key order: names
    proc = snakemake("--configfile", str(work / "config.yaml"), "--directory", str(work),
                     check=False)  # fmt: skip
    (work / "snakemake.out").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return work


# The chains' start: sft_demo, the same run in config/grpo_demo.yaml and config/dpo_demo.yaml
SFT_TARGETS = ("results/sft_demo/eval/metrics.json", "results/sft_demo/train/provenance.json")


@pytest.fixture(scope="session")
def sft_demo(demo, tmp_path_factory) -> Path:
    """A copy of the finished demo with the GRPO and DPO chains' shared start, sft_demo,
    trained, merged and evaluated (once for the suite: each chain copies it)."""

    def build(workdir: Path) -> None:
        workdir.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", str(demo), str(workdir)], check=True)
        proc = snakemake(*SFT_TARGETS, "--configfile", str(ROOT / "config/config.yaml"),
                         str(ROOT / "config/grpo_demo.yaml"), "--directory", str(workdir),
                         "--config", chain_runs("sft_demo"))  # fmt: skip
        (workdir / "sft.out").write_text(proc.stdout + proc.stderr)

    return shared_build("sft_demo", build, tmp_path_factory)


@pytest.fixture(scope="session")
def grpo_chain(sft_demo, tmp_path_factory):
    """A copy of the finished demo and sft_demo (the ``sft_demo`` fixture), then `snakemake
    publish` with the GRPO overlay (its checkpoints kept whole: a test resumes from the older
    one)."""
    import time

    import yaml

    from snaketune.plan.config import load_yaml

    workdir = tmp_path_factory.mktemp("grpo") / "w"
    subprocess.run(["cp", "-a", str(sft_demo), str(workdir)], check=True)
    # and RLOO from the same SFT run with the same rollouts and rewards, to its evaluation
    # (tests/test_rloo.py), in both tiers
    run = load_yaml(ROOT / "config/grpo_demo.yaml")["runs"]["rl_demo"]
    run = {**{k: v for k, v in run.items() if k not in ("grpo", "eval_steps")},
           "method": "rloo", "rloo": run["grpo"], **RLOO_CHAINED}  # fmt: skip
    (workdir / "rloo.yaml").write_text(yaml.safe_dump({"runs": {"rloo_demo": run}}))
    start = time.monotonic()
    proc = snakemake("--configfile", str(ROOT / "config/config.yaml"), str(ROOT / "config" / "grpo_demo.yaml"),
                     str(workdir / "rloo.yaml"), "--directory", str(workdir), "publish",
                     "results/rloo_demo/eval/metrics.json", "--config",
                     chain_runs("sft_demo", whole=("rl_demo",)))  # fmt: skip
    (workdir / "grpo.out").write_text(proc.stdout + proc.stderr)
    (workdir / "grpo.seconds").write_text(f"{time.monotonic() - start:.0f}\n")
    return workdir


@pytest.fixture(scope="session")
def qlora_chain(demo, tmp_path_factory):
    """A copy of the finished demo, then the QLoRA overlay (its checkpoints kept whole: a
    test resumes from the older one) to the report."""
    workdir = tmp_path_factory.mktemp("qlora") / "w"
    subprocess.run(["cp", "-a", str(demo), str(workdir)], check=True)
    proc = snakemake("--configfile", str(ROOT / "config/config.yaml"), str(ROOT / "config/qlora_demo.yaml"),
                     "--directory", str(workdir), "--config",
                     chain_runs(whole=("qlora_demo",)))  # fmt: skip
    (workdir / "qlora.out").write_text(proc.stdout + proc.stderr)
    return workdir
