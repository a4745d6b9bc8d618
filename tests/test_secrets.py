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

from snaketune.app.cli import setup_logging


def test_the_fakes_reached_the_jobs(demo):
    """The check below means something only if the jobs saw the variables: each stage's
    provenance names the secret variables its process had (names only), and every fake is
    there, in the train job (launcher), the evaluation and the data stages."""
    provenances = sorted(demo.glob("results/**/provenance.json")) + sorted(
        demo.glob("resources/**/provenance.json")
    )
    stages = {json.loads(p.read_text())["stage"]: p for p in provenances}
    assert {"train", "evaluate", "tokenize_dataset", "download_dataset"} <= set(stages), sorted(
        stages
    )
    for stage in ("train", "evaluate", "tokenize_dataset", "download_dataset"):
        seen = json.loads(stages[stage].read_text())["secret_variables"]
        assert set(FAKE_SECRETS) <= set(seen), (stage, seen)


def test_no_secret_in_any_file_the_demo_wrote(demo, tmp_path):
    """Every file the demo wrote (logs, every attempt's log, results, provenance, the
    report, Snakemake's records) holds no fake value; the scan itself finds one planted in
    a copy of the train log, so an empty answer is a real one."""
    files = [p for p in demo.rglob("*") if p.is_file() and not p.is_symlink()]
    names = {str(p.relative_to(demo)) for p in files}
    for needed in ("logs/train/demo.log", "results/demo/train/logs/attempt-1.log",
                   "results/demo/train/provenance.json", "results/summary.html"):  # fmt: skip
        assert needed in names, needed
    assert any(n.startswith(".snakemake/") for n in names)
    assert leaked_secrets(demo) == []
    planted = tmp_path / "planted"
    planted.mkdir()
    text = (demo / "logs/train/demo.log").read_text()
    (planted / "demo.log").write_text(text + f"token={FAKE_SECRETS['HF_TOKEN']}\n")
    assert leaked_secrets(planted) == [f"{planted / 'demo.log'}: HF_TOKEN"]


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
