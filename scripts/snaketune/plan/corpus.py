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

import functools
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

    def source_tokens(self) -> float:
        """The source's tokens: the sample's, at its rate per byte of the source."""
        return self.tokens if self.whole else self.tokens * self.total / max(self.read, 1)


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
    """The sample's figures; None without a tokenizer or a readable source. Read once a
    process for a file as it is (a plan asks for a set's rows from several stages)."""
    if path.suffix not in (".jsonl", ".parquet") or not path.is_file():
        return None
    tokenizer = model_dir / "tokenizer.json"
    stamp = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (path, tokenizer) if p.is_file()]
    return sampled(path, column, model_dir, max_length, limit, tuple(stamp))


@functools.lru_cache(maxsize=32)
def sampled(
    path: Path, column: str, model_dir: Path, max_length: int, limit: int, stamp: tuple
) -> Sample | None:
    """``sample``'s work, for one version of a file and the tokenizer (``stamp``: their
    sizes and times)."""
    found = tokenizer_of(model_dir)
    if found is None:
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


# ----------------------------------------------------------------------------- before download


def stated(config: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str]:
    """A dataset's size before its download: its ``size`` (the card's figures, in the
    config), else the split's rows on its card on the Hub where the Hub answers; (None, why
    and how to plan it offline) where neither says."""
    spec = config["datasets"][name]
    if "size" in spec:
        return {**spec["size"], "from": f"datasets.{name}.size"}, ""
    fix = f"set datasets.{name}.size (rows, and tokens for a text set: its card's figures)"
    if spec.get("source") != "hub":
        return None, f"datasets.{name} is not there yet"
    if "files" in spec:  # the card counts the repository's splits, not these files
        return None, f"datasets.{name} is not downloaded (its files have no row count); {fix}"
    rows, why = card_rows(
        spec["id"], spec.get("revision"), spec.get("subset"), spec.get("split", "train")
    )
    if rows is None:
        return None, f"datasets.{name} is not downloaded and {why}; {fix}"
    return {"rows": rows, "from": f"{spec['id']}'s card on the Hub"}, ""


@functools.cache
def card_rows(
    repo_id: str, revision: str | None, subset: str | None, split: str
) -> tuple[int | None, str]:
    """The rows a Hub dataset's card states for a split of a subset (its ``dataset_info``),
    asked once a process; (None, why) offline, unreachable or not stated."""
    from huggingface_hub import HfApi, constants

    from snaketune.data.sources import hub_reachable

    if constants.HF_HUB_OFFLINE:
        return None, "this machine is offline (HF_HUB_OFFLINE is set)"
    if not hub_reachable(constants.ENDPOINT):
        return None, f"the Hub ({constants.ENDPOINT}) cannot be reached from here"
    try:
        card = HfApi().dataset_info(repo_id, revision=revision).card_data
    except Exception as exc:  # gated without a token, no such repo or revision
        return None, f"the Hub refused it ({str(exc).splitlines()[0][:200]})"
    infos = (card.to_dict() if card else {}).get("dataset_info") or []
    for info in infos if isinstance(infos, list) else [infos]:
        if subset not in (None, info.get("config_name")):
            continue
        for entry in info.get("splits") or []:
            if entry.get("name") == split and entry.get("num_examples"):
                return int(entry["num_examples"]), ""
    return None, f"its card on the Hub states no rows for split {split}"


def stated_rows(documents: int, tokens: float, max_length: int) -> int:
    """Rows of ``documents`` documents of ``tokens`` tokens in all once split at
    ``max_length``, their lengths taken as exponential around their mean (a card states no
    more): each document's expected pieces are 1 / (1 - exp(-max_length / mean))."""
    mean = tokens / documents
    return round(documents / (1 - math.exp(-max_length / mean)))


def source_rows(config: dict[str, Any], dataset: str, workdir: Path) -> int | None:
    """Rows of a dataset's source (None: not known yet): its downloaded copy, else its local
    file (jsonl lines, a parquet's rows), else its stated size (``stated``); a mixture's
    components by their weights."""
    import pyarrow.parquet as pq

    from snaketune.data.formats import components

    total = 0.0
    for part in components(config, dataset):
        name, spec = part["name"], config["datasets"][part["name"]]
        path = source_file(spec, name, workdir)  # downloaded, else local
        if path is None or not path.is_file():
            size, _ = stated(config, name)
            if size is None:
                return None
            rows = size["rows"]
        elif path.suffix == ".parquet":
            rows = pq.ParquetFile(path).metadata.num_rows
        elif path.suffix == ".jsonl":
            rows = sum(1 for line in path.open() if line.strip())
        else:
            return None
        total += rows * part["weight"]
    return int(total)


def run_rows(
    config: dict[str, Any], run: dict[str, Any], workdir: Path, key: str = "dataset"
) -> tuple[int | None, str, float | None]:
    """A run's training rows (``key``: eval_dataset, its held-out rows) before
    tokenization, where the count comes from, and their
    tokens where they can be told (text: from a sample of its source, else its stated
    size; None for other rows, whose tokens their tokenization counts). A text source's
    documents become rows by their pieces at max_length: a sample's, else a stated size's
    (``stated_rows``), else one row a document (said); other rows count one each."""
    from snaketune.data.formats import components
    from snaketune.data.sources import model_folder

    model, length = model_folder(config, run["model"], workdir), run["max_length"]
    total, read, docs, said = 0.0, 0, 0, []
    tokens: float | None = 0.0
    for part in components(config, run[key]):
        name, spec, weight = part["name"], config["datasets"][part["name"]], part["weight"]
        documents = source_rows(config, name, workdir)
        if documents is None:
            return None, f"not counted yet: {stated(config, name)[1]}", None
        source = source_file(spec, name, workdir)
        found = None
        if spec.get("format") == "text" and source is not None:
            column = (spec.get("columns") or {}).get("text", "text")
            found = sample(source, column, model, length)
        size = None if source is not None and source.is_file() else stated(config, name)[0]
        if found is not None:
            rows, read, docs = (
                found.rows_for(documents),
                read + found.text_bytes,
                docs + found.documents,
            )
            tokens = None if tokens is None else tokens + weight * found.source_tokens()
        elif spec.get("format") == "text" and size and size.get("tokens"):
            rows = stated_rows(documents, size["tokens"], length)
            tokens = None if tokens is None else tokens + weight * size["tokens"]
            said.append(
                f"{size['from']}: {documents:,} documents, {size['tokens']:,.0f} tokens, split "
                f"at max_length {length}, their lengths taken as exponential"
            )
        else:
            rows, tokens = documents, None
            if spec.get("format") == "text":
                said.append(f"datasets.{name}: each document one row until its tokens are known")
            elif size:
                said.append(f"{size['from']}: {documents:,} rows")
        total += rows * weight
    if docs:
        said.insert(
            0,
            f"estimated from a sample of {read / 2**20:.1f} MiB ({docs:,} documents, "
            f"split at max_length {length} with the run's tokenizer)",
        )
    basis = (
        "; ".join(said)
        if said
        else "about, from the source rows (tokenization may drop overlong ones)"
    )
    return int(total), basis, tokens
