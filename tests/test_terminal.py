"""The terminal of a pipeline run (snaketune.app.terminal, Snakemake's logger plugin
``snaketune``): what the demo prints, and each kind of Snakemake log record as it reads."""

from __future__ import annotations

import io
import logging
import re
from types import SimpleNamespace


def handler(**settings):
    from snaketune.app.terminal import LogHandler

    common = dict(printshellcmds=False, nocolor=True, quiet=None, debug_dag=False,
                  verbose=False, show_failed_logs=True, stdout=True, dryrun=False)  # fmt: skip
    common.update(settings)
    h = LogHandler(SimpleNamespace(**common), None)
    h.stream = io.StringIO()
    return h


def record(msg=None, level=logging.INFO, **extra):
    return logging.makeLogRecord({"msg": msg, "levelno": level,
                                  "levelname": logging.getLevelName(level), **extra})  # fmt: skip


def job_info(jobid, rule, wildcards=None, reason="Missing output files: x"):
    return record(f" Rule: {rule}, Jobid: {jobid}", event="job_info", jobid=jobid,
                  rule_msg=None, rule_name=rule, local=False, input=["a"], output=["b"],
                  log=[], benchmark=None, wildcards=wildcards or {}, reason=reason,
                  resources={}, priority=0, threads=1, indent=False, is_checkpoint=False,
                  printshellcmd=True, is_handover=False, shellcmd="python x.py")  # fmt: skip


def shown(h, *records) -> list[str]:
    for r in records:
        h.emit(r)
    return h.stream.getvalue().splitlines()


def test_a_run_prints_a_line_per_job_started_and_finished_and_leaves_snakemake_s_own_out():
    h = handler()
    lines = shown(
        h,
        record("Building DAG of jobs..."),
        record("Using shell: /usr/bin/bash"),
        record(
            "Job stats:\n...",
            event="run_info",
            stats={"download_model": 1, "train": 2, "all": 1, "total": 4},
        ),  # fmt: skip
        record("Select jobs to execute..."),
        job_info(3, "train", {"run": "demo"}),
        record(None, event="shellcmd", cmd="python train.py '{...}'"),
        record(None, event="job_started", jobs=[3]),
        record("Finished jobid: 3 (Rule: train)", event="job_finished", job_id=3),
        record(None, event="progress", done=2, total=4),
        job_info(0, "all"),
        record("Finished jobid: 0 (Rule: all)", event="job_finished", job_id=0),
        record(None, event="progress", done=4, total=4),
        record("plan: demo: retrains: runs.demo.learning_rate: 0.001 -> 0.002"),
        record("a warning of Snakemake's", level=logging.WARNING),
    )
    stamp = r"\[\d\d:\d\d:\d\d\] "
    assert lines[0] == "3 jobs: download_model 1, train 2"
    assert re.fullmatch(stamp + r"started rule train \(run=demo\), job 3", lines[1]), lines
    assert re.fullmatch(stamp + r"finished rule train \(run=demo\), 2 of 3 jobs done", lines[2])
    assert lines[3:] == ["plan: demo: retrains: runs.demo.learning_rate: 0.001 -> 0.002",
                         "a warning of Snakemake's"]  # fmt: skip


def test_a_failed_job_is_one_line_with_its_log_and_the_log_s_error_lines(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1\n" * 500 + "error: runs.demo.dataset: chat.jsonl row 2 field "
                   "'messages' is a string; give a list of turns\nstep 2\n")  # fmt: skip
    crash = tmp_path / "crash.log"
    crash.write_text("loading\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
                     "RuntimeError: CUDA out of memory\n")  # fmt: skip
    quiet = tmp_path / "quiet.log"
    quiet.write_text("".join(f"line {i}\n" for i in range(40)))

    def error(jobid, rule, logs, reason=None):
        return record(f"Error in rule {rule}, jobid: {jobid}", level=logging.ERROR,
                      event="job_error", rule_name=rule, rule_msg=reason, jobid=jobid,
                      input=[], output=[], log=[str(p) for p in logs], conda_env=None,
                      container_img=None, aux={}, indent=False, shellcmd="python x")  # fmt: skip

    h = handler()
    lines = shown(h, job_info(4, "train", {"run": "demo"}), error(4, "train", [log]))[1:]
    assert lines[0].endswith(f"Error in rule train: run=demo, job 4; log: {log}"), lines
    assert lines[1:] == ["    error: runs.demo.dataset: chat.jsonl row 2 field 'messages' is "
                         "a string; give a list of turns"]  # fmt: skip
    lines = shown(handler(), error(5, "evaluate", [crash]))
    assert lines[1:] == ["    RuntimeError: CUDA out of memory"], lines
    lines = shown(handler(), error(6, "report", [quiet]))
    assert lines[1:] == [f"    line {i}" for i in range(32, 40)]  # no error line: its end
    assert len(shown(handler(show_failed_logs=False), error(6, "report", [quiet]))) == 1
    # the executor's reason (the SLURM plugin's words for a job the cluster ended), one line
    slurm = ("SLURM-job '242' failed, SLURM status is: 'OUT_OF_MEMORY'. Detailed failure reason\n"
             "unavailable (status command is not 'sacct').")  # fmt: skip
    lines = shown(handler(), error(7, "train", [crash], slurm))
    assert lines[1:] == ["    SLURM-job '242' failed, SLURM status is: 'OUT_OF_MEMORY'. Detailed "
                         "failure reason unavailable (status command is not 'sacct').",
                         "    RuntimeError: CUDA out of memory"], lines  # fmt: skip


def test_a_dry_run_keeps_snakemake_s_blocks_with_the_reason_cut_and_p_keeps_it_whole():
    spec = "Params have changed since last execution: " + "x" * 3000
    lines = shown(handler(dryrun=True), job_info(3, "train", {"run": "demo"}, reason=spec))
    text = "\n".join(lines)
    assert "rule train:" in text and "    wildcards: run=demo" in text
    (reason,) = [ln for ln in lines if "reason:" in ln]
    assert len(reason) < 200 and reason.endswith(" ..."), reason
    whole = "\n".join(shown(handler(printshellcmds=True), job_info(3, "train", reason=spec)))
    assert spec in whole and "rule train:" in whole


def test_a_record_of_an_unknown_shape_is_printed_as_its_message():
    broken = record("Error in rule x, jobid: 3", level=logging.ERROR, event="job_error")
    assert shown(handler(), broken) == ["Error in rule x, jobid: 3"]  # not lost, not raised


def test_the_demo_s_terminal_is_a_page_with_its_training_s_progress(demo):
    """`make demo`'s terminal (the demo fixture ran the local profile as `make demo` does):
    under 80 lines, none of them a run spec, every job started and finished, the training's
    progress (its ETA as soon as it has one) and its last step."""
    out = (demo / "snakemake.out").read_text()
    lines = out.splitlines()
    assert len(lines) < 80, out
    assert max(len(ln) for ln in lines) < 300, max(lines, key=len)
    assert "Traceback" not in out and '"model"' not in out  # no run spec's JSON
    stamp = r"\[\d\d:\d\d:\d\d\] "
    starts = re.findall(rf"(?m)^{stamp}started rule (\w+)", out)
    ends = re.findall(rf"(?m)^{stamp}finished rule (\w+).*, (\d+) of (\d+) jobs done$", out)
    assert sorted(starts) == sorted(rule for rule, _, _ in ends), (starts, ends)
    assert "train" in starts and "report" in starts and "all" not in starts
    assert [int(done) for _, done, _ in ends] == list(range(1, len(ends) + 1))
    assert {int(total) for _, _, total in ends} == {len(starts)}
    assert re.search(r"(?m)^snaketune: train demo: step \d+/(\d+), loss [\d.]+, [\d,]+ tok/s, "
                     r"ETA \d+:\d\d:\d\d$", out), out  # fmt: skip
    (total,) = re.findall(r"(?m)^snaketune: train demo: done: step (\d+)/\1, loss ", out)
    assert re.search(rf"(?m)^report: {demo}/results/summary.html \| demo: ", out)
    # the second node's agent, at the end, does not warn that the rendezvous failed
    (attempt,) = (demo / "results/demo/train/logs").glob("attempt-*.log")
    assert "has failed to shutdown the rendezvous" not in attempt.read_text()


def test_a_line_of_the_workflow_waits_for_the_lines_snakemake_has_logged(capfd):
    """Snakemake hands its logger plugin's records to a thread through a queue; the checks
    before queueing print from the workflow. `settled` waits for the queue, so the job
    count's line is whole before the plan's line (once they ran together on one line)."""
    import logging.handlers
    import queue
    import sys
    import time

    from snaketune.app.terminal import settled

    class Slow(logging.Handler):
        def emit(self, rec):
            time.sleep(0.3)  # a plugin busy with an earlier record
            sys.stderr.write(rec.getMessage() + "\n")

    q = queue.Queue(-1)
    log = logging.getLogger("snaketune-test-settled")
    log.propagate = False
    log.addHandler(logging.handlers.QueueHandler(q))
    listener = logging.handlers.QueueListener(q, Slow())
    listener.start()
    try:
        log.warning("13 jobs: train 1, report 1")
        settled("snaketune-test-settled")
        print("plans: not checked yet", file=sys.stderr)
    finally:
        listener.stop()
        log.handlers.clear()
    assert capfd.readouterr().err.splitlines() == ["13 jobs: train 1, report 1",
                                                   "plans: not checked yet"]  # fmt: skip
    started = time.monotonic()  # a queue nobody reads any more is not waited on for ever
    log.addHandler(logging.handlers.QueueHandler(q))
    log.warning("after the listener stopped")
    settled("snaketune-test-settled", wait_s=0.2)
    log.handlers.clear()
    assert time.monotonic() - started < 2


def _job_error(jobid, rule, logs):
    return record(f"Error in rule {rule}, jobid: {jobid}", level=logging.ERROR,
                  event="job_error", rule_name=rule, rule_msg=None, jobid=jobid, input=[],
                  output=[], log=[str(p) for p in logs], conda_env=None, container_img=None,
                  aux={}, indent=False, shellcmd="python x")  # fmt: skip


def test_a_person_s_stop_ends_on_its_line_the_command_and_exceptions_in_the_log_only(tmp_path):
    """Ctrl-C (Snakemake's own line first) and scancel (the train job's log says it was
    stopped): the stopped job's error block, Snakemake's RuleException with the whole train
    command and its closing WorkflowError are left to its log file; a failure is not."""
    stopped = tmp_path / "train.log"
    stopped.write_text("step 3\nWARNING snaketune.train.launch: stopped by SIGTERM; newest "
                       "complete checkpoint: checkpoint-2; run the same command again to "
                       "resume\n")  # fmt: skip
    failed = tmp_path / "eval.log"
    failed.write_text("Traceback (most recent call last):\nRuntimeError: out of memory\n")
    command = ("RuleException:\nCalledProcessError in file \"train.smk\", line 56:\nCommand "
               "'python train.py --run-spec {...}' returned non-zero exit status 3.")  # fmt: skip
    verdict = "WorkflowError:\nAt least one job did not complete successfully."
    for first in (record("Terminating processes on user request, this might take some time."),
                  None):  # fmt: skip
        h = handler()
        lines = shown(h, *[r for r in (first,) if r], job_info(4, "train", {"run": "demo"}),
                      record(command, level=logging.ERROR), _job_error(4, "train", [stopped]),
                      record("Complete log(s): .snakemake/log/x.log"),
                      record("Elapsed time: 0:00:25"), record(verdict, level=logging.ERROR))  # fmt: skip
        shown_text = "\n".join(lines)
        assert "Error in rule" not in shown_text and "WorkflowError" not in shown_text, lines
        assert lines[-1] == "Complete log(s): .snakemake/log/x.log", lines
        if first is not None:  # Ctrl-C: known before the command's exception arrives
            assert "RuleException" not in shown_text and "python train.py" not in shown_text
    # a job that failed on its own keeps its block and Snakemake's verdict
    lines = shown(handler(), job_info(5, "evaluate"), _job_error(5, "evaluate", [failed]),
                  record(verdict, level=logging.ERROR))  # fmt: skip
    assert "Error in rule evaluate" in lines[1] and lines[-1].startswith("At least one job")
