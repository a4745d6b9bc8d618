"""A Hub dataset's files at one commit: listed, chosen by globs, fetched one by one.

A corpus of terabytes is taken a few files at a time: ``datasets.<d>.files`` names globs of
the repository's paths (as ``data_files`` does; ``*`` also crosses ``/``), e.g.
``sample/10BT/*.parquet``. Each file is fetched by huggingface_hub's ``hf_hub_download``
into a folder of the workflow's (resources/datasets/<name>/files/), outside the download
job's declared outputs: a file cut off mid-way resumes from its ``.incomplete`` part (within
the call, and on the next run), and a file already complete is not fetched again.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from pathlib import Path

from snaketune.core.errors import DataError

log = logging.getLogger(__name__)
GIB = 2**30


def matching(paths: list[str], patterns: list[str]) -> list[str]:
    """The paths that match any of ``patterns``, sorted."""
    return sorted(p for p in paths if any(fnmatch.fnmatchcase(p, g) for g in patterns))


@functools.cache
def listing(repo_id: str, commit: str) -> tuple[tuple[str, int], ...]:
    """Every file of a Hub dataset at ``commit``: (path, bytes)."""
    from huggingface_hub import HfApi

    tree = HfApi().list_repo_tree(repo_id, recursive=True, revision=commit, repo_type="dataset")
    return tuple((f.path, f.size) for f in tree if getattr(f, "size", None) is not None)


def chosen(name: str, repo_id: str, commit: str, patterns: list[str]) -> dict[str, int]:
    """The files ``patterns`` take of the dataset at ``commit`` and their bytes; none is one
    line naming the globs and some of the files there are."""
    files = dict(listing(repo_id, commit))
    picked = matching(list(files), patterns)
    if not picked:
        some = ", ".join(sorted(files)[:8]) or "none"
        raise DataError(
            f"datasets.{name}.files: no file of {repo_id} at {commit[:12]} matches "
            f"{', '.join(patterns)} (its files include: {some}); fix the globs"
        )
    return {p: files[p] for p in picked}


def fetch(repo_id: str, commit: str, files: dict[str, int], folder: Path) -> list[Path]:
    """Each of ``files`` downloaded into ``folder`` (resumed where cut off, skipped where
    complete), a line each; their local paths in order."""
    from huggingface_hub import hf_hub_download

    total, done, out = sum(files.values()), 0, []
    for k, (path, size) in enumerate(files.items(), 1):
        local = hf_hub_download(
            repo_id, path, repo_type="dataset", revision=commit, local_dir=folder
        )
        done += size
        line = f"{path} ({size / GIB:.2f} GiB; {done / GIB:.2f} of {total / GIB:.2f} GiB)"
        log.info("file %d of %d: %s", k, len(files), line)
        out.append(Path(local))
    return out
