"""A text corpus's training rows before it is tokenized, from a sample: a document longer
than ``max_length`` becomes several rows (snaketune.data.text splits it, every token kept),
so counting a document as one example is off by the corpus's pieces per document (270x on
a corpus of long works).

The first ``SAMPLE_BYTES`` of the source (a local jsonl or parquet file, or the download
stage's ``data.parquet``) are read and each document tokenized with the run's own tokenizer
(its ``tokenizer.json``, with the tokens it adds around a text and the end-of-text token
after each document, as the tokenize job does); its rows per document, times the source's
documents, are the estimate. The tokenized set's count replaces it once there is one
(snaketune.budget.cost.examples_of). Filters are not applied to the sample.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 4 << 20  # the sample read of a source: its first 4 MiB of text


@dataclass(frozen=True)
class Sample:
    """What a sample of a corpus measured, and how much of its source it covers."""

    documents: int  # in the sample
    rows: int  # in the sample, after splitting at max_length
    tokens: int  # in the sample, with the tokens added around each document
    text_bytes: int  # of the sample's documents
    read: int  # bytes of the source the sample covers (jsonl lines; parquet: uncompressed)
    total: int  # bytes of the whole source, counted the same way
    whole: bool  # the sample is the whole source

    def rows_for(self, documents: int) -> int:
        """The source's rows: a row for each of its ``documents``, and the pieces beyond a
        document's first at the sample's rate per byte of the source (a corpus of short
        documents is counted exactly; one of long documents by its size)."""
        if self.whole or not self.documents:
            return self.rows
        extra = (self.rows - self.documents) * self.total / max(self.read, 1)
        return round(documents + extra)


def tokenizer_of(model_dir: Path):
    """The fast tokenizer of a model folder (no torch, no transformers), the ids it puts
    before and after a text, and whether its end-of-text token must be added after them;
    None where the folder has no tokenizer.json."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tok = Tokenizer.from_file(str(path))
    try:
        eos = json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError):
        eos = None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    at = next((k for k in range(len(full)) if full[k : k + len(bare)] == bare), 0)
    before, after = at, full[at + len(bare) :]
    eos_id = tok.token_to_id(eos) if eos else None
    added = len(after) + (0 if after[-1:] == [eos_id] else 1)
    return tok, before, added


def read_texts(path: Path, column: str, limit: int = SAMPLE_BYTES) -> tuple[list[str], int, int]:
    """The first documents of a jsonl or parquet file, up to ``limit`` bytes of text; the
    bytes of the source they cover and of the whole source (a jsonl's lines; a parquet's
    text column, uncompressed, by row group)."""
    texts, size, read = [], 0, 0
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        reader = pq.ParquetFile(path)
        index = reader.schema_arrow.get_field_index(column)
        meta = reader.metadata
        sizes = [
            meta.row_group(g).column(index).total_uncompressed_size
            for g in range(meta.num_row_groups)
        ]
        for group in range(reader.num_row_groups):
            if size >= limit:
                break
            values = reader.read_row_group(group, columns=[column]).column(0).to_pylist()
            texts += [v for v in values if isinstance(v, str) and v]
            size, read = (
                size + sum(len(v.encode()) for v in values if isinstance(v, str)),
                read + sizes[group],
            )
        return texts, read, sum(sizes)
    total = path.stat().st_size
    with path.open("rb") as fh:
        for line in fh:
            if size >= limit:
                break
            read += len(line)
            if not line.strip():
                continue
            value = json.loads(line).get(column)
            if isinstance(value, str) and value:
                texts.append(value)
                size += len(value.encode())
    return texts, read, total


def sample(
    path: Path, column: str, model_dir: Path, max_length: int, limit: int = SAMPLE_BYTES
) -> Sample | None:
    """The sample's figures; None without a tokenizer or a readable source."""
    found = tokenizer_of(model_dir)
    if found is None or path.suffix not in (".jsonl", ".parquet") or not path.is_file():
        return None
    tok, before, after = found
    texts, read, total = read_texts(path, column, limit)
    tokens = [
        before + len(e.ids) + after for e in tok.encode_batch(texts, add_special_tokens=False)
    ]
    return Sample(
        documents=len(texts),
        rows=sum(math.ceil(n / max_length) for n in tokens),
        tokens=sum(tokens),
        text_bytes=sum(len(t.encode()) for t in texts),
        read=read,
        total=total,
        whole=read >= total,
    )


def source_file(spec: dict[str, Any], name: str, workdir: Path) -> Path | None:
    """Where a dataset's rows are before tokenization: the download stage's copy, else a
    local source file."""
    downloaded = workdir / "resources/datasets" / name / "data.parquet"
    if downloaded.is_file():
        return downloaded
    if spec.get("source") == "local":
        local = Path(spec["path"])
        return local if local.is_absolute() else workdir / local
    return None
