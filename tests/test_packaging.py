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


def test_one_version_everywhere():
    """snaketune.__version__ is the version: the installed metadata's (pyproject reads it),
    `snaketune --version`'s, and the top of CHANGELOG.md's."""
    import re
    import subprocess
    from importlib import metadata

    from conftest import BIN, ENV

    from snaketune import __version__

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "snaketune.__version__"
    }
    assert metadata.version("snaketune") == __version__
    out = subprocess.run([str(BIN / "snaketune"), "--version"], env=ENV, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.strip() == f"snaketune {__version__}"
    (top,) = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M)[:1]
    assert top == __version__


def test_the_tests_keep_the_librarys_caches_out_of_the_users():
    """Model counts and class facts (snaketune.core.cache) go to the session's own folder,
    in this process and in every process a test starts, not to ~/.cache/snaketune."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import ENV

    from snaketune.core.cache import cache_dir

    home = Path.home() / ".cache/snaketune"
    assert cache_dir() != home and str(cache_dir()) == os.environ["SNAKETUNE_CACHE"]
    code = "from snaketune.core.cache import cache_dir; print(cache_dir())"
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    assert out.stdout.strip() == str(cache_dir()), out.stderr
