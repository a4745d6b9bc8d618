"""Offline: the demo pipeline fetches nothing. HF_HUB_OFFLINE=1 (conftest.py) asks the
Hub's libraries not to; this checks that nothing did: every Python process the tests
start (Snakemake, each stage, torchrun, every rank, lm-eval) records each name lookup or
connection that would leave the machine (tests/offline/sitecustomize.py), and the record
stays empty."""

from __future__ import annotations

import subprocess
import sys

from conftest import ENV, NET_LOG


def test_the_watch_records_a_fetch(tmp_path):
    """The check below means something only if the watch sees a fetch: a child process
    with the tests' environment looks up the Hub's name and connects to a public address
    (both fail offline, or time out; the watch records them first)."""
    log = tmp_path / "net.log"
    code = """
import socket
for target in (("huggingface.co", 443), ("1.1.1.1", 443)):
    try:
        socket.create_connection(target, timeout=0.5).close()
    except OSError:
        pass
"""
    subprocess.run([sys.executable, "-c", code], env={**ENV, "SNAKETUNE_NET_LOG": str(log)},
                   check=True, timeout=60)  # fmt: skip
    text = log.read_text()
    assert "lookup huggingface.co:443" in text and "connect 1.1.1.1:443" in text, text


def test_the_demo_fetched_nothing(demo):
    """The whole demo (download stages included: models and datasets come from the local
    fixtures) and every test before this one in the session: no lookup or connection
    outside the machine, and no process that compiled its imports from source."""
    assert (demo / "results/summary.tsv").is_file()
    # the pipeline's processes ran under the watch: Snakemake, the stages, the workers
    seen = NET_LOG.with_name(NET_LOG.name + ".seen").read_text()
    for script in ("snakemake", "download_model.py", "tokenize_dataset.py", "train.py --worker",
                   "evaluate.py"):  # fmt: skip
        assert script in seen, script
    # and none of them ignored the environment's compiled files: a PYTHONPYCACHEPREFIX set
    # for the jobs (the Snakefile did, for a workdir other than the clone) made every stage
    # compile torch and transformers from source, about 6 CPU-s a process
    prefixed = [line for line in seen.splitlines() if "pycache_prefix=" in line]
    assert prefixed == [], "\n".join(prefixed[:5])
    outside = NET_LOG.read_text().splitlines() if NET_LOG.exists() else []
    assert outside == [], "\n".join(outside[:20])
