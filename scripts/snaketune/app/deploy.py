"""A project of your own that uses this clone's workflow as a Snakemake module: what
``snakedeploy deploy-workflow`` lays out (the workflow's ``config/`` and ``profiles/`` copied,
``workflow/Snakefile`` a module declaration), from a local clone, without its two faults
there (snakedeploy 0.17.1 copies the clone's whole folder, its ``.venv`` too, and writes a
module path relative to the clone, which does not resolve from the project):

    snaketune deploy my-project          # then: cd my-project && snakemake --profile profiles/local

Only the files git tracks are copied (a clone's results, resources and environment stay);
the module points at this clone's ``workflow/Snakefile`` by its absolute path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from snaketune.core.errors import UserError

COPIED = ("config", "profiles")
MODULE = """configfile: "config/config.yaml"


module snaketune:
    snakefile:
        {snakefile}
    config:
        config


use rule * from snaketune
"""


def tracked(root: Path, folder: str) -> list[str]:
    """The files git tracks under ``folder`` of the clone (all of them outside git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--", folder],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(root)) for p in (root / folder).rglob("*") if p.is_file()]
    return [f for f in out.split("\0") if f]


def deploy(root: Path, dest: Path) -> list[str]:
    """Lay out the project ``dest`` for the workflow at ``root``; return what was written."""
    dest = dest.resolve()
    if dest.exists() and any(dest.iterdir()):
        raise UserError(
            f"{dest} is not empty: deploy into a new folder (it writes config/, "
            "profiles/ and workflow/Snakefile)"
        )
    written = []
    for folder in COPIED:
        for name in tracked(root, folder):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
        written.append(f"{folder}/")
    snakefile = dest / "workflow" / "Snakefile"
    snakefile.parent.mkdir(parents=True, exist_ok=True)
    target = json.dumps(str((root / "workflow" / "Snakefile").resolve()))
    snakefile.write_text(MODULE.format(snakefile=target))
    written.append("workflow/Snakefile")
    return written
