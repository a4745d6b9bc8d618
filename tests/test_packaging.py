"""The stack is declared once in pyproject.toml and mirrored in envs/*.yaml."""

from __future__ import annotations

import tomllib
import yaml
from conftest import ROOT

STACK = {
    "snakemake",
    "snakemake-executor-plugin-slurm",
    "torch",
    "transformers",
    "peft",
    "trl",
    "deepspeed",
    "datasets",
    "pandas",
    "pyarrow",
}


def _pins(reqs: list[str]) -> dict[str, str]:
    out = {}
    for req in reqs:
        if req.startswith("-"):
            continue
        name, _, version = req.partition("==")
        assert version, f"{req!r} is not pinned with =="
        out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def test_pyproject_declares_the_stack_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins(project["dependencies"])
    assert set(pins) >= STACK, STACK - set(pins)
    assert pins["snakemake"].startswith("9.")
    assert {"pytest", "hypothesis", "ruff", "snakefmt"} <= set(
        _pins(project["optional-dependencies"]["dev"])
    )


def test_conda_envs_match_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = _pins(project["dependencies"])
    envs = sorted((ROOT / "envs").glob("*.yaml"))
    assert envs
    for env in envs:
        deps = yaml.safe_load(env.read_text())["dependencies"]
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        assert _pins(pip) == expected, env.name


def test_setup_script_pins_the_same_torch():
    text = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert "torch==$TORCH_VERSION" in text
    assert "pyproject.toml" in text  # the version is read from there, not repeated
