"""A config example in miniature: ``config/examples/<name>.yaml`` as written, with only the
sizes changed, so that its whole pipeline runs on a CPU machine in minutes
(tests/test_examples.py).

What changes:

- each model: a tiny random model of the example model's own architecture (its model_type
  and its family's options from the published config.json: a mixture of experts' routing,
  tied embeddings, grouped-query attention, RoPE scaling), 2 layers and 64 wide, with heads
  that the run's ``sequence_parallel`` divides, on the demo's tokenizer; ``chat_template``
  and every other key kept; a vision-language model trained on text (its published config
  in conftest.VLM_SHAPES): its family of tests/families.py, whole, with the family's Hub
  template (which renders tools and calls, where the example's data has them);
- each Hub dataset: a local file of the same format and columns (the demo's arithmetic
  questions and "#### N" answers as prompt/response, messages or alpaca rows, or as
  documents, every third longer than the miniature's max_length), with rows
  that each ``filters`` entry keeps and rows it drops; mixtures and the example's own local
  files (config/examples/..., such as its tool-call transcripts) kept as written; a
  vision-language example (a dataset with ``columns.images``): the tiny Gemma 3 and the
  picture questions of tests/pictures.py;
- each run: 2 emulated ranks (one per node), or one node of ``sequence_parallel`` ranks;
  4 steps of micro batches of at most 4 (GRPO: one question of at most 4 generations),
  accumulation at most 2, 128 tokens, a checkpoint every 2 steps, evaluation of 8 examples
  of at most 16 new tokens; a GRPO run whose rewards a random model cannot earn (an answer's
  correctness and format) gets one more that varies (``varied``), so it has a signal; an
  example whose GRPO calls tools: 1,024 tokens (the template's tools block is in every row).

Everything else as written: the method, LoRA with its dropout, the 4-bit base, the DeepSpeed
preset, sequence parallelism, packing, precision, gradient checkpointing, sweeps, chains
(init_from), GRPO's settings, export and publish settings. A new example is covered by
adding its file (and its model's published config.json fields to conftest.SHAPES, which
the plan's tests read too); a format or filter this module cannot fill fails naming it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml
from conftest import REQUIRED, SHAPES, VLM_SHAPES

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip
# The tiny model's sizes (the family's options come from the published config).
WIDTH = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}
MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
       "n_routed_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
ROWS = {"train": 96, "test": 16}
BLOCK_REQUIRED = {"teacher": "tiny"}  # the keys a method's block requires, in defaults_config
STEPS = 4


def tiny_model(published: dict[str, Any], tokenizer: Path, out: Path, heads: int) -> Path:
    """A random model of ``published``'s architecture (its config.json) at the sizes above,
    ``heads`` attention heads in the published ratio to its KV heads, saved at ``out`` with
    the tokenizer files of ``tokenizer``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in published.items() if k not in ("dtype", "torch_dtype")}
    ratio = published["num_attention_heads"] // published.get(
        "num_key_value_heads", published["num_attention_heads"])  # fmt: skip
    fields.update(WIDTH, num_attention_heads=heads, num_key_value_heads=max(1, heads // ratio),
                  vocab_size=len(json.loads((tokenizer / "tokenizer.json").read_text())
                                 ["model"]["vocab"]) + 3)  # fmt: skip
    fields.update({k: v for k, v in MOE.items() if k in published})
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, out / name)
    return out


def rows_of(spec: dict[str, Any], source: list[dict], split: str) -> list[dict]:
    """``source``'s question/answer rows in the format and columns of dataset ``spec``, two
    in three kept by each of its filters (the third given another value)."""
    columns = spec.get("columns", {})
    fmt = spec["format"]
    out = []
    for i, row in enumerate(source[: ROWS[split]]):
        q, a = row["question"], row["answer"]
        if fmt == "prompt_response":
            prompt = columns.get("prompt", "prompt")
            new = {prompt if isinstance(prompt, str) else prompt[0]: q,
                   columns.get("response", "response"): a}  # fmt: skip
        elif fmt == "messages":
            new = {columns.get("messages", "messages"): [
                {"role": "user", "content": q}, {"role": "assistant", "content": a}]}  # fmt: skip
        elif fmt == "alpaca":
            new = {columns.get("instruction", "instruction"): q,
                   columns.get("input", "input"): "" if i % 2 else "Answer with a number.",
                   columns.get("output", "output"): a}  # fmt: skip
        elif fmt == "text":  # documents, every third past the miniature's 128 tokens
            new = {columns.get("text", "text"): " ".join([f"{q} {a}"] * (12 if i % 3 else 1))}
        else:
            raise AssertionError(f"tests/miniature.py makes no rows of format {fmt!r} yet")
        for f in spec.get("filters", []):
            if f["op"] not in ("==", "in"):
                raise AssertionError(f"tests/miniature.py fills no filter op {f['op']!r} yet")
            kept = f["value"] if f["op"] == "==" else f["value"][0]
            new[f["column"]] = kept if i % 3 else f"not-{kept}"
        out.append(new)
    return out


VARIED = '''
def varied(prompts, completions, **kwargs):
    """Varies with what a random model writes: the share of digits in a completion (the
    assistant's texts of a trajectory, its reasoning too, where the run calls tools)."""
    texts = [c if isinstance(c, str) else " ".join(
        (m.get("reasoning_content") or "") + (m.get("content") or "")
        for m in c if m["role"] == "assistant") for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(1, len(text)) for text in texts]
'''
HARD_REWARDS = {"correctness", "format"}


def shrink(run: dict[str, Any], tools: bool = False) -> None:
    """A run's sizes for this machine (the module docstring); every other key as written.
    ``tools``: the example's GRPO calls tools."""
    sp = run.get("sequence_parallel", 1)
    run["nodes"], run["gpus_per_node"] = (1, sp) if sp > 1 else (2, 1)
    run.pop("epochs", None)
    run.update(max_steps=STEPS, save_steps=2, max_length=1024 if tools else 128,
               gradient_accumulation_steps=min(run.get("gradient_accumulation_steps", 1), 2))  # fmt: skip
    if run["method"] == "grpo":
        grpo = run.setdefault("grpo", {})
        grpo["num_generations"] = min(grpo.get("num_generations", 8), 4)
        grpo["max_completion_length"] = 16
        run["micro_batch_size"] = grpo["num_generations"]
        rewards = grpo.get("rewards", {"correctness": 1.0, "format": 0.2})  # the defaults
        if set(rewards) <= HARD_REWARDS:
            grpo["rewards"] = {**rewards, "rewards_mini.py:varied": 0.5}
    else:
        run["micro_batch_size"] = min(run["micro_batch_size"], 4)
    if run["method"] == "opd":  # on-policy distillation's samples: as short as the eval's
        run["opd"]["max_completion_length"] = 16
    run["eval"] = {**run.get("eval", {}), "limit": 8, "batch_size": 8,
                   "max_new_tokens": min(run.get("eval", {}).get("max_new_tokens", 16), 16)}  # fmt: skip


def miniature(example: Path, demo: Path | None, out: Path) -> Path:
    """``example`` in miniature in directory ``out`` (models, data, config.yaml, the
    repository's config/ linked as where users run snakemake); returns the config's path.
    ``demo``: the finished demo (its tokenizer and arithmetic rows; a vision-language
    example needs none)."""
    config = yaml.safe_load(example.read_text())
    out.mkdir(parents=True)
    (out / "config").symlink_to(ROOT / "config")
    (out / "rewards_mini.py").write_text(VARIED)
    sp = max((r.get("sequence_parallel", 1) for r in config["runs"].values()), default=1)
    if any("images" in (d.get("columns") or {}) for d in config["datasets"].values()):
        return pictures_miniature(config, out)
    fixtures = demo / "resources/fixtures"
    source = {split: [json.loads(line) for line in
                      (fixtures / f"arith-demo/{split}.jsonl").read_text().splitlines()]
              for split in ROWS}  # fmt: skip
    for name, spec in config["models"].items():
        if spec.get("id") in VLM_SHAPES:  # a vision-language model, trained on text
            family_model(VLM_SHAPES[spec["id"]], config, source, out / "models" / name)
            config["models"][name] = local_model(spec, name)
            continue
        assert spec.get("id") in SHAPES, (
            f"{example.name}: model {name} ({spec.get('id')}): add its published config.json "
            "fields to tests/conftest.py's SHAPES (the plan tests read them too)")  # fmt: skip
        tiny_model(
            SHAPES[spec["id"]], fixtures / "tiny-llama", out / "models" / name, heads=max(4, 2 * sp)
        )
        config["models"][name] = local_model(spec, name)
    for name, spec in config["datasets"].items():
        if spec["source"] != "hub":
            continue
        split = "test" if "test" in spec.get("split", "") else "train"
        path = out / "data" / f"{name}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows_of(spec, source[split], split)))
        config["datasets"][name] = local(spec, f"data/{name}.jsonl")
    return shrunk(config, out)


def family_model(
    published: dict[str, Any], config: dict[str, Any], source: dict[str, list], out: Path
) -> Path:
    """The tiny model of ``published``'s family (tests/families.py, by its model_type), its
    tokenizer's corpus the arithmetic rows and the example's own local files."""
    from families import FAMILIES, build

    (family,) = [n for n, f in FAMILIES.items() if f.model_type == published["model_type"]]
    corpus = [f"{r['question']} {r['answer']}" for r in source["train"]]
    for spec in config["datasets"].values():
        if spec["source"] == "local":  # the example's own file (its path from the repository)
            corpus += (ROOT / spec["path"]).read_text().splitlines()[: ROWS["train"]]
    return build(family, corpus, out)


def local_model(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """A Hub model's entry as the local folder models/``name``, its other keys as written."""
    hub = ("source", "id", "revision")
    return {"source": "local", "path": f"models/{name}", **{k: v for k, v in spec.items()
                                                             if k not in hub}}  # fmt: skip


def local(spec: dict[str, Any], path: str) -> dict[str, Any]:
    """A Hub dataset's entry as a local file's at ``path``, its other keys as written."""
    hub = ("source", "id", "files", "subset", "split", "revision")
    return {"source": "local", "path": path, **{k: v for k, v in spec.items() if k not in hub}}


def shrunk(config: dict[str, Any], out: Path) -> Path:
    """``config`` with its runs shrunk, written as out/config.yaml; its path."""
    tools = any(r.get("grpo", {}).get("tools") or r.get("grpo", {}).get("environment")
                for r in config["runs"].values())  # fmt: skip
    for run in config["runs"].values():
        shrink(run, tools)
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def pictures_miniature(config: dict[str, Any], out: Path) -> Path:
    """A vision-language example in miniature: each model the tiny Gemma 3 of
    tests/pictures.py (its own processor and Hub template), each Hub picture dataset the
    colour questions there, under the example's column names; the runs shrunk."""
    from pictures import build_vlm, make_picture_data

    for name, spec in config["models"].items():
        build_vlm(out / "models" / name)
        config["models"][name] = local_model(spec, name)
    for name, spec in config["datasets"].items():
        if spec["source"] != "hub":
            continue
        split = "test" if "test" in spec.get("split", "") else "train"
        cols = spec.get("columns") or {}
        make_picture_data(out / "data" / name, columns=(cols.get("messages", "messages"),
                                                        cols["images"]))  # fmt: skip
        config["datasets"][name] = local(spec, f"data/{name}/{split}.jsonl")
    return shrunk(config, out)


def defaults_config(demo: Path, out: Path) -> Path:
    """A user's first config for every training method (snaketune.methods.REGISTRY): one run
    each on the demo's tiny model and data of the method's kind, only the keys the schema
    requires written (and 4 steps); every other key is the schema's default. Written in
    ``out`` (linked as a run directory); returns its path."""
    from snaketune.methods import REGISTRY, method_named

    fixtures = demo / "resources/fixtures"
    out.mkdir(parents=True)
    (out / "config").symlink_to(ROOT / "config")
    data = {"rows": ("arith", "arith_test"), "prompts": ("arith", "arith_test"),
            "pairs": ("arith_pairs", "arith_pairs_test"),
            "labelled": ("arith_pairs", "arith_pairs_test")}  # fmt: skip
    config = {
        "models": {"tiny": {"source": "local", "path": str(fixtures / "tiny-llama")}},
        "datasets": {
            "arith": {"source": "local", "path": str(fixtures / "arith-demo/train.jsonl"),
                      "format": "prompt_response",
                      "columns": {"prompt": "question", "response": "answer"}},
            "arith_test": {"source": "local", "path": str(fixtures / "arith-demo/test.jsonl"),
                           "format": "prompt_response",
                           "columns": {"prompt": "question", "response": "answer"}},
            "arith_pairs": {"source": "local", "format": "preference",
                            "path": str(fixtures / "arith-demo/pairs-train.jsonl"),
                            "columns": {"prompt": "question"}},
            "arith_pairs_test": {"source": "local", "format": "preference",
                                 "path": str(fixtures / "arith-demo/pairs-test.jsonl"),
                                 "columns": {"prompt": "question"}},
        },
        "runs": {},
    }  # fmt: skip
    for name in REGISTRY:
        method = method_named(name)
        train, test = data[method.trains_on]
        config["runs"][f"{name}_defaults"] = {
            "model": "tiny", "dataset": train, "eval_dataset": test, "method": name,
            **REQUIRED, "micro_batch_size": 8, "learning_rate": 1e-4, "max_steps": STEPS,
        }  # fmt: skip
        required = yaml.safe_load(method.schema).get("required", []) if method.schema else []
        if required:  # a block's required keys (distill's teacher: the tiny model itself)
            config["runs"][f"{name}_defaults"][method.block] = {
                key: BLOCK_REQUIRED[key] for key in required
            }
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
