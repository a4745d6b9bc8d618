"""Publish a run's final model to the Hugging Face Hub: the model (safetensors), its
tokenizer and a model card, in one folder that is uploaded as it is.

The card says what a reader of the Hub needs to trust the model: the base model (and the
commit it was pinned to), the datasets with theirs, the method and its hyperparameters, the
evaluation results (as the Hub's model-index metadata and as a table), the sha256 of the
model's provenance record, and the license (the base model's card's, or
``publish.license``).

The token comes only from HF_TOKEN or huggingface_hub's login cache, never from the config,
and is never written or logged. ``publish.dry_run: true`` writes the folder and uploads
nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from snaketune.core.errors import UserError
from snaketune.methods import method_of
from snaketune.plan.pipeline import TRAIN

log = logging.getLogger(__name__)

# What the Hub repo gets from the final model's directory (no training state, no provenance
# with local paths and host names: its sha256 is in the card).
MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "adapter_config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "*.model",
)
# Run keys shown as hyperparameters in the card (and the run's method block, as its method
# shows it).
CARD_KEYS = (
    "method",
    "learning_rate",
    "lr_scheduler",
    "warmup_ratio",
    "epochs",
    "max_steps",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "nodes",
    "gpus_per_node",
    "max_length",
    "packing",
    "deepspeed",
    "seed",
    "lora",
)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def source_of(provenance: dict[str, Any]) -> dict[str, Any]:
    """Where a downloaded model or dataset came from: hub id and commit, or local sha256s."""
    if provenance.get("source") == "hub" or "commit" in provenance:
        return {"id": provenance.get("id"), "commit": provenance.get("commit")}
    files = provenance.get("files") or provenance.get("outputs") or {}
    return {"id": provenance.get("name"), "local_sha256": files}


def base_license(model_dir: Path) -> str | None:
    """The license in a downloaded model's card metadata, if it has one."""
    readme = model_dir / "README.md"
    if not readme.is_file():
        return None
    from huggingface_hub import ModelCard

    try:
        return ModelCard.load(readme).data.license
    except Exception:  # a README without (valid) metadata
        return None


def eval_results(metrics: dict[str, Any], dataset: str, generates: bool = True):
    """The evaluation figures as huggingface_hub EvalResults (the card's model-index): the
    figures it measured, headline first (snaketune.evaluation.figures), then lm-eval's;
    ``generates``: the run's method's model generates text (else it scores: a reward
    model)."""
    from huggingface_hub import EvalResult

    from snaketune.evaluation.figures import described

    kind = "text-generation" if generates else "text-classification"

    def result(metric: str, value: float, name: str, task: str = dataset) -> EvalResult:
        return EvalResult(
            task_type=kind,
            dataset_type=task,
            dataset_name=task,
            metric_type=metric,
            metric_value=float(value),
            metric_name=name,
        )

    out = [
        result(key, f["value"], described(key).label)
        for key, f in (metrics.get("figures") or {}).items()
    ]
    for task, figures in (metrics.get("lm_eval") or {}).items():
        for key, figure in figures.items():
            if figure.get("value") is not None:
                out.append(result(key.replace(",", "_"), figure["value"], f"lm-eval {key}", task))
    return out


def exported_lines(exported: dict[str, Any] | None) -> list[str]:
    """The card's word on which training step the weights are (export.checkpoint: best)."""
    if not exported or exported.get("checkpoint") != "best":
        return []
    lines = [
        "## Checkpoint",
        "",
        f"The weights of step {exported['step']} of {exported['last_step']}: the "
        f"{exported['reason']}, {exported['value']:.4g}, of the checkpoints evaluated "
        "on the held-out set while training.",
        "",
    ]
    if exported.get("worse_than_start"):
        lines[-1:] = [
            f"**Worse than before training:** the held-out {exported['metric']} of "
            f"the model before training was {exported['start_value']:.4g}; no "
            "evaluated checkpoint reached it.",
            "",
        ]
    return lines


def loading_lines(repo_id: str, base_id: str | None) -> list[str]:
    """The card's section on loading an adapter (a run with export.merged: false)."""
    base = base_id or "<the base model>"
    return [
        "## How to load",
        "",
        "This repository holds a LoRA adapter, not a whole model: load its base, then the "
        "adapter on it (peft).",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'base = AutoModelForCausalLM.from_pretrained("{base}", dtype="auto")',
        f'model = PeftModel.from_pretrained(base, "{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        "# model.merge_and_unload() folds the adapter into the base weights",
        "```",
        "",
    ]


def scoring_lines(repo_id: str) -> list[str]:
    """The card's section on scoring with a reward model (method reward)."""
    return [
        "## How to score",
        "",
        "A reward model: one score per conversation, read at its last token (higher: "
        "preferred). Render the prompt and response with the tokenizer's chat template, as "
        "training did.",
        "",
        "```python",
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer",
        "",
        f'model = AutoModelForSequenceClassification.from_pretrained("{repo_id}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
        'chat = [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]',
        'ids = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)',
        "score = model(**ids).logits[0, 0].item()",
        "```",
        "",
    ]


def card_text(
    run: str,
    spec: dict[str, Any],
    sources: dict[str, Any],
    metrics: dict[str, Any],
    provenance_sha: str,
    license_: str,
    repo_id: str,
) -> str:
    """The model card: metadata (license, base model, datasets, model-index) and a body."""
    from huggingface_hub import ModelCard

    data = card_data(spec, sources, metrics, license_, repo_id)
    method = method_of(spec)
    hyper = {k: spec[k] for k in CARD_KEYS if k in spec}
    if method.block in spec:
        hyper[method.block] = method.card_block(spec[method.block])
    rows = "\n".join(
        f"| {r.dataset_name} | {r.metric_name} | {r.metric_value:.4g} |"
        for r in (data.eval_results or [])
    )
    base, adapter = sources["base"], sources.get("adapter", False)
    continuing = f", continuing run `{spec['init_from']}`" if spec.get("init_from") else ""
    body = [
        f"# {repo_id}",
        "",
        f"Fine-tuned with [snaketune](https://github.com/) (run `{run}`, "
        f"method `{spec['method']}`{continuing}).",
        "",
        "## Base model",
        "",
        pinned(base),
        "",
        "## Training data",
        "",
        *[f"- {pinned(d)}" for d in sources["datasets"]],
        "",
        "## Hyperparameters",
        "",
        "```json",
        json.dumps(hyper, indent=2, sort_keys=True),
        "```",
        "",
        *exported_lines(sources.get("exported")),
        *(loading_lines(repo_id, base.get("id")) if adapter else []),
        *(scoring_lines(repo_id) if method.reward_model else []),
        "## Evaluation",
        "",
        "| dataset | metric | value |",
        "|---|---|---|",
        rows or "| - | - | - |",
        "",
        "## Provenance",
        "",
        f"sha256 of the model's provenance record (provenance.json): `{provenance_sha}`",
        "",
        f"License: {license_}",
        "",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)).content


def card_data(
    spec: dict[str, Any],
    sources: dict[str, Any],
    metrics: dict[str, Any],
    license_: str,
    repo_id: str,
):
    """The card's metadata: license, base model, datasets (those pinned to a Hub commit),
    tags, pipeline and library (a reward model's, an adapter's), the model-index."""
    from huggingface_hub import ModelCardData

    base, datasets = sources["base"], sources["datasets"]
    method = method_of(spec)
    data = ModelCardData(
        license=license_,
        base_model=base.get("id") if base.get("commit") else None,
        datasets=[d["id"] for d in datasets if d.get("commit")] or None,
        tags=["snaketune", spec["method"], "trl"],
        library_name="transformers",
        model_name=repo_id,
        eval_results=eval_results(metrics, spec.get("eval_dataset", "eval"), method.writes_text)
        or None,
    )
    if method.reward_model:
        data.pipeline_tag, data.tags = "text-classification", [*data.tags, "reward-model"]
    if sources.get("adapter", False):  # the adapter alone (export.merged: false)
        data.library_name, data.tags = "peft", [*data.tags, "lora"]
        data.base_model = base.get("id")  # peft loads it on its base
    return data


def pinned(s: dict[str, Any]) -> str:
    """A source as the card names it: its Hub id at its commit, or a local file's digests."""
    if s.get("commit"):
        return f"`{s['id']}` at commit `{s['commit']}`"
    digests = ", ".join(s.get("local_sha256", {}).values())
    return f"`{s.get('id')}` (local file, sha256 {digests})"


def build_folder(
    run: str,
    spec: dict[str, Any],
    model_dir: Path,
    metrics_path: Path | None,
    resources: Path,
    settings: dict[str, Any],
    out: Path,
) -> Path:
    """Write the folder to upload (model, tokenizer, README.md) to ``out``."""
    base = _read_json(resources / "models" / spec["model"] / "provenance.json")
    datasets = []
    for name in spec["dataset_sources"]:
        datasets.append(source_of(_read_json(resources / "datasets" / name / "provenance.json")))
    license_ = settings.get("license") or base_license(resources / "models" / spec["model"])
    if not license_:
        raise UserError(
            f"runs.{run}.publish.license: the base model's card names no license; set "
            "publish.license (e.g. apache-2.0, or the base model's, such as llama3.2)"
        )
    prov = model_dir / "provenance.json"
    if not prov.is_file():
        raise UserError(f"{model_dir}: no provenance.json; rerun the stage that made it")
    provenance_sha = hashlib.sha256(prov.read_bytes()).hexdigest()
    metrics = _read_json(metrics_path) if metrics_path else {}
    out.mkdir(parents=True)
    copied = []
    for pattern in MODEL_FILES:
        for f in sorted(model_dir.glob(pattern)):
            if f.is_file() and not (out / f.name).exists():
                shutil.copy2(f, out / f.name)
                copied.append(f.name)
    if not any(name.endswith(".safetensors") for name in copied):
        raise UserError(f"{model_dir}: no safetensors weights to publish")
    sources = {
        "base": source_of(base),
        "datasets": datasets,
        "adapter": (out / "adapter_config.json").is_file(),
    }
    if sources["adapter"]:  # the base named as the Hub knows it, not a local path
        adapter_config = json.loads((out / "adapter_config.json").read_text())
        adapter_config["base_model_name_or_path"] = sources["base"].get("id")
        (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    train = model_dir.parent / TRAIN.folder / "provenance.json"  # which step was exported, and why
    if train.is_file():
        sources["exported"] = _read_json(train).get("exported")
    (out / "README.md").write_text(
        card_text(run, spec, sources, metrics, provenance_sha, license_, settings["repo_id"])
    )
    log.info("publish %s: %s (%d files)", run, out, len(copied) + 1)
    return out


def upload(folder: Path, repo_id: str, private: bool) -> dict[str, Any]:
    """Create the repo (private unless told) and upload the folder; the token comes from
    HF_TOKEN or the login cache only."""
    from huggingface_hub import HfApi, get_token

    if not get_token():
        raise UserError(
            "publish: no Hugging Face token; export HF_TOKEN or run `hf auth login` where "
            "snakemake runs (never put the token in the config)"
        )
    api = HfApi()
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    info = api.upload_folder(
        folder_path=str(folder),
        repo_id=repo_id,
        repo_type="model",
        commit_message="snaketune: publish",
    )
    return {"url": f"https://huggingface.co/{repo_id}", "commit": getattr(info, "oid", None)}
