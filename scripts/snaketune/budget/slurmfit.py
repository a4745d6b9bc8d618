"""Jobs that could never start: resources checked against the partition before anything is
queued, and pending jobs whose SLURM reason can never clear.

``check_jobs`` compares what each job of the plan asks (nodes, CPUs per node, memory per
node, GPUs per node, time) with what the largest node of its partition has (``sinfo``) and
the partition's limits (``scontrol show partition``); the Snakefile's ``onstart`` runs it
before the first submission and stops the workflow with one line per problem.

``PendingWatch`` polls ``squeue`` for this workflow's pending jobs (same working directory)
and cancels one whose reason can never clear by waiting, with the reason named; the
executor plugin then reports that job as failed.
"""

from __future__ import annotations

import logging
import math
import re
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from snaketune.plan.pipeline import TRAIN

log = logging.getLogger(__name__)

# Pending reasons that waiting never clears: the job asks what the partition, the account
# or the QOS does not allow per job, or what no node has.
HOPELESS = {
    "BadConstraints": "no node has the features, GPUs or memory the job asks for",
    "PartitionConfig": "the job asks for more than the partition allows (CPUs, nodes, GPUs)",
    "PartitionNodeLimit": "the job asks for more nodes than the partition allows",
    "PartitionTimeLimit": "the job's time limit is above the partition's",
    "InvalidAccount": "the account does not exist or may not use this partition",
    "InvalidQOS": "the QOS does not exist or may not be used with this account",
    "QOSMaxWallDurationPerJobLimit": "the job's time is above the QOS's per-job limit",
    "QOSMaxCpuPerJobLimit": "the job asks for more CPUs than the QOS allows per job",
    "QOSMaxGRESPerJob": "the job asks for more GPUs than the QOS allows per job",
    "QOSMaxNodePerJobLimit": "the job asks for more nodes than the QOS allows per job",
    "QOSMaxMemoryPerJob": "the job asks for more memory than the QOS allows per job",
    "ReqNodeNotAvail": "a node the job requires is not available",  # see hopeless()
}


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int
    gpus: int


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: list[Node]
    max_nodes: int | None  # per job
    max_time_min: float | None


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def _gpus(gres: str) -> int:
    """GPUs in an sinfo %G field, e.g. ``gpu:4``, ``gpu:a100:4(S:0-1)``, ``(null)``."""
    total = 0
    for part in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", part.strip())
        if m:
            total += int(m.group(1))
    return total


def minutes(limit: str) -> float | None:
    """A SLURM time (``UNLIMITED``, ``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``) in minutes."""
    if limit in ("UNLIMITED", "INFINITE", "NONE", "n/a", ""):
        return None
    days, _, rest = limit.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:  # minutes
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:  # MM:SS
        h, m, s = 0, parts[0], parts[1]
    else:
        h, m, s = parts
    return (int(days or 0) * 24 + h) * 60 + m + s / 60


def read_partition(name: str | None) -> Partition:
    """The nodes and per-job limits of partition ``name`` (None: the default partition)."""
    if name is None:
        default = [p for p in _run(["sinfo", "-h", "-o", "%P"]).split() if p.endswith("*")]
        if not default:
            raise LookupError("no default partition")
        name = default[0].rstrip("*")
    nodes = []
    for line in _run(["sinfo", "-h", "-N", "-p", name, "-o", "%N|%c|%m|%G"]).splitlines():
        node, cpus, mem, gres = line.split("|")
        nodes.append(Node(node, int(cpus.rstrip("+")), int(mem.rstrip("+")), _gpus(gres)))
    if not nodes:
        raise LookupError(f"partition {name} has no nodes (or does not exist)")
    info = dict(re.findall(r"(\w+)=(\S+)", _run(["scontrol", "show", "partition", name])))
    max_nodes = info.get("MaxNodes", "UNLIMITED")
    return Partition(
        name=name,
        nodes=nodes,
        max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
        max_time_min=minutes(info.get("MaxTime", "UNLIMITED")),
    )


def asks(resources: dict[str, Any]) -> dict[str, float]:
    """What a job asks per node (CPUs, memory, GPUs), in nodes and in minutes."""
    nodes = int(resources.get("nodes") or 1)
    tasks = int(resources.get("tasks") or nodes)
    per_node_tasks = math.ceil(tasks / nodes)
    gres = str(resources.get("gres") or "")
    return {
        "nodes": nodes,
        "cpus": int(resources.get("cpus_per_task") or 1) * per_node_tasks,
        "mem_mb": float(resources.get("mem_mb") or 0),
        "gpus": _gpus(gres) if gres else 0,
        "runtime": float(resources.get("runtime") or 0),
    }


def _label(rule: str, runs: list[str]) -> tuple[str, str]:
    """("rule R (run a)", "runs.a.") for the jobs of ``runs``; ("rule R", "") for none."""
    if not runs:
        return f"rule {rule}", ""
    if len(runs) == 1:
        return f"rule {rule} (run {runs[0]})", f"runs.{runs[0]}."
    return f"rule {rule} (runs {', '.join(runs)})", "each run's "


def problems(
    rule: str, resources: dict[str, Any], part: Partition, runs: list[str] = ()
) -> list[str]:
    """One line per resource the job asks that no node or limit of the partition gives;
    the jobs of ``runs`` (a rule per run) are named."""
    ask = asks(resources)
    label, key_of = _label(rule, list(runs))
    whose = key_of or "the run's "
    out = []
    big = {
        "cpus": max(n.cpus for n in part.nodes),
        "mem_mb": max(n.mem_mb for n in part.nodes),
        "gpus": max(n.gpus for n in part.nodes),
    }
    key = {"cpus": "cpus_per_task", "mem_mb": "mem_mb", "gpus": "gres"}
    what = {"cpus": "CPUs per node", "mem_mb": "MB of memory per node", "gpus": "GPUs per node"}
    for res in ("cpus", "mem_mb", "gpus"):
        if ask[res] > big[res]:
            fix = f"set-resources {rule}: {key[res]} in the profile"
            if rule == TRAIN.name and res == "gpus":
                fix = f"{whose}gpus_per_node in the config"
            out.append(
                f"{label}: asks {ask[res]:g} {what[res]}, the largest node of partition "
                f"{part.name} has {big[res]:g}; lower {fix}"
            )
    fitting = [
        n
        for n in part.nodes
        if n.cpus >= ask["cpus"] and n.mem_mb >= ask["mem_mb"] and n.gpus >= ask["gpus"]
    ]
    node_limit = min(len(part.nodes), part.max_nodes or len(part.nodes))
    if not out and ask["nodes"] > min(len(fitting), node_limit):
        out.append(
            f"{label}: asks {ask['nodes']} nodes, partition {part.name} has "
            f"{min(len(fitting), node_limit)} that fit it; lower {whose}nodes "
            "in the config"
        )
    if part.max_time_min is not None and ask["runtime"] > part.max_time_min:
        out.append(
            f"{label}: asks {ask['runtime']:g} minutes, partition {part.name} allows "
            f"{part.max_time_min:g}; lower set-resources {rule}: runtime in the profile (a "
            "longer training continues across jobs by itself)"
        )
    return out


def check_jobs(jobs: list[tuple[str, dict[str, Any]]], runs: list[str | None] = ()) -> list[str]:
    """Problems of every (rule, resources) job against its partition; the jobs of a rule
    that ask the same once, naming their runs (``runs``: each job's, None for a job of no
    run), and a partition that cannot be read once (naming its rules)."""
    found: list[str] = []
    partitions: dict[str | None, Partition] = {}
    unreadable: dict[str | None, tuple[str, list[str]]] = {}  # partition: (why, rules)
    groups: dict[tuple, tuple[str, dict[str, Any], list[str]]] = {}
    for (rule, resources), run in zip(jobs, list(runs) or [None] * len(jobs), strict=True):
        part_name = resources.get("slurm_partition") or None
        sig = (rule, part_name, tuple(sorted(asks(resources).items())))
        named = groups.setdefault(sig, (rule, resources, []))[2]
        if run is not None and run not in named:
            named.append(run)
    for (rule, part_name, _), (_, resources, named) in groups.items():
        if part_name in unreadable:
            unreadable[part_name][1].append(rule)
            continue
        if part_name not in partitions:
            try:
                partitions[part_name] = read_partition(part_name)
            except (LookupError, subprocess.SubprocessError, OSError, ValueError) as exc:
                unreadable[part_name] = (str(exc), [rule])
                continue
        found += [
            p
            for p in problems(rule, resources, partitions[part_name], sorted(named))
            if p not in found
        ]
    for part_name, (why, rules) in unreadable.items():
        names = ", ".join(dict.fromkeys(rules))
        found.append(
            f"partition {part_name or '(default)'} (rules {names}): cannot read it: "
            f"{why}; check slurm_partition in the profile"
        )
    return found


SIGNAL = re.compile(r"--signal[= ]\s*(?:[RB]{1,2}:)?([A-Za-z0-9]+)(?:@(\d+))?")


def signal_lead(slurm_extra: str) -> tuple[str, int] | None:
    """(signal, seconds before the end) of a ``--signal=[R|B:]SIG[@SECONDS]`` in sbatch
    options (SLURM's default lead: 60 s); None without one."""
    found = SIGNAL.search(slurm_extra or "")
    if found is None:
        return None
    return found.group(1), int(found.group(2) or 60)


def check_signal_leads(jobs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """A job whose ``--signal`` lead is over half its runtime: SLURM sends the signal as
    soon as the end is that close, so every train job would save and requeue after its
    first step (each rule once)."""
    found = []
    for rule, resources in jobs:
        lead = signal_lead(str(resources.get("slurm_extra") or ""))
        runtime = resources.get("runtime")
        if lead is None or not isinstance(runtime, (int, float)) or lead[1] * 2 <= runtime * 60:
            continue
        sig, seconds = lead
        line = (
            f"{rule}: slurm_extra's --signal={sig}@{seconds} comes {seconds} s before the "
            f"end of a {runtime:g}-minute job, more than half of it: every job would stop "
            f"after its first step; lower the lead to at most {int(runtime * 30)} s (e.g. "
            f"--signal={sig}@{int(runtime * 30)} in the profile's set-resources, with "
            "stop_margin_seconds to match) or raise the rule's runtime"
        )
        if line not in found:
            found.append(line)
    return found


def hopeless(reason: str, node_exists=None) -> str | None:
    """Why a pending job with this squeue reason can never start (None: it may)."""
    base = reason.split("(")[0].strip().rstrip(",")
    if base.startswith("ReqNodeNotAvail"):
        # hopeless only when a required node does not exist at all
        missing = re.findall(r"UnavailableNodes:([^)\s]+)", reason)
        if missing and node_exists is not None and not all(node_exists(n) for n in missing):
            return HOPELESS["ReqNodeNotAvail"] + " (it does not exist)"
        return None
    return HOPELESS.get(base)


class PendingWatch:
    """Cancel this workflow's pending jobs that can never start (squeue every ``every_s``)."""

    def __init__(self, workdir: str, every_s: float = 30.0, on_cancel=None):
        self.workdir, self.every_s = workdir, every_s
        self.on_cancel = on_cancel or (lambda line: log.error("%s", line))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pending-watch", daemon=True)
        self.cancelled: dict[str, str] = {}

    def start(self) -> PendingWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check_once()
            except (subprocess.SubprocessError, OSError) as exc:
                log.debug("pending-job watch: %s", exc)

    def check_once(self) -> None:
        out = _run(["squeue", "--me", "-h", "-t", "PENDING", "-o", "%i|%k|%Z|%r"])
        for line in out.splitlines():
            job_id, comment, workdir, reason = line.split("|", 3)
            if workdir != self.workdir or job_id in self.cancelled:
                continue
            why = hopeless(reason, _node_exists)
            if why:
                subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
                self.cancelled[job_id] = reason
                self.on_cancel(
                    f"error: SLURM job {job_id} ({comment}) can never start: {reason}: {why}; "
                    "cancelled. Fix the resource in the profile or the config, then rerun"
                )


def _node_exists(name: str) -> bool:
    try:
        _run(["scontrol", "show", "node", name])
        return True
    except subprocess.CalledProcessError:
        return False


# ----------------------------------------------------------------------------- resources


def train_mpi(run: dict[str, Any]) -> str | int:
    """The SLURM executor plugins' `mpi` resource, on every train job: the rule's shell runs
    in the batch script and starts its own srun step (one task per node). So SLURM's
    `--signal=USR1@...` (sent to job steps) reaches only the training processes, which
    handle it, never the job's own snakemake, which it would end. The job-step plugin
    checks only that the key is there; the submitting plugin refuses an MPI job of one task
    ("'tasks' must be greater than 1"), so a 1-node run sets it to 0, which it reads as
    no MPI (plain --ntasks=1) while the job step still runs the shell unwrapped."""
    return "srun" if run["nodes"] > 1 else 0
