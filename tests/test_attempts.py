"""Every attempt's log kept (snaketune.train.attempts), a second start inside one SLURM job
refused, a done training that a late signal failed still published, and SLURM signal
leads longer than half a job refused before queueing. The end-to-end checks are in
test_train.py (a killed launcher and a killed rank, retried by Snakemake) and
test_slurm.py (requeues, and a failing train job retried as new jobs)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from conftest import ENV, FAKE_SECRETS, ROOT


def torchrun_failure(*failures: tuple[int, int, int]) -> str:
    """What torchrun's agent prints when its workers fail: torch's own ChildFailedError
    text for (rank, pid, exitcode) failures."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    found = {rank: ProcessFailure(local_rank=0, pid=pid, exitcode=code, error_file="/nonexistent")
             for rank, pid, code in failures}  # fmt: skip
    return ChildFailedError("scripts/train.py", found).format_msg()


def test_the_killed_rank_is_read_from_torchruns_report():
    from snaketune.train.attemptlog import root_cause

    text = "step 12/192 ...\n" + torchrun_failure((1, 4242, -9)) + "\nmore"
    assert root_cause(text).startswith("rank 1 on ")
    assert root_cause(text).endswith("exitcode -9 (pid: 4242) (SIGKILL): Signal 9 (SIGKILL) "
                                     "received by PID 4242")  # fmt: skip
    # the agent stopped with SIGTERM by the supervisor reports too: the other one is the cause
    both = torchrun_failure((0, 11, -15)) + torchrun_failure((1, 12, 1))
    assert root_cause(both).startswith("rank 1 on ") and "exitcode 1 (pid: 12)" in root_cause(both)
    assert root_cause("Traceback (most recent call last):\nValueError: x") is None
    # a peer's agent reported first its rank's error exit after the killed one died under
    # it (seen in CI under load): the killed rank is the cause
    peer_first = torchrun_failure((0, 21, 1)) + torchrun_failure((1, 22, -9))
    assert root_cause(peer_first).startswith("rank 1 on ") and "SIGKILL" in root_cause(peer_first)
    two_errors = torchrun_failure((0, 31, 1)) + torchrun_failure((1, 32, 2))
    assert "exitcode 1 (pid: 31)" in root_cause(two_errors)  # the report's order otherwise


def test_attempt_numbers_are_claimed_once_each(tmp_path):
    from snaketune.train.attempts import claim

    out = tmp_path / "results/x/train"
    assert [claim(out) for _ in range(3)] == [1, 2, 3]
    (out / "logs/attempt-7.log").write_text("")  # numbers continue after the highest
    assert claim(out) == 8


def test_an_attempt_records_its_end_and_lists_every_outcome(tmp_path, capsys):
    """Run in a child process (the attempt re-points stdout and stderr through tee): its
    file gets everything printed after it began, the record gets the reason, and the last
    lines list every attempt, an earlier one killed without a record included."""
    out = tmp_path / "results/x/train"
    (out / "logs").mkdir(parents=True)
    (out / "logs/attempt-1.log").write_text("step 3/10\nstep 4/10\n")
    (out / "logs/attempts.jsonl").write_text(json.dumps(
        {"attempt": 1, "log": "logs/attempt-1.log", "began": 1.0, "host": "elsewhere",
         "pid": 1, "job": None, "restart": 0}) + "\n")  # fmt: skip
    code = f"""
import logging, os, sys
from pathlib import Path
from snaketune.app.cli import setup_logging
from snaketune.train.attempts import Attempt
setup_logging()
attempt = Attempt(Path({str(out)!r}))
print("from the launcher")
os.system("echo from a child process >&2")
logging.getLogger("snaketune.train.launch").error("training exited with code 1; rerun")
attempt.finish(1, "training exited with code 1; rerun " + os.environ["HF_TOKEN"])
"""
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    whole = proc.stdout + proc.stderr  # both went through the one copy to stdout
    log = (out / "logs/attempt-2.log").read_text()
    assert "from the launcher" in log and "from a child process" in log
    assert "earlier attempts' logs" in log and "attempt-1.log" in log
    assert log.strip() in whole.strip()  # the rule's log got the same lines
    last = whole.strip().splitlines()[-3:]
    assert last[0] == f"attempts of run x (logs in {out / 'logs'}):"
    assert "attempt 1 (logs/attempt-1.log" in last[1]
    assert "ended without a record" in last[1] and "step 4/10" in last[1]
    # the reason is masked as the log line is (the fake HF_TOKEN of the tests' environment)
    assert last[2].endswith(": exit 1: training exited with code 1; rerun ***")
    records = [json.loads(x) for x in (out / "logs/attempts.jsonl").read_text().splitlines()]
    assert records[-1]["attempt"] == 2 and records[-1]["exit"] == 1
    assert FAKE_SECRETS["HF_TOKEN"] not in (out / "logs/attempts.jsonl").read_text() + whole


def test_a_second_start_inside_one_slurm_job_is_refused(tmp_path, monkeypatch):
    from snaketune.core.errors import UserError
    from snaketune.train.attempts import ONE_START_PER_JOB, Attempt, _append

    out = tmp_path / "results/x/train"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the restart count from the env
    monkeypatch.setenv(ONE_START_PER_JOB, "1")
    (out / "logs").mkdir(parents=True)
    (out / "logs/attempt-1.log").write_text("")
    _append(out, {"attempt": 1, "began": 1.0, "host": "h", "pid": 1, "job": "77", "restart": 1})
    _append(out, {"attempt": 1, "exit": 3, "reason": "stopped ahead of the time limit"})
    first = Attempt(out, copy_output=False)
    first.refuse_second_start()  # the job's previous run (restart 1): this start is the next
    first.finish(143, "training exited with code 143")
    second = Attempt(out, copy_output=False)
    with pytest.raises(UserError, match=r"attempt 2 of this run already started in this run of "
                       r"SLURM job 77 \(training exited with code 143\); a second start"):  # fmt: skip
        second.refuse_second_start()
    monkeypatch.delenv(ONE_START_PER_JOB)  # Snakemake's local retries inside an allocation
    second.refuse_second_start()


def test_a_done_training_a_late_signal_failed_is_published(tmp_path, caplog):
    """Rank 0 records "done" only after every rank wrote its outputs: a non-zero exit after
    that (SLURM's --signal reaching torchrun as it shut down) is not a failure."""
    from snaketune.core.job import Job
    from snaketune.train.launch import outcome

    job = Job({}, tmp_path, tmp_path, tmp_path, tmp_path / "results/x/train", "local", [])
    with caplog.at_level(logging.WARNING):
        assert outcome(job, 143, None, {"reason": "done", "step": 192}) is None
    assert "then the step exited with code 143" in caplog.text
    assert outcome(job, 143, None, {"reason": "time", "step": 5}) == 143


@pytest.mark.parametrize(
    ("extra", "runtime", "refused"),
    [("--signal=USR1@600", 3, True), ("--signal=B:USR1@600", 19, True),
     ("--signal=USR1@600", 20, False), ("--signal=USR1", 1, True), ("--signal=USR1", 2, False),
     ("--exclusive", 1, False)],
)  # fmt: skip
def test_a_signal_lead_over_half_the_runtime_is_refused(extra, runtime, refused):
    from snaketune.budget.slurmfit import check_signal_leads

    found = check_signal_leads([("train", {"slurm_extra": extra, "runtime": runtime})])
    assert bool(found) == refused, found
    if refused:
        (line,) = found
        assert line.startswith("train: slurm_extra's --signal=USR1@")
        assert f"lower the lead to at most {runtime * 30} s" in line


def test_a_dry_run_with_a_too_long_signal_lead_says_so(tmp_path):
    """The cluster profile with a 3-minute train runtime and its 600 s signal: refused in a
    dry run, before anything is queued, with the line naming the fix."""
    import yaml
    from conftest import quick_config

    profile = tmp_path / "profile"
    profile.mkdir()
    settings = yaml.safe_load((ROOT / "profiles/tupi/config.yaml").read_text())
    settings["set-resources"]["train"]["runtime"] = 3
    (profile / "config.yaml").write_text(yaml.safe_dump(settings))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "--snakefile", str(ROOT / "Snakefile"), "--profile",
         str(profile), "--directory", str(tmp_path / "work"), "--configfile",
         str(quick_config(tmp_path / "quick.yaml")), "-n"],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("error: train: slurm_extra's --signal=USR1@600 comes 600 s before the end of a "
            "3-minute job") in proc.stderr  # fmt: skip
    assert "lower the lead to at most 90 s" in proc.stderr


def test_the_progress_says_the_first_eta_however_long_the_start_took():
    """The job's progress on the terminal: its first line with an ETA as soon as there is
    one, then one line a minute. A start of 70 s (a loaded machine) said the first step's
    line (no ETA yet) and then nothing for a minute: a short training ended without one
    ETA on the terminal (test_terminal's demo check, flaky under load)."""
    from snaketune.train.attempts import Pace

    step1, eta = "step 1/192, loss 2.0, 10 tok/s", "step 2/192, loss 1.9, 10 tok/s, ETA 0:00:30"
    late = Pace(60.0, began=0.0)
    assert late.reading(70.0) and late.due(step1, 70.0)  # a minute passed: said
    assert late.reading(72.0) and late.due(eta, 72.0)  # the first ETA, at once
    assert not late.reading(74.0) and late.reading(132.0)  # then a beat a minute
    assert not late.due(eta, 132.0)  # the same line is not said twice
    assert late.due(eta.replace("2/", "9/"), 132.0)
    early = Pace(60.0, began=0.0)
    assert not early.due(None, 1.0) and not early.due(step1, 5.0)  # no ETA, within a minute
    assert early.reading(7.0) and early.due(eta, 7.0)
    assert not early.due(eta.replace("2/", "3/"), 30.0)  # within the minute after it
    assert early.due(eta.replace("2/", "4/"), 67.0)
