"""GPU health watchdog: the rules on injected samples, the webhook, and a training run that a
failing (injected) GPU stops after a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from conftest import ENV, ROOT, run_spec

from snaketune.train.health import (
    FATAL,
    OK,
    WARNING,
    GpuSample,
    Limits,
    Watchdog,
    assess,
    open_reader,
)


class FakeReader:
    """Samples handed in by the test, in turn (the last one repeats)."""

    def __init__(self, *samples: GpuSample):
        self.samples, self.n = list(samples), 0

    def sample(self, index: int) -> GpuSample:
        s = self.samples[min(self.n, len(self.samples) - 1)]
        self.n += 1
        return s


HEALTHY = dict(index=0, name="H100", temperature_c=60, slowdown_c=87, shutdown_c=92,
               ecc_uncorrectable=0, memory_used_mib=40_000, memory_total_mib=80_000)  # fmt: skip


def sample(**changes) -> GpuSample:
    return GpuSample(**{**HEALTHY, **changes})


@pytest.mark.parametrize(
    ("changes", "level", "problem"),
    [
        ({}, OK, None),
        ({"temperature_c": 83}, WARNING, "temperature 83 C, slowdown at 87 C"),
        ({"temperature_c": 88}, FATAL, "temperature 88 C, shutdown at 92 C"),
        ({"ecc_uncorrectable": 3}, FATAL, "3 uncorrectable ECC error(s)"),
        ({"throttle": ["sw_thermal_slowdown"]}, WARNING, "clocks throttled (sw_thermal_slowdown)"),
        ({"throttle": ["hw_power_brake"]}, WARNING, "clocks throttled (hw_power_brake)"),
        ({"memory_used_mib": 79_500}, WARNING, "memory 79500/80000 MiB"),
        ({"temperature_c": None, "ecc_uncorrectable": None}, OK, None),  # not reported
    ],
)
def test_assess_one_sample(changes, level, problem):
    got, problems = assess(sample(**changes), Limits(), ecc_baseline=0, hw_slow_run=0)
    assert got == level
    assert problems == ([problem] if problem else [])


def test_ecc_errors_from_before_the_job_warn_only_new_ones_are_fatal(caplog):
    dog = Watchdog(FakeReader(sample(ecc_uncorrectable=2), sample(ecc_uncorrectable=2),
                              sample(ecc_uncorrectable=3)), 0, 1.0, Limits())  # fmt: skip
    with caplog.at_level(logging.INFO, logger="snaketune.train.health"):
        assert dog.check()["status"] == "ok"
        assert "2 uncorrectable ECC errors from before this job" in caplog.text
        assert dog.check()["status"] == "ok" and dog.fatal is None
        record = dog.check()
    assert record["status"] == "fatal" and record["problems"] == ["1 uncorrectable ECC error(s)"]
    assert dog.fatal == f"{socket.gethostname()} GPU 0 (H100): 1 uncorrectable ECC error(s)"


def test_hardware_slowdown_is_fatal_only_when_it_lasts():
    slow = sample(throttle=["hw_slowdown"])
    dog = Watchdog(FakeReader(slow, slow, sample(), slow, slow, slow), 0, 1.0,
                   Limits(throttle_samples=3))  # fmt: skip
    assert [dog.check()["status"] for _ in range(6)] == [
        "warning", "warning", "ok", "warning", "warning", "fatal",
    ]  # fmt: skip


def test_health_lines_and_records(tmp_path, caplog):
    records = tmp_path / "health" / "rank.jsonl"
    dog = Watchdog(FakeReader(sample(), sample(temperature_c=84)), 0, 1.0, Limits(), records,
                   context={"run": "demo", "rank": 0})  # fmt: skip
    with caplog.at_level(logging.INFO, logger="snaketune.train.health"):
        dog.check()
        dog.check()
    host = socket.gethostname()
    assert (
        f"GPU health {host} GPU 0: ok | 60 C | memory 40000/80000 MiB | ECC 0 | throttle none"
        in (caplog.text)
    )
    assert f"GPU health {host} GPU 0: warning | 84 C" in caplog.text
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    assert [r["status"] for r in lines] == ["ok", "warning"]
    assert lines[1]["temperature_c"] == 84 and lines[1]["run"] == "demo"


class Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Hook.received.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture()
def webhook():
    Hook.received = []
    server = HTTPServer(("127.0.0.1", 0), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook/secret-path-7f3a", Hook.received
    server.shutdown()


def test_fatal_posts_the_webhook_once(webhook):
    url, received = webhook
    bad = sample(ecc_uncorrectable=0), sample(ecc_uncorrectable=5)
    dog = Watchdog(FakeReader(*bad), 0, 1.0, Limits(), webhook_url=url, context={"run": "r"})
    for _ in range(4):
        dog.check()
    assert len(received) == 1
    event = received[0]
    assert event["event"] == "gpu_fatal" and event["run"] == "r" and event["index"] == 0
    assert event["message"] == dog.fatal and "5 uncorrectable ECC error(s)" in dog.fatal


def test_a_failing_webhook_is_logged_without_its_url(caplog):
    url = "http://127.0.0.1:9/hook/secret-path-7f3a"  # nothing listens on port 9
    dog = Watchdog(FakeReader(sample(), sample(temperature_c=95)), 0, 1.0, Limits(),
                   webhook_url=url)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        dog.check()
        dog.check()
    assert dog.fatal and "GPU health webhook failed" in caplog.text
    assert "secret-path" not in caplog.text


def test_thread_samples_every_interval_and_survives_a_failed_read(caplog):
    class Flaky(FakeReader):
        def sample(self, index):
            self.n += 1
            if self.n == 2:
                raise OSError("NVML hiccup")
            return sample()

    reader = Flaky()
    with caplog.at_level(logging.WARNING, logger="snaketune.train.health"):
        dog = Watchdog(reader, 0, 0.05, Limits()).start()
        deadline = time.monotonic() + 20  # a loaded CI machine may be slow to schedule it
        while reader.n < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        dog.stop()
    assert reader.n >= 5  # it went on sampling after the failed read
    assert "sample failed (OSError: NVML hiccup)" in caplog.text


def test_off_without_a_gpu(monkeypatch):
    monkeypatch.delenv("SNAKETUNE_GPU_HEALTH_FILE", raising=False)
    reader, why = open_reader(cuda_available=False)
    assert reader is None and why == "no GPU on this machine"


def test_training_stops_on_a_failing_gpu_after_a_checkpoint(demo, tmp_path, webhook):
    """2 nodes x 1 process on CPU; the injected reader reports new ECC errors on its third
    sample. Every rank stops at the same step, the checkpoint of that step is complete, no
    declared output is written, and the launcher ends with one line naming host and GPU."""
    url, received = webhook
    samples = tmp_path / "gpu.json"
    samples.write_text(json.dumps({"0": [HEALTHY, HEALTHY, {**HEALTHY, "ecc_uncorrectable": 2}]}))
    spec = run_spec(max_steps=20, save_steps=100, health={"interval_seconds": 0.2})
    env = {**ENV, "SNAKETUNE_GPU_HEALTH_FILE": str(samples), "SNAKETUNE_HEALTH_WEBHOOK": url}
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--run-spec", json.dumps(spec),
           "--shards", str(demo / "results/demo/shards"),
           "--model", str(demo / "resources/models/tiny"),
           "--deepspeed", str(ROOT / "config/deepspeed/zero2.json"), "--out", "results/x/train"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    host = socket.gethostname()
    assert len(errors) == 1, out
    # both emulated nodes run on this host with GPU index 0: one message, not two
    assert errors[0].startswith(
        f"error: GPU health: {host} GPU 0 (H100): 2 uncorrectable ECC error(s); stopped at step"
    )
    assert "take the node out" in errors[0]
    train = tmp_path / "results/x/train"
    step = json.loads((train / "checkpoints/health/fatal.json").read_text())["step"]
    assert 1 <= step < 20
    assert (train / f"checkpoints/checkpoint-{step}/snaketune-complete.json").is_file()
    declared = ("final_checkpoint", "model", "metrics.jsonl", "run_config.json",
                "provenance.json", "probe.safetensors")  # fmt: skip
    assert not [name for name in declared if (train / name).exists()]
    # each rank's watchdog samples on its own clock: the first to read the failure stops
    # every rank at that step's end, and the other may not have sampled it by then (so on
    # a loaded CI machine), or may be cut off mid-post by the stop: one post per rank whose
    # records say fatal at most, and at least the first's
    records = sorted((train / "checkpoints/health").glob("node-*.jsonl"))
    fatal = [r for r in records if '"status": "fatal"' in r.read_text()]
    assert len(records) == 2 and fatal, [r.read_text() for r in records]
    assert {r["event"] for r in received} == {"gpu_fatal"} and 1 <= len(received) <= len(fatal)
    assert "GPU health watchdog: every 0.2s (samples from" in out
    assert os.environ.get("SNAKETUNE_GPU_HEALTH_FILE") is None  # the test's env only
