"""The workflow itself: formatting, lint, dry-runs of every shipped config, and a real run
of the data stages on the local profile (in a scratch directory, via --directory)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import BIN, ENV, ROOT, snakemake, started

EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))


def test_snakefmt_check():
    proc = subprocess.run(
        [str(BIN / "snakefmt"), "--check", "Snakefile", "workflow"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_ruff_lint_and_format():
    for args in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([str(BIN / "ruff"), *args], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_snakemake_lint_is_clean():
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--lint"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Lints for" not in out, out


def _jobs(dry_run_output: str) -> dict[str, int]:
    """Job counts from the 'Job stats' table of a dry run."""
    lines = dry_run_output.split("Job stats:")[1].splitlines()[3:]
    counts = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        counts[parts[0]] = int(parts[1])
    return counts


def test_dry_run_demo(tmp_path):
    proc = snakemake(
        "-n", "--configfile", str(ROOT / "config" / "config.yaml"), "--directory", str(tmp_path)
    )
    assert _jobs(proc.stdout) == {
        "make_fixtures": 1,
        "download_model": 1,
        "download_dataset": 2,
        "tokenize_dataset": 2,
        "shard_dataset": 1,
        "train": 1,
        "convert_checkpoint": 1,
        "merge_lora": 1,
        "evaluate_base": 1,
        "evaluate": 1,
        "report": 1,
        "all": 1,
    }


def test_building_the_dag_imports_no_ml_library(demo, tmp_path):
    """Every snakemake call, and each SLURM job's own, builds the DAG (the config's checks,
    the plans of a model that is there): importing torch there (it once came in through the
    4-bit module's dtype table) cost each of them ~1.2 s. A dry run of the finished demo
    with training forced (its memory and disk planned) imports no ML library."""
    import sys

    work = tmp_path / "w"  # a copy: the other runs copy the shared demo meanwhile
    subprocess.run(["cp", "-a", str(demo), str(work)], check=True)
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"),
         "--profile", str(ROOT / "profiles/local"), "--configfile", str(ROOT / "config/config.yaml"),
         "--directory", str(work), "-n", "--forcerun", "train"],
        env=ENV, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "disk plan: demo:" in proc.stderr and "memory plan: demo:" in proc.stderr  # planned
    imported = {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if "|" in ln}
    assert "snaketune.budget.memplan" in imported
    heavy = {"torch", "transformers", "peft", "deepspeed", "trl", "accelerate", "bitsandbytes"}
    assert not imported & heavy, sorted(imported & heavy)


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.stem)
def test_dry_run_examples(config, tmp_path):
    (tmp_path / "config").symlink_to(ROOT / "config")  # chat templates are found from the workdir
    proc = snakemake("-n", "--configfile", str(config), "--directory", str(tmp_path))
    jobs = _jobs(proc.stdout)
    assert jobs["shard_dataset"] == len(__import__("yaml").safe_load(config.read_text())["runs"])
    assert "make_fixtures" not in jobs  # --configfile replaced the demo config


def test_config_error_is_one_line_without_traceback(tmp_path):
    proc = snakemake(
        "-n",
        "--configfile",
        str(ROOT / "config" / "config.yaml"),
        "--config",
        "runs={'demo': {'method': 'lorra'}}",
        "--directory",
        str(tmp_path),
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "config error: runs.demo.method: 'lorra' is not one of ['lora', 'full', 'grpo', 'dpo', 'reward', 'simpo', 'orpo', 'kto', 'rloo', 'distill', 'opd']"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and 'File "' not in proc.stderr


@pytest.mark.slow
def test_data_stages_run_on_the_local_profile(demo, tmp_path):
    """The data stages as the demo ran them on the local profile (a copy of it, mtimes
    kept: nothing is due), then what a change or a forced stage reruns."""
    config = str(ROOT / "config" / "config.yaml")
    shards = "results/demo/shards"
    tmp_path = tmp_path / "w"
    subprocess.run(["cp", "-a", str(demo), str(tmp_path)], check=True)
    manifest = json.loads((tmp_path / "results/demo/shards/manifest.json").read_text())
    assert manifest["nodes"] == 2 and manifest["global_batch"] == 64
    assert (
        manifest["steps_per_epoch"] == 2048 // 64 and manifest["dropped_for_balance"]["count"] == 0
    )
    ids = []
    for entry in manifest["shards"]:
        table = pq.read_table(tmp_path / "results/demo/shards" / entry["file"])
        assert table.num_rows == entry["rows"] == 1024
        ids += table.column("example_id").to_pylist()
    assert sorted(ids) == sorted(f"arith:{i}" for i in range(2048))
    # the training set and the eval set (shard_dataset checks that they do not overlap)
    assert len(list((tmp_path / "results/tokenized").iterdir())) == 2
    tokenized = next((tmp_path / "results/tokenized").glob("arith__*"))
    stats = json.loads((tokenized / "stats.json").read_text())
    assert stats["rows"] == 2048 and stats["dropped_overlong"] == 0
    prov = json.loads((tmp_path / "resources/models/tiny/provenance.json").read_text())
    assert prov["source"] == "local" and "model.safetensors" in prov["files"]
    prov = json.loads((tmp_path / "resources/datasets/arith/provenance.json").read_text())
    assert prov["rows"] == 2048 and len(prov["files"]["train.jsonl"]) == 64

    # Nothing to redo; a training-only change reuses the tokens and the shards.
    assert (
        "Nothing to be done"
        in snakemake(shards, "-n", "--configfile", config, "--directory", str(tmp_path)).stdout
    )

    def dry_run_with(override: str) -> str:
        args = ("-n", "--configfile", config, "--config", override, "--directory", str(tmp_path))
        return snakemake(shards, *args).stdout

    assert "Nothing to be done" in dry_run_with("runs={'demo': {'learning_rate': 0.1}}")
    # The whole pipeline's dry run after a one-key change names that key, in the config's
    # words, beside Snakemake's own reason (the run spec's whole diff)
    args = ("-n", "--configfile", config, "--directory", str(tmp_path))
    as_ran = "'checkpoints': {'optimizer': 'all'}"  # the demo fixture's (conftest.chain_runs)
    said = snakemake(
        *args, "--config", f"runs={{'demo': {{{as_ran}, 'learning_rate': 0.1}}}}"
    ).stderr
    retrains = [ln for ln in said.splitlines() if ln.startswith("plan: demo: retrains: ")]
    assert retrains == ["plan: demo: retrains: runs.demo.learning_rate: 0.006 -> 0.1"], said[-3000:]
    # A tokenization key change makes new tokenized copies (training and eval set) and new
    # shards, nothing earlier.
    assert _jobs(dry_run_with("runs={'demo': {'max_length': 128}}")) == {
        "tokenize_dataset": 2,
        "shard_dataset": 1,
    }
    # A stage reruns alone on request.
    proc = snakemake(
        shards,
        "--configfile",
        config,
        "--forcerun",
        "shard_dataset",
        "--until",
        "shard_dataset",
        "--directory",
        str(tmp_path),
    )
    assert started(proc.stderr, "shard_dataset") and not started(proc.stderr, "tokenize_dataset")
    assert "1 job: shard_dataset 1" in proc.stderr.splitlines(), proc.stderr[-3000:]


@pytest.mark.slow
def test_bad_data_fails_the_rule_with_one_line(tmp_path):
    """A bad row past the first rows the parse-time check reads (64) fails the tokenize job
    that meets it, with one line naming the row."""
    good = '{"question": "q", "answer": "a"}\n' * 70
    (tmp_path / "d.jsonl").write_text(good + '{"question": "q", "answer": null}\n')
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        (ROOT / "config" / "config.yaml")
        .read_text()
        .replace("resources/fixtures/arith-demo/train.jsonl", str(tmp_path / "d.jsonl"))
    )
    proc = snakemake(
        "results/demo/shards", "--configfile", str(cfg), "--directory", str(tmp_path), check=False
    )
    assert proc.returncode != 0
    (log,) = (tmp_path / "logs/tokenize_dataset").glob("arith__*")
    assert log.read_text().strip().splitlines()[-1] == (
        "error: datasets.arith row 70: column 'answer' is null; clean the data or filter the row "
        "out"
    )
    assert not list((tmp_path / "results/tokenized").glob("arith__*/data.parquet"))


@pytest.mark.parametrize("profile", ["tupi", "leonardo", "slurm"])
def test_cluster_profiles_dry_run_with_resources_per_stage(profile, tmp_path):
    """Each cluster profile parses, and resolves train to nodes x GPUs with the plugin's
    `mpi` switch, CPU stages to CPUs + memory without a GPU, evaluate to one GPU. (The dry
    run checks every job against its partition: a stand-in sinfo answers for the profiles'
    partitions, which the test cluster does not have.)"""
    from conftest import stand_in_slurm

    cmd = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"),
           "--profile", str(ROOT / "profiles" / profile), "--directory", str(tmp_path / "w"),
           "-n", "--printshellcmds"]  # fmt: skip
    env = {**ENV, "PATH": f"{stand_in_slurm(tmp_path / 'bin')}:{ENV['PATH']}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resources = dict(re.findall(r"\nrule (\w+):.*?\n\s+resources: ([^\n]+)", proc.stdout, re.S))
    train = resources["train"]
    assert "nodes=2" in train and "tasks=2" in train and "mpi=srun" in train
    assert "gres=gpu:1" in train and "tasks_per_gpu=0" in train and "slurm_partition=" in train
    for cpu_stage in ("tokenize_dataset", "shard_dataset", "convert_checkpoint", "merge_lora"):
        assert "cpus_per_task=" in resources[cpu_stage] and "gres=" not in resources[cpu_stage]
    assert "gres=gpu:1" in resources["evaluate"]


@pytest.mark.parametrize("profile", ["tupi", "leonardo", "slurm"])
def test_every_registered_scoring_stage_has_its_resources_in_each_cluster_profile(profile):
    """A scoring stage (snaketune.budget.scoring) runs on the GPUs of the run it serves and
    loads a whole model: each cluster profile gives each registered stage CPUs and memory
    of its own (the rule's 16 GB default is less than loading an 8B takes)."""
    import yaml

    from snaketune.budget.scoring import STAGES

    given = yaml.safe_load((ROOT / "profiles" / profile / "config.yaml").read_text())
    per_rule = given["set-resources"]
    for stage in STAGES:
        assert {"cpus_per_task", "mem_mb"} <= set(per_rule.get(stage.name) or {}), stage.name
        assert per_rule[stage.name] == per_rule["reference_logps"], stage.name  # as the first


def test_the_scoring_stages_share_one_rule_body():
    """Every registered scoring stage is a rule of workflow/rules/scoring.smk, the first
    written out and each other one `use`d from it (its own inputs, output, log)."""
    from snaketune.budget.scoring import STAGES

    text = (ROOT / "workflow/rules/scoring.smk").read_text()
    first, *others = STAGES
    assert text.count("\nrule ") == 1 and f"\nrule {first.name}:" in text
    for stage in others:
        assert f"use rule {first.name} as {stage.name} with:" in text
        assert f'"results/{stage.name}/{{ref}}/{stage.output}"' in text
    assert f'"results/{first.name}/{{ref}}/{first.output}"' in text


def test_single_node_train_runs_its_own_srun_step(tmp_path):
    """One node too: the `mpi` key is there (the job-step plugin then runs the shell
    unwrapped, the launcher starts the srun step, so SLURM's --signal reaches only the
    training processes), as 0: the submitting plugin refuses an MPI job of one task, and
    reads 0 as a plain --ntasks=1 job (the SLURM sweep test submits 1-node train jobs)."""
    config = (ROOT / "config/config.yaml").read_text().replace("nodes: 2", "nodes: 1")
    (tmp_path / "one-node.yaml").write_text(config)
    proc = snakemake(
        "-n", "--directory", str(tmp_path), "--configfile", str(tmp_path / "one-node.yaml")
    )
    train = re.search(r"\nrule train:.*?\n\s+resources: ([^\n]+)", proc.stdout, re.S).group(1)
    assert "nodes=1" in train and "tasks=1" in train and "mpi=0" in train, train


def _big_run_config(tmp_path, **run) -> Path:
    """A config whose model is a folder holding Llama-3.2-1B's config.json alone (all a plan
    reads), a LoRA run on an A100 40GB with 64k-token sequences: about 500 GiB per GPU."""
    from conftest import SHAPES

    model = tmp_path / "llama-1b-config-only"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SHAPES["meta-llama/Llama-3.2-1B"]))
    # enough rows for a step of the largest layout its tests ask (8 nodes x 4 GPUs x 8)
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1?", "response": "#### 2"}\n' * 300)
    spec = {"model": "llama1b", "dataset": "d", "method": "lora", "deepspeed": "zero2",
            "nodes": 1, "gpus_per_node": 4, "max_length": 65536, "micro_batch_size": 8,
            "max_steps": 10, "learning_rate": 1e-4, "gpu": "a100-40gb", **run}  # fmt: skip
    config = {"models": {"llama1b": {"source": "local", "path": str(model)}},
              "datasets": {"d": {"source": "local", "path": str(tmp_path / "data.jsonl"),
                                 "format": "prompt_response"}},
              "runs": {"big": spec}}  # fmt: skip
    path = tmp_path / "big.yaml"
    path.write_text(__import__("yaml").safe_dump(config))
    return path


def test_a_dry_run_refuses_what_queueing_would_refuse(tmp_path):
    """The memory plan answers in a dry run as before queueing: refused with its line and
    exit 1, nothing run; skip_memory_check still overrides."""
    path = _big_run_config(tmp_path)
    proc = snakemake("-n", "--configfile", str(path), "--directory", str(tmp_path / "w"),
                     check=False)  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("error: big: ") and "does NOT fit" in errors[0], errors
    assert "against GPU 39.4 GiB" in errors[0] and "skip_memory_check: true" in errors[0]
    assert errors[-1] == "error: 1 problem(s) found before a dry run; nothing was run"
    assert not (tmp_path / "w/results").exists()
    (tmp_path / "skip").mkdir()
    path = _big_run_config(tmp_path / "skip", skip_memory_check=True)
    proc = snakemake("-n", "--configfile", str(path), "--directory", str(tmp_path / "w2"))
    assert "(skip_memory_check is set: going ahead)" in proc.stderr
    assert "This was a dry-run" in proc.stdout


def test_a_dry_run_checks_the_partition(tmp_path):
    """Through a SLURM profile, against a stand-in sinfo/scontrol: 8 nodes on a 4-node
    partition is refused in the dry run."""
    from conftest import stand_in_slurm

    path = _big_run_config(tmp_path, max_length=512, nodes=8, gpus_per_node=4)
    env = {**ENV, "PATH": f"{stand_in_slurm(tmp_path / 'bin')}:{ENV['PATH']}"}
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--profile", "profiles/tupi", "--configfile", str(path), "-n",
         "--directory", str(tmp_path / "w")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any("rule train (run big): asks 8 nodes, partition tupi has 4" in e
               for e in errors), errors  # fmt: skip


def test_a_given_config_replaces_the_demo_in_a_spawned_job_too(tmp_path):
    """A SLURM job's snakemake gets the config files but not --replace-workflow-config. Run
    the same way (no profile) where config/config.yaml is found (the repository, where
    users run), a config given must still replace the demo's: its run `demo` with
    max_steps would otherwise also get the demo's epochs (a config error in every job)."""
    from conftest import quick_config

    (tmp_path / "config").symlink_to(ROOT / "config")
    quick = quick_config(tmp_path / "quick.yaml")
    cmd = [str(BIN / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "-n",
           "--directory", str(tmp_path), "--configfiles", str(quick)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "give exactly one of `epochs` and `max_steps`" not in proc.stderr
    assert "This was a dry-run" in proc.stdout


@pytest.mark.slow
def test_until_on_a_chained_config_runs_or_names_the_targets_that_do(tmp_path):
    """`--until RULE` on the SFT -> DPO chain, for every stage a run passes through: either
    Snakemake's own dry run plans it to the end (no "BUG: Out of jobs ready"), or the rule is
    refused before anything runs with one line naming targets, and a dry run of those plans
    each run's RULE job (the later run's included)."""
    from concurrent.futures import ThreadPoolExecutor

    configs = ("--configfile", str(ROOT / "config/config.yaml"), str(ROOT / "config/dpo_demo.yaml"))
    # (the rules of a run's own stages; those before them hold no run)
    rules = ("shard_dataset", "reference_logps", "train", "convert_checkpoint", "merge_lora",
             "evaluate")  # fmt: skip

    def dry(*args: str) -> subprocess.CompletedProcess:
        return snakemake("-n", *configs, "--directory", str(tmp_path), *args, check=False)

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = dict(zip(rules, pool.map(lambda r: dry("--until", r), rules), strict=True))
    refused = {}
    for rule, proc in procs.items():
        output = proc.stdout + proc.stderr
        assert "BUG: Out of jobs" not in output, (rule, output[-3000:])
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: --until")]
        if proc.returncode != 0:
            (line,) = lines
            assert "dpo_demo from sft_demo" in line, line
            refused[rule] = line.split("config files): snakemake ")[1].split()[:-2]
        else:
            assert not lines
    assert set(refused) == {"train", "convert_checkpoint", "merge_lora"}, refused
    for rule, targets in refused.items():
        proc = dry(*targets)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        planned = re.findall(rf"rule {rule}:\n(?:.*\n)*?    wildcards: run=(\w+)", proc.stdout)
        named = {target.split("/")[1] for target in targets}
        assert "dpo_demo" in named and named <= set(planned), (rule, targets, planned)
