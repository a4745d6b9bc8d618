"""The cleaning stage's jobs from the config (``datasets.<d>.clean``): what a dataset's
cleaning reads (its sources: a mixture's components, cleaned across them), the held-out sets
it is decontaminated against (the eval sets of the runs that train on it, and any named in
``clean.decontaminate.against``), its settings, its key (what its output depends on: runs
that share it share one cleaning), its parts (its tokenization's) and its files. The
tokenize spec of a cleaned dataset names its key, so its tokens change when the cleaning
does (snaketune.plan.stages.tokenize_spec); snaketune.data.cleaning does the work.
"""

from __future__ import annotations

from typing import Any

from snaketune.core.io import digest
from snaketune.data.formats import SINGLE_DATASET_KEYS, components

CLEAN_VERSION = 1  # bump when the signatures or the decisions change
FOLDER = "results/cleaned"
# what a source's rows are read by (its text and filters): the cleaning's key holds them
SOURCE_KEYS = ("source", *SINGLE_DATASET_KEYS)


def heldout_sets(config: dict[str, Any], dataset: str) -> list[str]:
    """The held-out sets ``dataset`` is decontaminated against: every eval set of the runs
    that train on it, and those its block names (``against``), itself never."""
    block = config["datasets"][dataset].get("clean") or {}
    decon = block.get("decontaminate")
    if not decon:
        return []
    runs = config.get("runs", {}).values()
    found = [r["eval_dataset"] for r in runs if r["dataset"] == dataset and "eval_dataset" in r]
    found += decon.get("against", [])
    return sorted({c["name"] for d in found for c in components(config, d)} - {dataset})


def clean_spec(config: dict[str, Any], dataset: str) -> dict[str, Any] | None:
    """What cleaning ``dataset`` reads and does (None: it is not cleaned)."""
    block = config["datasets"][dataset].get("clean")
    if block is None:
        return None

    def entry(name: str) -> dict[str, Any]:
        spec = config["datasets"][name]
        return {"name": name, "spec": {k: spec[k] for k in SOURCE_KEYS if k in spec}}

    spec = {
        "dataset": dataset,
        "sources": [entry(c["name"]) for c in components(config, dataset)],
        "heldout": [entry(h) for h in heldout_sets(config, dataset)],
        "settings": block,
        "version": CLEAN_VERSION,
    }
    return spec


def clean_key(spec: dict[str, Any]) -> str:
    keyed = {k: v for k, v in spec.items() if k != "parts"}
    return f"{spec['dataset']}__{digest(keyed)[:12]}"


def folder(spec: dict[str, Any]) -> str:
    return f"{FOLDER}/{clean_key(spec)}"


def removed_path(spec: dict[str, Any]) -> str:
    """The gather job's output the tokenize jobs read."""
    return f"{folder(spec)}/removed.parquet"


def signature_paths(spec: dict[str, Any]) -> list[str]:
    from snaketune.core.parts import part_name

    n = spec.get("parts", 1)
    return [f"{folder(spec)}/signatures-{part_name(p, n)}.parquet" for p in range(n)]


def clean_jobs(tokenize: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every cleaning the tokenized sets (``tokenize``: their specs by key) need, by key, in
    as many parts as the set's tokenization."""
    jobs = {}
    for spec in tokenize.values():
        if "clean" in spec:
            cleaned = {**spec["clean"], "parts": spec.get("parts", 1)}
            jobs[clean_key(cleaned)] = cleaned
    return jobs


def cleaned_by(config: dict[str, Any]) -> dict[str, str]:
    """Each cleaning's key, with a run that trains on the dataset it cleans."""
    specs = {run: clean_spec(config, r["dataset"]) for run, r in config["runs"].items()}
    return {clean_key(s): run for run, s in reversed(specs.items()) if s is not None}


def inputs(spec: dict[str, Any]) -> dict[str, list[str]]:
    """What a signatures job reads: the sources' and held-out sets' downloads."""
    data = "resources/datasets/{}/data.parquet".format
    return {
        "data": [data(s["name"]) for s in spec["sources"]],
        "heldout": [data(h["name"]) for h in spec["heldout"]],
    }


def check(config: dict[str, Any], where: str, name: str, spec: dict[str, Any]) -> list[str]:
    """What is wrong with dataset ``name``'s ``clean`` block (``where``: its config path)."""
    block = spec.get("clean")
    if block is None:
        return []
    out = []
    decon = block.get("decontaminate") or {}
    for other in decon.get("against", []):
        if other not in config["datasets"]:
            out.append(
                f"{where}.clean.decontaminate.against: no dataset {other!r}; name a dataset "
                "of datasets: (a held-out set to keep out of training)"
            )
    for other, entry in config["datasets"].items():  # a mixture reads it as one of its sources
        mixes = isinstance(entry, dict) and entry.get("source") == "mixture"
        if mixes and "clean" not in entry and name in [c["dataset"] for c in entry["mixture"]]:
            out.append(
                f"{where}.clean: {name!r} is tokenized inside mixture {other!r}, which is not "
                f"cleaned; set clean on datasets.{other} (it cleans across its sources)"
            )
    texts = {config["datasets"][c["name"]].get("format") for c in components(config, name)}
    if decon.get("action") == "spans" and texts != {"text"}:
        out.append(
            f"{where}.clean.decontaminate.action: spans cuts overlapping spans out of documents "
            f"(format text); {name!r} reads {', '.join(sorted(filter(None, texts)))}: set "
            "action: remove (the rows are removed whole)"
        )
    return out
