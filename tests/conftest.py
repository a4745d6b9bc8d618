"""Shared test fixtures: the offline model/dataset fixtures, built once per session."""

from __future__ import annotations

import json
import os
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
