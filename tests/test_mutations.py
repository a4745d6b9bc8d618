"""The catalogue of planted bugs (tests/mutations.py) holds: each source to mutate is there
once, and each mutation is caught in the CI tier (a test it names is selected by the CI
tier's marks) or names the extended test that catches it. Running the mutations is
`python tests/mutations.py` (docs/testing.md keeps the last result)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ENV, ROOT
from mutations import MUTATIONS

CI_MARKS = "not extended and not bench"


def collected(marks: str, tests: list[str]) -> set[str]:
    """The node ids pytest selects of ``tests`` under ``marks`` (parameters stripped)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marks,
                           "-p", "no:cacheprovider", *tests], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line.split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_each_mutation_is_caught_in_the_ci_tier_or_names_its_extended_test():
    names = [m.name for m in MUTATIONS]
    assert len(names) == len(set(names)), names
    for m in MUTATIONS:
        assert (ROOT / m.path).read_text(encoding="utf-8").count(m.old) == 1, m.name
        assert m.tests or m.extended, m.name
    named = sorted({t for m in MUTATIONS for t in (*m.tests, *m.extended)})
    everywhere = collected("", named)
    assert set(named) <= everywhere, set(named) - everywhere  # every named test exists
    ci = collected(CI_MARKS, named)
    extended = everywhere - ci  # (no mutation names a benchmark)
    for m in MUTATIONS:
        assert set(m.tests) <= ci, (m.name, set(m.tests) - ci)  # `tests`: the CI tier's
        assert set(m.extended) <= extended, (m.name, set(m.extended) - extended)
