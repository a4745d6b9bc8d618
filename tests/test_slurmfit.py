"""Jobs that could never start, caught before queueing (resources against the partition)
and while pending (reasons that never clear). Against sinfo/scontrol/squeue outputs; the
live check on the local SLURM cluster is in tests/test_slurm.py."""

from __future__ import annotations

import pytest

from snaketune.budget import slurmfit
from snaketune.budget.slurmfit import (
    Node,
    Partition,
    PendingWatch,
    asks,
    hopeless,
    minutes,
    problems,
)

TUPI = Partition("tupi", [Node("n1", 2, 8000, 0), Node("n2", 2, 8000, 0)], None, 24 * 60)
GPU = Partition("gpu", [Node(f"g{i}", 32, 256000, 4) for i in range(2)], 2, None)


def test_minutes_of_slurm_times():
    assert minutes("UNLIMITED") is None and minutes("INFINITE") is None
    assert minutes("30") == 30 and minutes("1-00:00:00") == 1440 and minutes("2:00:00") == 120
    assert minutes("05:30") == 5.5


def test_asks_per_node():
    assert asks({"nodes": 2, "tasks": 2, "cpus_per_task": 32, "mem_mb": 1000, "gres": "gpu:4"}) == {
        "nodes": 2, "cpus": 32, "mem_mb": 1000, "gpus": 4, "runtime": 0}  # fmt: skip
    assert asks({"cpus_per_task": 8, "tasks": 2})["cpus"] == 16  # two tasks on one node


def test_what_the_user_met_on_tupi_is_refused_naming_rule_resource_and_key():
    found = problems(
        "tokenize_dataset", {"cpus_per_task": 8, "mem_mb": 32000, "runtime": 120}, TUPI
    )
    assert found == [
        "rule tokenize_dataset: asks 8 CPUs per node, the largest node of partition tupi has 2; "
        "lower set-resources tokenize_dataset: cpus_per_task in the profile",
        "rule tokenize_dataset: asks 32000 MB of memory per node, the largest node of partition "
        "tupi has 8000; lower set-resources tokenize_dataset: mem_mb in the profile",
    ]


def test_gpus_nodes_and_time():
    train = {"nodes": 4, "tasks": 4, "cpus_per_task": 32, "mem_mb": 200000, "gres": "gpu:8",
             "runtime": 2880}  # fmt: skip
    (gpus,) = problems("train", train, GPU)
    assert "asks 8 GPUs per node" in gpus and "the run's gpus_per_node" in gpus
    (nodes,) = problems("train", {**train, "gres": "gpu:4"}, GPU)
    assert "asks 4 nodes, partition gpu has 2 that fit it" in nodes
    assert problems("train", {**train, "gres": "gpu:4", "nodes": 2, "tasks": 2}, GPU) == []
    (time,) = problems("train", {"runtime": 2880}, TUPI)
    assert "asks 2880 minutes, partition tupi allows 1440" in time and "runtime" in time
    assert problems("evaluate", {"gres": "gpu:1", "cpus_per_task": 2}, TUPI)[0].startswith(
        "rule evaluate: asks 1 GPUs per node"
    )


def test_a_rules_jobs_name_their_runs(monkeypatch):
    """Three runs, two of them asking more GPUs per node than the partition has: one line
    naming both, with the key to change; a run that fits is not named."""
    from snaketune.budget import slurmfit

    monkeypatch.setattr(slurmfit, "read_partition", lambda name: GPU)
    big = {"nodes": 1, "tasks": 1, "cpus_per_task": 8, "mem_mb": 1000, "gres": "gpu:16"}
    fits = {**big, "gres": "gpu:4"}
    jobs = [("train", big), ("train", fits), ("train", big), ("tokenize_dataset", fits)]
    assert slurmfit.check_jobs(jobs, ["sft", "small", "dpo", None]) == [
        "rule train (runs dpo, sft): asks 16 GPUs per node, the largest node of partition gpu "
        "has 4; lower each run's gpus_per_node in the config"]  # fmt: skip
    (line,) = slurmfit.check_jobs(jobs[:1], ["sft"])
    assert line.startswith("rule train (run sft): asks 16 GPUs per node") and (
        "lower runs.sft.gpus_per_node in the config") in line  # fmt: skip


def test_hopeless_reasons():
    assert "time limit" in hopeless("PartitionTimeLimit")
    assert hopeless("PartitionConfig") and hopeless("BadConstraints")
    for waiting in ("Resources", "Priority", "Dependency", "BeginTime", "QOSMaxJobsPerUserLimit"):
        assert hopeless(waiting) is None, waiting
    reason = "ReqNodeNotAvail, UnavailableNodes:gpu99"
    assert hopeless(reason, lambda n: False).endswith("(it does not exist)")
    assert hopeless(reason, lambda n: True) is None  # down for now: it may come back


def test_watch_cancels_only_this_workflows_hopeless_jobs(monkeypatch):
    squeue = ("101|rule_tokenize_dataset_wildcards_x|/work/a|PartitionConfig\n"
              "102|rule_train_wildcards_demo|/work/a|Resources\n"
              "103|rule_train_wildcards_demo|/elsewhere|PartitionConfig\n")  # fmt: skip
    cancelled = []
    monkeypatch.setattr(slurmfit, "_run", lambda cmd: squeue)
    monkeypatch.setattr(slurmfit.subprocess, "run", lambda cmd, **kw: cancelled.append(cmd))
    lines = []
    watch = PendingWatch("/work/a", on_cancel=lines.append)
    watch.check_once()
    watch.check_once()  # a job is cancelled once
    assert cancelled == [["scancel", "101"]]
    assert lines == [
        "error: SLURM job 101 (rule_tokenize_dataset_wildcards_x) can never start: "
        "PartitionConfig: the job asks for more than the partition allows (CPUs, nodes, GPUs); "
        "cancelled. Fix the resource in the profile or the config, then rerun"
    ]


@pytest.mark.parametrize("gres,n", [("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("(null)", 0),
                                    ("gpu:a100:2,gpu:v100:2", 4)])  # fmt: skip
def test_gpus_from_sinfo_gres(gres, n):
    assert slurmfit._gpus(gres) == n
