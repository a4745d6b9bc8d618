"""The workflow's rule names as Snakemake reports them when a project uses it as a module
with a prefix (``use rule * from snaketune as snaketune_*``): every rule of ours is renamed
by the same pattern, so the pattern is read off one rule whose own name is known, ``all``
(``rules.all.rule.name`` in workflow/Snakefile), and undone for the checks that read jobs by
rule. A rule of the user's own workflow matches no name of ours: None.
"""

from __future__ import annotations

ALL = "all"


def local_name(name: str, all_name: str = ALL) -> str | None:
    """Our name of rule ``name`` (as renamed like ``all`` became ``all_name``), or None when
    ``name`` is not renamed that way (a rule of the project around the module)."""
    before, found, after = all_name.rpartition(ALL)
    if not found:
        return None
    if not (name.startswith(before) and name.endswith(after)):
        return None
    inner = name[len(before) : len(name) - len(after)]
    return inner or None


def local_names(names, all_name: str = ALL) -> set[str]:
    """Our names of ``names`` (``--until`` targets given as the project names them); names of
    the project's own rules left out."""
    return {n for n in (local_name(x, all_name) for x in names) if n}
