"""The disk a run's pictures take: a picture set's tokenized file keeps each row's picture
bytes (snaketune.data.pictures) and the run's shards carry them again, so the disk plan
(snaketune.budget.diskplan) counts a picture set's pictures once for each of those files
still to be written: the training set's tokenized file and shards, the held-out set's
tokenized file.

A picture set's pictures are measured where they are once downloaded: a Hub set's parquet
holds them (its size); a local set's rows name files (their sizes, from the first
``SAMPLED`` rows scaled to all). Before the download they are not counted: the train job's
own check (``check_job_disk``) runs after tokenize and shard wrote them, against the space
then free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SAMPLED = 1000  # rows of a local set whose named pictures are measured


def picture_bytes(config: dict[str, Any], name: str, root: Path) -> float:
    """Bytes run ``name``'s pictures will take in the files not written yet (0 for text)."""
    from snaketune.core import parts
    from snaketune.data.formats import components, has_pictures
    from snaketune.plan.stages import tokenized

    run = config["runs"][name]
    total = 0.0
    for key, copies in (("dataset", ("tokenized", "shards")), ("eval_dataset", ("tokenized",))):
        dataset = run.get(key)
        if dataset is None or not has_pictures(config, dataset):
            continue
        raw = sum(downloaded_bytes(config, c["name"], root) for c in components(config, dataset))
        written = {  # this run's own set (its key), not another model's or length's beside it
            "tokenized": parts.exists(root / tokenized(config, name, key == "eval_dataset")),
            "shards": (root / "results" / name / "shards").is_dir(),
        }
        total += raw * sum(not written[c] for c in copies)
    return total


def downloaded_bytes(config: dict[str, Any], dataset: str, root: Path) -> float:
    """A downloaded dataset's picture bytes, at most: its parquet (a Hub set's pictures are
    inside) and, for a local set, the files its rows name. 0 before the download."""
    spec = config["datasets"][dataset]
    data = root / "resources/datasets" / dataset / "data.parquet"
    if not data.is_file():
        return 0.0
    size = float(data.stat().st_size)
    if spec.get("source") == "local":
        given = root / spec["path"]
        size += named_files_bytes(data, spec, given if given.is_dir() else given.parent)
    return size


def named_files_bytes(data: Path, spec: dict[str, Any], base: Path) -> float:
    """The bytes of the picture files a local set's rows name (paths relative to ``base``),
    measured on its first ``SAMPLED`` rows and scaled to all of them."""
    import pyarrow.parquet as pq

    from snaketune.data.kinds import fields_read

    columns = [spec["columns"][f] for f in fields_read(spec)]
    file = pq.ParquetFile(data)
    rows = file.metadata.num_rows
    if not columns or not rows or columns[0] not in file.schema_arrow.names:
        return 0.0
    sampled = file.read_row_groups([0], columns=columns).column(0).to_pylist()[:SAMPLED]
    measured = 0
    for values in sampled:
        for value in values if isinstance(values, list) else [values]:
            path = (
                value.get("path") if isinstance(value, dict) and not value.get("bytes") else value
            )
            if isinstance(path, str) and (base / path).is_file():
                measured += (base / path).stat().st_size
    return measured * rows / max(len(sampled), 1)
