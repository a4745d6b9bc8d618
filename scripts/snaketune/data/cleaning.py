"""Corpus cleaning (``datasets.<d>.clean``, off unless asked): exact duplicates (the same
words once case, punctuation and spacing are set aside) and near duplicates (datasketch's
MinHash LSH over word n-grams) removed within a set and across a mixture's sources, the
first of each kept; and decontamination: a training row sharing a word n-gram (13 by
default) with a row of any held-out set removed, or, for a document, those spans cut.

Per part, as tokenization runs: a job signs each part's rows (``signatures``: the exact
hash, the MinHash, the held-out sets it overlaps, the text left once spans are cut); one
gather job (``decide``) reads every part's signatures in order and writes which rows go and
why (removed.parquet) and the counts (report.json); the tokenize jobs read the sources
without them (``Removed``). The corpus is never copied. A row's text is every string its
format reads (a chat row's turns, a pair's prompt and responses), tools and pictures aside.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snaketune.core.imports import deferred
from snaketune.data.formats import text_columns

np = deferred("numpy")
pa = deferred("pyarrow")
pq = deferred("pyarrow.parquet")

WORD = re.compile(r"\w+")
REASONS = ("heldout", "exact", "near")  # a row removed for more than one: the first
SEED = 1  # the MinHash permutations' seed: every part's signatures are comparable
# datasketch's weights of false positives and false negatives in choosing the LSH bands:
# recall first (threshold 0.8, 128 permutations: 16 bands of 8; a pair of similarity 0.9 is
# a candidate 9,999 times in 10,000), every candidate's similarity then checked
LSH_WEIGHTS = (0.05, 0.95)
SCHEME = "affine32"  # datasketch's default MinHash scheme (32-bit values), named: kept alike
# removed.parquet: a row removed (reason heldout, exact or near) or cut (reason spans: kept,
# its text the document left), the kept row it duplicates, the held-out sets it overlaps
REMOVED_COLUMNS = ("source", "row", "reason", "of_source", "of_row", "heldout", "text")


def words(text: str) -> list[str]:
    """A text's words, case folded (punctuation and spacing dropped)."""
    return [w.casefold() for w in WORD.findall(text)]


def flat_text(value: Any) -> Iterator[str]:
    """Every string in a cell: itself, a list's, a message's content."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        yield from flat_text(value.get("content", [v for v in value.values() if v]))
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from flat_text(item)


def row_texts(batch: Any, columns: list[str]) -> list[str]:
    """Each row's text: every string of its text columns, a line each."""
    present = [batch.column(c).to_pylist() for c in columns if c in batch.schema.names]
    rows = zip(*present, strict=True) if present else [()] * batch.num_rows
    return ["\n".join(s for cell in cells for s in flat_text(cell)) for cells in rows]


# ------------------------------------------------------------------- held-out sets' n-grams


def gram_hashes(ws: list[str], n: int) -> list[int]:
    """The word n-grams of ``ws`` as 64-bit hashes (a row shorter than n: none)."""
    return [
        int.from_bytes(hashlib.blake2b(" ".join(ws[i : i + n]).encode(), digest_size=8).digest())
        for i in range(len(ws) - n + 1)
    ]


@dataclass
class HeldOut:
    """The n-grams of the held-out sets, each with the sets it is in; a row shorter than
    ``n`` words but of ``min_words`` or more is one n-gram of its own length."""

    n: int
    min_words: int
    grams: dict[int, dict[int, set[str]]] = field(default_factory=dict)  # length -> hash -> sets
    too_short: dict[str, int] = field(default_factory=dict)  # held-out rows not checkable

    def add(self, name: str, text: str) -> None:
        ws = words(text)
        n = min(self.n, len(ws))
        if n < self.min_words:
            self.too_short[name] = self.too_short.get(name, 0) + 1
            return
        of_length = self.grams.setdefault(n, {})
        for h in gram_hashes(ws, n):
            of_length.setdefault(h, set()).add(name)

    def overlaps(self, ws: list[str]) -> tuple[set[str], list[tuple[int, int]]]:
        """The held-out sets a row's words overlap, and the word spans [a, b) that do."""
        found: set[str] = set()
        spans = []
        for n, table in self.grams.items():
            for i, h in enumerate(gram_hashes(ws, n)):
                if h in table:
                    found |= table[h]
                    spans.append((i, i + n))
        return found, spans


def held_out(sources: list[Any], settings: dict[str, Any]) -> HeldOut | None:
    """The n-grams of the held-out sets ``sources`` (every row, after their filters); None
    where nothing is decontaminated."""
    decon = settings["decontaminate"]
    if not decon or not sources:
        return None
    found = HeldOut(decon["ngram"], decon["min_words"])
    for k, spec, batch, _ in source_batches(sources, None):
        for text in row_texts(batch, text_columns(spec)):
            found.add(sources[k].name, text)
    return found


def cut_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """``text`` with the character ranges of the word spans cut out (a space left between)."""
    places = [m.span() for m in WORD.finditer(text)]
    covered = sorted((places[a][0], places[b - 1][1]) for a, b in spans)
    out, at = [], 0
    for start, end in covered:
        if end <= at:
            continue
        out.append(text[at : max(start, at)])
        at = end
    out.append(text[at:])
    return " ".join(p.strip() for p in out if p.strip())


# --------------------------------------------------------------------------- signatures


def exact_hash(ws: list[str]) -> bytes:
    return hashlib.blake2b(" ".join(ws).encode(), digest_size=16).digest()


def minhashes(rows: list[list[str]], near: dict[str, Any]) -> list[Any]:
    """Each row's MinHash values over its word n-grams (the whole row where it is shorter):
    datasketch's, one permutation state for the batch (``MinHash.generator``)."""
    from datasketch import MinHash

    def shingles(ws: list[str]) -> list[bytes]:
        n = max(1, min(near["ngram"], len(ws)))
        return [" ".join(ws[i : i + n]).encode() for i in range(len(ws) - n + 1)]

    made = MinHash.generator(
        map(shingles, rows), num_perm=near["num_perm"], seed=SEED, scheme=SCHEME
    )
    return [m.hashvalues for m in made]


def signature_rows(
    texts: list[str], settings: dict[str, Any], heldout: HeldOut | None, spans_ok: bool
) -> dict[str, list]:
    """Each row's signature: its exact hash, MinHash, the held-out sets it overlaps and, where
    its overlapping spans are cut instead (``spans_ok``: a document), the text left."""
    near, decon = settings["near"], settings["decontaminate"]
    out: dict[str, list] = {"exact": [], "minhash": [], "heldout": [], "text": []}
    rows = []
    for text in texts:
        ws = words(text)
        sets, spans = heldout.overlaps(ws) if heldout is not None else (set(), [])
        left = None
        if sets and spans_ok and decon["action"] == "spans":
            left = cut_spans(text, spans)
            ws = words(left)
        rows.append(ws)
        out["exact"].append(exact_hash(ws))
        out["heldout"].append(sorted(sets))
        out["text"].append(left)
    out["minhash"] = minhashes(rows, near) if near else [None] * len(rows)
    return out


def source_batches(
    sources: list[Any], rows: tuple[int, int] | None
) -> Iterator[tuple[int, Any, Any, Any]]:
    """(source number, its spec, a batch of its text, their row numbers) over the sources'
    rows ``rows`` (a part's; all: None), each source's filters applied: tokenization's reader
    (snaketune.data.conversations.row_batches), reading the text and the filters' columns."""
    from snaketune.data.conversations import row_batches

    def columns(spec: dict[str, Any]) -> list[str]:
        return [*text_columns(spec), *(f["column"] for f in spec.get("filters", []))]

    for k, source, _, batch, index, _ in row_batches(sources, rows, columns, 4096):
        yield k, source.spec, batch, index


def signatures(
    sources: list[Any],
    rows: tuple[int, int],
    settings: dict[str, Any],
    heldout: HeldOut | None,
    out: Path,
) -> int:
    """The signatures of the sources' rows ``rows`` into ``out``; the rows signed."""
    width = settings["near"]["num_perm"] if settings["near"] else 1
    schema = pa.schema(
        [
            ("source", pa.int32()),
            ("row", pa.int64()),
            ("exact", pa.binary(16)),
            ("minhash", pa.list_(pa.uint32(), width)),
            ("heldout", pa.list_(pa.string())),
            ("text", pa.string()),
        ]
    )
    signed = 0
    with pq.ParquetWriter(out, schema) as writer:
        for k, spec, batch, index in source_batches(sources, rows):
            texts = row_texts(batch, text_columns(spec))
            sig = signature_rows(texts, settings, heldout, spec["format"] == "text")
            columns = {"source": [k] * len(index), "row": index, **sig}
            writer.write_table(pa.table(columns, schema=schema))
            signed += len(index)
    return signed


# ------------------------------------------------------------------------------ the gather


@dataclass
class Counts:
    """What cleaning read and removed, per reason, per source and per held-out set."""

    names: list[str]
    rows: int = 0
    removed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)
    per_heldout: dict[str, int] = field(default_factory=dict)
    spans_cut: int = 0

    def add(self, source: str, why: str | None, heldout: list[str], cut: bool) -> None:
        self.rows += 1
        mine = self.per_source.setdefault(source, {"rows": 0, **dict.fromkeys(REASONS, 0)})
        mine["rows"] += 1
        for name in heldout:  # every training row overlapping the set, removed or cut
            self.per_heldout[name] = self.per_heldout.get(name, 0) + 1
        self.spans_cut += cut and why is None
        if why is not None:
            self.removed[why] += 1
            mine[why] += 1

    def report(self, settings: dict[str, Any], heldout: HeldOut | None) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "kept": self.rows - sum(self.removed.values()),
            "removed": self.removed,
            "per_source": self.per_source,
            "per_heldout": self.per_heldout,
            "spans_cut": self.spans_cut,
            "heldout_rows_too_short": heldout.too_short if heldout is not None else {},
            "settings": settings,
        }


class Gather:
    """The gather job's pass over every part's signatures in order: the first of each set of
    duplicates kept; a near duplicate is a row datasketch's MinHashLSH finds among the rows
    kept before it whose estimated similarity reaches the threshold."""

    def __init__(self, names: list[str], settings: dict[str, Any]):
        from datasketch import MinHash, MinHashLSH

        self.names, self.near, self.exact = names, settings["near"], settings["exact"]
        near, self.lsh = self.near, None
        if near:  # bands chosen for recall (LSH_WEIGHTS), each candidate then checked
            limits = {"threshold": near["threshold"], "num_perm": near["num_perm"]}
            self.lsh = MinHashLSH(**limits, weights=LSH_WEIGHTS)
            self.permutations = MinHash(near["num_perm"], seed=SEED, scheme=SCHEME).permutations
        # the kept rows by number (in LSH's index and ``first``: small ints, not their keys),
        # their MinHash values a row each of one array (doubled as it fills)
        self.keys: list[tuple[str, int]] = []
        self.kept = np.empty((1024, near["num_perm"] if near else 0), np.uint32)
        self.first: dict[bytes, int] = {}
        self.removed: dict[str, list] = {k: [] for k in REMOVED_COLUMNS}
        self.counts = Counts(names)

    def reason(self, r: dict[str, Any], key: tuple[str, int]) -> tuple[str | None, Any]:
        """Why row ``r`` goes (None: it stays, and is kept as the first of its kind)."""
        from datasketch import MinHash

        if r["heldout"] and r["text"] is None:
            return "heldout", None
        if self.exact and r["exact"] in self.first:
            return "exact", self.keys[self.first[r["exact"]]]
        number = len(self.keys)
        if self.lsh is not None:
            hashes = r["minhash"]
            m = MinHash(seed=SEED, hashvalues=hashes, permutations=self.permutations, scheme=SCHEME)
            found = [k for k in self.lsh.query(m) if self.similar(hashes, self.kept[k])]
            if found:
                return "near", self.keys[min(found)]
            self.lsh.insert(number, m, check_duplication=False)
            if number == len(self.kept):
                self.kept = np.concatenate([self.kept, np.empty_like(self.kept)])
            self.kept[number] = hashes
        self.first.setdefault(r["exact"], number)
        self.keys.append(key)
        return None, None

    def similar(self, a: Any, b: Any) -> bool:
        """Whether two rows' estimated Jaccard similarity (the share of their MinHash values
        that are equal) reaches the threshold: a candidate of LSH below it stays."""
        return float(np.mean(a == b)) >= self.near["threshold"]

    def add(self, r: dict[str, Any]) -> None:
        key = (self.names[r["source"]], r["row"])
        why, of = self.reason(r, key)
        cut = r["text"] is not None
        self.counts.add(key[0], why, r["heldout"], cut)
        if why is not None or cut:
            values = (*key, why or "spans", *(of or (None, None)), r["heldout"], r["text"])
            for name, value in zip(REMOVED_COLUMNS, values, strict=True):
                self.removed[name].append(value)


def decide(parts: list[Path], names: list[str], settings: dict[str, Any]) -> Gather:
    """Every part's signatures gathered in order: which rows go and why, and the counts."""
    gather = Gather(names, settings)
    for path in parts:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            rows = batch.drop_columns(["minhash"]).to_pylist()
            hashes = [None] * len(rows)
            if settings["near"]:  # as an array: a row's values a view, no Python ints
                flat = batch.column("minhash").flatten().to_numpy()
                hashes = flat.reshape(len(rows), -1)
            for r, h in zip(rows, hashes, strict=True):
                gather.add(r | {"minhash": h})
    return gather


def write_removed(gather: Gather, out: Path) -> None:
    text, number = pa.string(), pa.int64()
    types = (text, number, text, text, number, pa.list_(text), text)
    schema = pa.schema(list(zip(REMOVED_COLUMNS, types, strict=True)))
    pq.write_table(pa.table(gather.removed, schema=schema), out)


# ---------------------------------------------------------------- what tokenization reads


@dataclass
class Removed:
    """The rows a dataset's cleaning removed from each source (by row number), and the
    documents it cut (their text left), as the tokenize jobs read them (its removed.parquet)."""

    rows: dict[str, Any]  # each source's removed row numbers, sorted (numpy)
    texts: dict[str, dict[int, str]]

    @classmethod
    def read(cls, path: str | Path) -> Removed:
        table = pq.read_table(path, columns=["source", "row", "reason", "text"]).to_pylist()
        rows: dict[str, list[int]] = {}
        texts: dict[str, dict[int, str]] = {}
        for r in table:
            if r["reason"] == "spans":
                texts.setdefault(r["source"], {})[r["row"]] = r["text"]
            else:
                rows.setdefault(r["source"], []).append(r["row"])
        return cls({k: np.unique(np.asarray(v, np.int64)) for k, v in rows.items()}, texts)

    def keep(self, source: str, index: Any) -> Any:
        """Which of a source's rows ``index`` stay (a boolean mask; a batch's look-up is
        a binary search of the removed rows, not a pass over them)."""
        gone = self.rows.get(source)
        if gone is None or not len(gone):
            return np.ones(len(index), bool)
        at = np.minimum(np.searchsorted(gone, index), len(gone) - 1)
        return gone[at] != np.asarray(index)

    def edited(self, source: str, spec: dict[str, Any], batch: Any, index: Any) -> Any:
        """``batch`` with its cut documents' text left in their text column."""
        cut = self.texts.get(source)
        if not cut or not any(int(i) in cut for i in index):
            return batch
        column = text_columns(spec)[0]
        values = [
            cut.get(int(i), v) for i, v in zip(index, batch.column(column).to_pylist(), strict=True)
        ]
        at = batch.schema.get_field_index(column)
        return batch.set_column(at, column, pa.array(values, pa.string()))
