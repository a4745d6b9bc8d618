"""Secrets in the environment never reach a file the pipeline writes.

The demo pipeline (tests/conftest.py `demo`) runs with recognisable fake values of HF_TOKEN,
WANDB_API_KEY and other variables named like a token, key, secret or password. Every file
under its working directory is searched for them: results, resources, logs, benchmarks,
provenance, the report, and Snakemake's own records under .snakemake/.
"""

from __future__ import annotations

import json
import logging

from conftest import FAKE_SECRETS, leaked_secrets

from snaketune.cli import setup_logging


def test_the_fakes_reached_the_jobs(demo):
    """The check below means something only if the jobs saw the variables."""
    assert (demo / "logs/train/demo.log").is_file()
    written = [p for p in demo.rglob("*") if p.is_file()]
    assert len(written) > 50
    assert any(p.name == "provenance.json" for p in written)
    assert (demo / "results/summary.html").is_file()


def test_no_secret_in_any_file_the_demo_wrote(demo):
    assert leaked_secrets(demo) == []


def test_log_lines_mask_secret_values(capsys, monkeypatch):
    """A secret that ends up in a log message (an error quoting a URL, a dumped environment)
    is masked by the logging set-up every entry script uses."""
    for name, value in FAKE_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # not secret: stays visible
    setup_logging()
    log = logging.getLogger("snaketune.test")
    log.info("env: %s", json.dumps(dict(FAKE_SECRETS, HF_HUB_OFFLINE="1")))
    log.warning("calling https://hooks.example/%s failed", FAKE_SECRETS["MY_SERVICE_TOKEN"])
    err = capsys.readouterr().err
    assert not [v for v in FAKE_SECRETS.values() if v in err], err
    assert err.count("***") == len(FAKE_SECRETS) + 1
    assert '"HF_HUB_OFFLINE": "1"' in err
