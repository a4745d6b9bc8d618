"""Shared test fixtures: the offline model/dataset fixtures, built once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@pytest.fixture(scope="session")
def fixtures_dir(tmp_path_factory) -> Path:
    """resources/fixtures as make_fixtures writes it (tiny-llama/, gsm8k-demo/)."""
    from snaketune.fixtures import make_fixtures

    out = tmp_path_factory.mktemp("fixtures")
    make_fixtures(out)
    return out


@pytest.fixture(scope="session")
def tiny_model(fixtures_dir) -> Path:
    return fixtures_dir / "tiny-llama"


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from snaketune.tokenization import load_tokenizer

    return load_tokenizer(tiny_model)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
    "PYTHONWARNINGS": "ignore::FutureWarning",
}


def snakemake(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    """Run snakemake with the local profile; fail with its output when ``check``."""
    cmd = [
        str(BIN / "snakemake"),
        "--snakefile",
        str(ROOT / "Snakefile"),
        "--profile",
        str(ROOT / "profiles" / "local"),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]
