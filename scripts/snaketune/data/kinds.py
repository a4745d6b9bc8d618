"""The kinds of data a method trains on, as plug-ins: supervised rows, prompts (the method
generates its own responses), preference pairs and labelled responses. A method names its kind
(``Method.trains_on``); nothing outside the kinds asks "is it pairs?": the config checks,
tokenization, the shard plan, the rank's rows, the reference stage and evaluation ask the
kind.

A ``Kind`` is light (the config side reads it while Snakemake parses the workflow); what
it does with tokens is in its module (``module``), imported when tokens are handled, with:

- ``schema(base)``: the tokenized file's schema (the supervised columns and its own);
- ``render(renderer, items, stats)``: a batch of read examples -> (the examples kept,
  texts to encode, response spans);
- ``label(batch)``: the encoded batch (an ``Encoded``) as a table of rows, its length policy
  applied;
- ``dropped(stats)``: a log line of what it dropped beyond the common counts ("" for none);
- ``batch(examples, pad)``: examples collated as a trainer and a scorer read them (None
  where methods collate rows themselves: packing, padding-free);
- ``read_row(source, system, cols, data, i, row)`` (optional): a row of a dataset format
  only this kind reads (``labelled``), as snaketune.data.conversations reads the others.

A kind with held-out figures of its own names them (``heldout``); the evaluation wing maps
the name to the module that scores them (snaketune.evaluation.evaluate.scorer: ``logps(model,
rows, batch_size, pad, share)``, ``sample_fields(scores)``, ``figures(samples, base, beta)``,
``recorded(samples_path)``).

Adding a kind: its ``Kind`` in ``KINDS`` and its module; docs/architecture.md has the
checklist.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from snaketune.core.errors import ConfigError

SUPERVISED_COLUMNS = ("example_id", "input_ids", "labels")  # every tokenized file's
ROW_FORMATS = ("prompt_response", "alpaca", "messages")
# what methods of rows (SFT) train on: chat rows and raw text (continued pre-training)
SUPERVISED_FORMATS = (*ROW_FORMATS, "text")


@dataclass(frozen=True)
class Encoded:
    """One batch a kind labels (``label(batch)``): its examples as read and rendered, their
    encodings, and what the job's length policy and the tokenized file ask."""

    items: list  # (example id, example) as read
    texts: list[str]  # each example's rendered text (a pair's: its chosen sides, then rejected)
    spans: list  # each text's trained character spans
    encodings: list  # the fast tokenizer's encodings of ``texts``
    max_length: int
    overlong: str  # the length policy: drop or truncate
    stats: Any  # the job's counts (snaketune.data.conversations.Stats)
    schema: Any = None  # the tokenized file's pyarrow schema
    tokenizer: Any = None  # the run's tokenizer (the processor's and the ends' source)

    def of(self, schema: Any, tokenizer: Any) -> Encoded:
        return replace(self, schema=schema, tokenizer=tokenizer)


@dataclass(frozen=True)
class Kind:
    """A kind of training data: its formats and columns, and what the plans and stages
    ask of it."""

    name: str
    noun: str  # its examples, plural, as logs and messages say: "conversations", "pairs"
    formats: tuple[str, ...]  # the dataset formats (datasets.<d>.format) a method trains on
    # the dataset formats its methods may evaluate on (None: any)
    evaluates_on: tuple[str, ...] | None = None
    # how a message names the data it needs: "a dataset of format preference (...)"
    needs: str = ""
    # the dataset formats tokenized as this kind (its own tokenized files; a kind may train
    # on other kinds' too: KTO's labelled responses on preference pairs)
    stores: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()  # its tokenized columns besides the supervised ones
    sequences: int = 1  # sequences an example of its own tokenized files has (a pair: 2)
    # its examples are never packed and the shard plan balances each step's tokens across
    # the ranks (whole examples of several sequences)
    balances_tokens: bool = False
    # its responses are generated in training, by the model being trained (a prompt's
    # rollouts): a step's time is its generation's, measured, not derived from FLOPs
    generated_in_training: bool = False
    # its tokens' handling (see above): supervised rows' is tokenization's own
    module: str = "snaketune.data.tokenization"
    # the name of its own held-out figures (snaketune.evaluation.evaluate.scorer)
    heldout: str | None = None
    # the kind of data its examples are with pictures (a data kind of its own, read when a
    # dataset of its formats has columns.images); None where there is none
    pictured: str | None = None
    # the kind whose tokenized rows its rows are (text documents are supervised rows with
    # every token trained): a mixture of both is tokenized as that kind, each source's
    # rows by its own kind's module
    joins: str | None = None
    # its held-out rows are scored by generating from their prompts (False: documents,
    # which have no prompt: their loss and its module's ``held_out_figures(loss, rows)``)
    generates: bool = True
    # its rows are rendered with the model's chat template (False: raw text needs none)
    chat: bool = True

    def impl(self) -> ModuleType:
        return importlib.import_module(self.module)

    def holds(self, columns: Iterable[str]) -> bool:
        """Whether a tokenized set's columns (or a row of it) are this kind's."""
        names = set(columns)
        return all(c in names for c in self.columns)

    @property
    def read_columns(self) -> list[str]:
        """The columns a stage reads of its tokenized file."""
        return [*SUPERVISED_COLUMNS, *self.columns]


KINDS = {
    "rows": Kind(
        "rows",
        "conversations",
        SUPERVISED_FORMATS,
        evaluates_on=SUPERVISED_FORMATS,
        needs="a dataset of rows (format prompt_response, alpaca, messages or text)",
        stores=ROW_FORMATS,
        pictured="pictures",
    ),
    # raw documents (continued pre-training): every token trained, end-of-text after each,
    # a document longer than max_length split into pieces, all kept (snaketune.data.text);
    # the methods of rows train on them
    "text": Kind(
        "text",
        "documents",
        ("text",),
        evaluates_on=("text",),
        needs="a dataset of format text (documents)",
        stores=("text",),
        columns=("text_bytes",),
        module="snaketune.data.text",
        joins="rows",
        generates=False,
        chat=False,
    ),
    "prompts": Kind(
        "prompts",
        "prompts",
        ROW_FORMATS,
        evaluates_on=ROW_FORMATS,
        needs="a dataset of prompts (format prompt_response, alpaca or "
        "messages; their responses are the reference answers)",
        generated_in_training=True,
    ),
    "pairs": Kind(
        "pairs",
        "pairs",
        ("preference",),
        needs="a dataset of format preference (prompt, chosen, rejected)",
        stores=("preference",),
        columns=("rejected_input_ids", "rejected_labels"),
        sequences=2,
        balances_tokens=True,
        module="snaketune.data.pairs",
        heldout="preference",
        pictured="picture_pairs",
    ),
    # single responses, each desirable or not (KTO): a labelled set's, or a preference set's
    # (its chosen responses desirable, its rejected ones not: snaketune.data.labelled)
    "labelled": Kind(
        "labelled",
        "labelled responses",
        ("labelled", "preference"),
        needs="a dataset of format labelled (prompt, completion, label) or "
        "preference (each chosen response desirable, each rejected one not)",
        stores=("labelled",),
        columns=("desirable",),
        balances_tokens=True,
        module="snaketune.data.labelled",
    ),
    # rows with pictures (TRL's vision layout: a messages dataset with columns.images), read
    # and tokenized by their own module; the methods of rows train on them, padded
    "pictures": Kind(
        "pictures",
        "picture conversations",
        ("messages",),
        evaluates_on=("messages",),
        needs="a dataset of format messages with columns.images (pictures)",
        columns=("images",),
        module="snaketune.data.pictures",
    ),
    # preference pairs whose prompts hold pictures (TRL's vision preference layout: a
    # preference dataset with columns.images); DPO trains on them, padded
    "picture_pairs": Kind(
        "picture_pairs",
        "picture pairs",
        ("preference",),
        needs="a dataset of format preference with columns.images (pictures)",
        columns=("rejected_input_ids", "rejected_labels", "images"),
        sequences=2,
        balances_tokens=True,
        module="snaketune.data.picture_pairs",
        heldout="preference",
    ),
}
PICTURES = KINDS["pictures"]
PICTURE_PAIRS = KINDS["picture_pairs"]
PICTURED = {k.pictured: k for k in KINDS.values() if k.pictured}  # name -> its text kind


def kind_named(name: str) -> Kind:
    return KINDS[name]


def kind_of_format(fmt: str) -> Kind:
    """The kind a dataset of format ``fmt`` is tokenized as."""
    return next(k for k in KINDS.values() if fmt in k.stores)


def kind_of_source(spec: dict) -> Kind:
    """The kind a dataset (its config entry) is tokenized as: its format's, or that kind's
    with pictures where it has ``columns.images`` (a messages or preference dataset)."""
    kind = kind_of_format(spec["format"])
    pictured = KINDS.get(kind.pictured or "")
    if (
        pictured
        and spec["format"] in pictured.formats
        and PICTURES.holds(spec.get("columns") or {})
    ):
        return pictured
    return kind


def has_pictures(kind: Kind) -> bool:
    """Whether examples of ``kind`` hold pictures."""
    return kind.name in PICTURED


def own_fields(fmt: str) -> tuple[str, ...]:
    """The fields a kind adds to dataset format ``fmt``'s (``columns.images`` of messages
    and preference data)."""
    pictured = kind_of_format(fmt).pictured
    return PICTURES.columns if pictured and fmt in KINDS[pictured].formats else ()


def fields_read(spec: dict) -> tuple[str, ...]:
    """The fields beyond its format's a dataset's kind reads (a picture set's pictures)."""
    return PICTURES.columns if has_pictures(kind_of_source(spec)) else ()


def kind_of_sources(specs: Iterable[dict]) -> Kind:
    """The one kind the datasets ``specs`` (a mixture's) are tokenized as: with pictures
    where any holds pictures (a text example is a picture example without pictures)."""
    specs = list(specs)
    kind = kind_of_formats(s["format"] for s in specs)
    if kind.pictured and any(has_pictures(kind_of_source(s)) for s in specs):
        return KINDS[kind.pictured]
    return kind


def kind_of_formats(formats: Iterable[str]) -> Kind:
    """The one kind the datasets of ``formats`` (a mixture's) are tokenized as."""
    kinds = {kind_of_format(f).name for f in formats}
    if len(kinds) > 1:  # documents with chat rows (replay): rows, each by its own module
        kinds = {KINDS[k].joins or k for k in kinds}
    if len(kinds) != 1:
        raise ConfigError(
            f"the datasets mix kinds of data ({', '.join(sorted(kinds))}); "
            "a mixture's components are of one kind"
        )
    return KINDS[kinds.pop()]


def kind_of_columns(columns: Iterable[str]) -> Kind:
    """The kind of a tokenized set, by its columns (or a row of it)."""
    names = set(columns)
    own = [k for k in KINDS.values() if (k.stores or k.columns) and k.holds(names)]
    return max(own, key=lambda k: len(k.columns))


def mixes_kinds(formats: Iterable[str | None]) -> str | None:
    """What is wrong with a mixture of datasets of ``formats`` (None: nothing): its
    components are of one kind of data."""
    kinds: dict[str, set[str]] = {}
    for fmt in filter(None, formats):
        kind = kind_of_format(fmt)
        kinds.setdefault(KINDS[kind.joins].noun if kind.joins else kind.noun, set()).add(fmt)
    if len(kinds) < 2:
        return None
    return (
        f"mixes {' and '.join(sorted(kinds))} ("
        + "; ".join(", ".join(sorted(f)) for _, f in sorted(kinds.items()))
        + "); a mixture's components are of one kind of data, the one its run's method "
        "trains on"
    )


def unread(where: str, part: str, fmt: str, method: str, kind: Kind, readers: list[str]) -> str:
    """The line for a dataset ``part`` of a format that ``method`` (on ``kind``) does not
    read: the data its kind needs, or the methods (``readers``) that read this one."""
    if not kind_of_format(fmt).columns:  # rows: what every kind of data has
        return (
            f"{where}: {part!r} (format {fmt}) has no {kind.noun} to tune on; method "
            f"{method} needs {kind.needs}"
        )
    named = f"method{'s' if len(readers) > 1 else ''} {', '.join(readers)}"
    return (
        f"{where}: {part!r} is a {fmt} dataset ({kind_of_format(fmt).noun}), which only "
        f"{named} train and evaluate on; set method: {' or '.join(readers)} or use a "
        "dataset of another format"
    )
