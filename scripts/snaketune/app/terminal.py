"""The terminal of a pipeline run: what a person reads while it works.

A Snakemake logger plugin (``logger: [snaketune]`` in the profiles; the module
``snakemake_logger_plugin_snaketune`` is the plugin's name for Snakemake). In a run it
prints one line for each job started and one when it finished (with the count of jobs
done), a failure as one line naming the rule, its wildcards and its log, followed by the
log's own error lines (not the whole log: a train job's log is its whole training); the
job table as one line. A train job prints its own progress and outcome beside it. A dry
run keeps Snakemake's own blocks (the plan a person checks), with each job's reason cut
to its first words: a changed run spec is named key by key on the ``plan:`` lines. With
``-p`` (print shell commands) or ``--verbose`` everything is Snakemake's own output.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

from snakemake_interface_logger_plugins.base import LogHandlerBase

# Snakemake's lines about itself, not about the user's jobs: left out of a run's terminal
NOISE = (
    "Building DAG of jobs",
    "Using shell:",
    "Provided cores:",
    "Rules claiming more threads",
    "Select jobs to execute",
    "Execute ",
    "Assuming unrestricted shared filesystem usage",
    "host:",
    "Job stats:",
    "Conda environments: ignored",
)
REASON_CHARS = 160  # a dry run's reason, each part
EXCERPT_LINES = 8  # a failed job's log lines shown
ERROR_LINE = re.compile(r"^(config )?error: |^stopped |^Traceback|^\w*Error: ")
# A person's stop (Ctrl-C: Snakemake's own line; scancel: a train job's log saying it was
# stopped): what Snakemake then prints of the stopped jobs (their whole command, its
# exception, the verdict) goes to its log file only; the terminal ends on the stop line
USER_STOP = "Terminating processes on user request"
STOPPED_JOB = re.compile(r"\bstopped by [^;]+; newest complete checkpoint")  # the launcher's
STOP_NOISE = re.compile(
    r"^(RuleException|CalledProcessError|WorkflowError)|At least one job did not complete"
    r"|^Elapsed time:"
)


def settled(logger_name: str = "snakemake.logging", wait_s: float = 5.0) -> None:
    """Wait until the records logged so far are written: Snakemake hands its logger plugins'
    records to a thread through a queue, so a line printed from the workflow itself (the
    checks before queueing, the last lines) could land inside one of them. Bounded: a queue
    whose thread has stopped is not waited on past ``wait_s``."""
    queues = [h.queue for h in logging.getLogger(logger_name).handlers if hasattr(h, "queue")]
    deadline = time.monotonic() + wait_s
    while any(getattr(q, "unfinished_tasks", 0) for q in queues):
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)
    sys.stderr.flush()


def shown(wildcards: dict[str, Any] | None) -> str:
    """``run=demo``: the wildcards that tell a rule's jobs apart."""
    return ", ".join(f"{k}={v}" for k, v in (wildcards or {}).items())


def job_title(rule: str, wildcards: dict[str, Any] | None) -> str:
    """``rule train (run=demo)``"""
    return f"rule {rule} ({shown(wildcards)})" if wildcards else f"rule {rule}"


def short_reason(reason: str, chars: int = REASON_CHARS) -> str:
    """Each part of Snakemake's reason cut to its first ``chars`` characters: a changed
    params' reason is the whole old and new run spec."""
    parts = [p if len(p) <= chars else p[:chars] + " ..." for p in reason.split("; ")]
    return "; ".join(parts)


def log_excerpt(paths: list[str], lines: int = EXCERPT_LINES) -> list[str]:
    """What a failed job's log says about its failure: its error lines (ours are one line
    each, ``error: ...``; a traceback's last line), else its last lines."""
    out = []
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        text = [ln for ln in text if ln.strip()]
        errors = [ln for ln in text if ERROR_LINE.search(ln)]
        if any(ln.startswith("Traceback") for ln in errors):  # the exception, not the frames
            errors = [ln for ln in errors if not ln.startswith("Traceback")] or text[-1:]
        out += (errors or text)[-lines:]
    return [f"    {ln}" for ln in out]


def stats_line(stats: dict[str, int]) -> str:
    jobs = [f"{rule} {n}" for rule, n in stats.items() if rule not in ("total", "all")]
    total = stats.get("total", 0) - stats.get("all", 0)
    return f"{total} job{'' if total == 1 else 's'}: " + ", ".join(jobs)


class LogHandler(LogHandlerBase):
    """Snakemake's log records, as a person reads them (see the module's docstring)."""

    def __post_init__(self) -> None:
        from snakemake.logging import DefaultFilter, DefaultFormatter

        s = self.common_settings
        self.stream = sys.stdout if s.stdout else sys.stderr
        self.full = bool(s.printshellcmds or s.verbose or s.debug_dag)
        quiet = set(s.quiet or ())
        self.default_filter = DefaultFilter(
            quiet, s.debug_dag, s.verbose, s.dryrun, s.printshellcmds
        )
        self.default = DefaultFormatter(quiet, s.show_failed_logs)
        self.jobs: dict[int, tuple[str, dict[str, Any]]] = {}  # job id: rule, wildcards
        self.finished: list[int] = []
        self.targets = 0  # the jobs of rule all (the targets), not counted as work done
        self.stopping = False  # a person stopped the run (USER_STOP, STOPPED_JOB)

    writes_to_stream = True
    writes_to_file = False
    has_filter = True
    has_formatter = True
    needs_rulegraph = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = self.lines(record)
        except Exception:  # a record of a shape this does not know: its message, as it is
            lines = [record.getMessage()]
        if lines:  # one write: a line and its newline never part around another writer's
            self.stream.write("".join(f"{line}\n" for line in lines))
            self.stream.flush()

    def lines(self, record: logging.LogRecord) -> list[str]:
        event = str(getattr(record, "event", "") or "")
        if self.full or self.common_settings.dryrun:
            if not self.default_filter.filter(record):
                return []
            if event == "job_info" and not self.full:
                record.reason = short_reason(record.reason)
            return [self.default.format(record)]
        return self.run_lines(event, record)

    def run_lines(self, event: str, record: Any) -> list[str]:
        now = time.strftime("[%H:%M:%S]")
        if event == "job_info":
            self.jobs[record.jobid] = (record.rule_name, record.wildcards)
            if record.rule_name == "all":
                return []
            return [
                f"{now} started {job_title(record.rule_name, record.wildcards)}, job {record.jobid}"
            ]
        if event == "job_finished":
            self.finished.append(record.job_id)
            return []
        if event == "progress":
            done, self.finished = self.finished, []
            return [
                f"{now} finished {job_title(*self.jobs[j])}, {record.done} of "
                f"{record.total - self.targets} jobs done"
                for j in done
                if self.jobs.get(j, ("all",))[0] != "all"
            ]
        if event == "job_error":
            said = log_excerpt(list(record.log or []))
            if self.stopping or any(STOPPED_JOB.search(ln) for ln in said):
                self.stopping = True  # its one stop line comes last (the Snakefile's onerror)
                return []
            return self.error_lines(now, record)
        if event == "run_info" and isinstance(getattr(record, "stats", None), dict):
            self.targets = record.stats.get("all", 0)
            return [stats_line(record.stats)]
        if event in (
            "job_started",
            "shellcmd",
            "resources_info",
            "debug_dag",
            "rulegraph",
            "workflow_started",
            "group_info",
        ):
            return []
        if event in ("group_error",):
            return [self.default.format(record)]
        message = record.getMessage() if record.msg is not None else ""
        if message.startswith(USER_STOP):
            self.stopping = True
        elif self.stopping and STOP_NOISE.search(message.strip()):
            return []  # in Snakemake's log file, not the terminal
        if record.levelno < logging.WARNING and (
            not message.strip() or message.strip().startswith(NOISE)
        ):
            return []
        return [message]

    def error_lines(self, now: str, record: Any) -> list[str]:
        wildcards = shown(self.jobs.get(record.jobid, ("", {}))[1])
        logs = list(record.log or [])
        where = f"; log: {', '.join(logs)}" if logs else ""
        aux = "".join(f"; {k}: {v}" for k, v in (record.aux or {}).items())
        head = (
            f"{now} Error in rule {record.rule_name}: {wildcards + ', ' if wildcards else ''}"
            f"job {record.jobid}{where}{aux}"
        )
        # the executor's reason, where it gives one (SLURM: "SLURM-job '242' failed, SLURM status
        # is: 'OUT_OF_MEMORY'"): what the job's own log cannot say
        reason = " ".join(str(getattr(record, "rule_msg", None) or "").split())
        return [
            head,
            *([f"    {reason}"] if reason else []),
            *(log_excerpt(logs) if self.common_settings.show_failed_logs else []),
        ]
