"""The family matrix: each family of tests/families.py at tiny size, with its real Hub chat
template, trains LoRA on two-exchange chat rows (system, user, assistant, user, assistant;
reasoning on every other row) on 2 emulated nodes through the whole pipeline (tokenize,
shard, train, merge, evaluate, report); its export loads in plain transformers and generates
on a left-padded batch; a vision-language base exports as the model it was (its class, its
vision tower unchanged); the plan counts each model as transformers builds it.

The CI tier runs two families in one pipeline (a thinking template that is not
prefix-stable on a vision-language model: Qwen3.5; a mixture of experts balanced without
an auxiliary loss: DeepSeek-V3); the extended tier runs them all. Adding a family is one
line of tests/families.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, snakemake
from families import FAMILIES, build, chat_rows

from snaketune.app.fixtures import make_arith

CI = ("qwen3.5", "deepseek-v3")
ARITH = make_arith(192, 16)
CORPUS = [f"{r['question']} {r['answer']}" for r in ARITH["train"]] + [
    "Answer with the sum. Add the two numbers."
]


def matrix(names: tuple[str, ...], out: Path) -> dict:
    """A workdir at ``out`` with the families ``names``, the chat data and a config of one
    LoRA run per family (2 nodes x 1, 8 steps, evaluated on 8 held-out rows)."""
    out.mkdir(parents=True)
    (out / "config").symlink_to(ROOT / "config")
    for split, rows in (("train", ARITH["train"]), ("test", ARITH["test"])):
        (out / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in chat_rows(rows, reasoning=True))
        )
    config = {
        "models": {},
        "runs": {},
        "datasets": {
            split: {"source": "local", "path": f"{split}.jsonl", "format": "messages"}
            for split in ("train", "test")
        },
    }
    for name in names:
        key = name.replace(".", "").replace("-", "_")
        build(name, CORPUS, out / "models" / key)
        config["models"][key] = {"source": "local", "path": f"models/{key}"}
        config["runs"][key] = {
            "model": key,
            "dataset": "train",
            "eval_dataset": "test",
            "method": "lora",
            "nodes": 2,
            "gpus_per_node": 1,
            "max_length": 512,
            "micro_batch_size": 2,
            "learning_rate": 1e-3,
            "max_steps": 8,
            "save_steps": 4,
            "eval": {"limit": 8, "batch_size": 8, "max_new_tokens": 8},
        }
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return config


def selected(session) -> tuple[str, ...]:
    """The families this session's selected tests of this module ask for."""
    names = [
        item.callspec.params["family"]
        for item in session.items
        if "pipeline" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")
    ]
    return tuple(dict.fromkeys(names)) or CI


@pytest.fixture(scope="module")
def pipeline(request, tmp_path_factory) -> tuple[Path, dict]:
    """One pipeline of every family the session's tests ask for."""
    workdir = tmp_path_factory.mktemp("families") / "w"
    config = matrix(selected(request.session), workdir)
    proc = snakemake("--configfile", str(workdir / "config.yaml"), "--directory", str(workdir))
    (workdir / "snakemake.out").write_text(proc.stdout + proc.stderr)
    return workdir, config


def generates(model_dir: Path) -> list[str]:
    """Two prompts of unequal length, left-padded, 4 new tokens each, by plain
    transformers: the model loaded with the class its config names (a vision-language
    model as one)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in ("Tina has 43 clips. She buys 5 more. How many?", "2 + 3 =")
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert batch["attention_mask"][1].sum() < batch["attention_mask"][0].sum()  # padded
    with torch.no_grad():
        out = model.generate(
            **batch, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    assert out.shape[1] > batch["input_ids"].shape[1]
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])


def tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [pytest.param(n, marks=() if n in CI else pytest.mark.extended) for n in FAMILIES],
)
def test_each_family_trains_on_its_own_template_and_exports_a_model_that_generates(
    pipeline, family
):
    import torch
    import transformers
    from oracles import mean_nll, planned_steps

    from snaketune.budget.modelcount import shape_of

    workdir, config = pipeline
    run = family.replace(".", "").replace("-", "_")
    results, base = workdir / "results" / run, workdir / "models" / run
    metrics = json.loads((results / "eval/metrics.json").read_text())
    assert metrics, run  # it reached evaluation
    steps = [
        json.loads(line) for line in (results / "train/metrics.jsonl").read_text().splitlines()
    ]
    # the schema's packing: auto pads a model whose layers carry state across examples
    log = (results / "train/logs/attempt-1.log").read_text()
    padded = "linear_attention" in json.dumps(FAMILIES[family].fields)
    assert log.count(f"runs.{run}.packing: auto") == 1, run
    assert (f"runs.{run}.packing: auto -> padded" in log) == padded, run
    assert [s["step"] for s in steps] == list(range(1, 9))
    logs = (workdir / "logs/tokenize_dataset").glob(f"*__{run}__*.log")
    assert "assistant tokens found by" in "".join(p.read_text() for p in logs)
    exported = results / "merged_model"
    assert len(generates(exported)) == 2
    base_config = json.loads((base / "config.json").read_text())
    got = json.loads((exported / "config.json").read_text())
    assert got["architectures"] == base_config["architectures"]  # the base's own class
    if FAMILIES[family].vlm:  # the vision tower as it was
        before, after = tensors(base), tensors(exported)
        tower = [k for k in before if "visual" in k or "vision" in k]
        assert tower and all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in tower)
        assert "vision_config" in got
        processor = (base / "preprocessor_config.json").read_text()
        assert (exported / "preprocessor_config.json").read_text() == processor
    built = getattr(transformers, base_config["architectures"][0]).from_pretrained(base)
    planned = shape_of(base_config).params
    assert planned == pytest.approx(sum(p.numel() for p in built.parameters()), rel=0.02)
    if FAMILIES[family].fields.get("n_routed_experts") and "router_aux_loss_coef" not in got:
        # balanced without an auxiliary loss: the first step's loss is the NLL alone (the
        # adapters start at zero), each token of both ranks' rows scored by plain transformers
        (first,) = planned_steps(results / "shards", 1)
        nll, _ = mean_nll(built.float().eval(), first[0] + first[1])
        assert steps[0]["loss"] == pytest.approx(nll, rel=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_plan_counts_each_family_as_transformers_builds_it(family, tmp_path):
    """Every family is planned, none refused: its parameters (a vision-language model's
    towers too), the 4-bit base's linear weights, its active parameters and a LoRA run's
    adapters (all-linear, as snaketune.methods.training.peft_config makes them) equal what
    the model transformers builds from its config.json holds."""
    import torch
    import transformers
    from peft import get_peft_model

    from snaketune.budget.modelcount import shape_of
    from snaketune.core.lora_targets import exact_targets
    from snaketune.methods.training import peft_config

    base = build(family, CORPUS[:64], tmp_path / "m")
    config = json.loads((base / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(base)
    shape = shape_of(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    language = model.get_decoder()
    linears = [m for m in language.modules() if isinstance(m, torch.nn.Linear)]
    assert shape.linear_params == sum(m.weight.numel() for m in linears)
    experts = [m for m in language.modules() if type(m).__name__.endswith("Experts")]
    if experts:  # the routed experts a token is not sent to, left out
        text = model.config.get_text_config()
        k, e = text.num_experts_per_tok, shape.experts
        idle = sum(sum(p.numel() for p in m.parameters()) * (e - k) // e for m in experts)
        assert shape.active_params == shape.params - idle
    run = {
        "method": "lora",
        "lora": {
            "r": 4,
            "alpha": 8,
            "dropout": 0.0,
            "target_modules": "all-linear",
            "modules_to_save": [],
            "adapt_router": False,
        },
    }
    with exact_targets():
        adapted = get_peft_model(model, peft_config(run, model))
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert shape.lora_params(4, "all-linear") == trainable
    tower = [n for n, p in adapted.named_parameters() if "lora_" in n and "visual" in n]
    assert not tower  # a vision-language model's vision tower is not adapted


def test_packing_a_model_no_attention_can_pack_is_refused_before_anything_runs(tmp_path):
    """Qwen3.5's linear-attention layers carry state across packed examples: at the
    schema's default (packing: auto) its run is planned (the train job pads it and says so,
    test_each_family_trains_...); a run that asks for packing (``true``) is refused by the
    dry run's check, before tokenize, with the key and the fix."""
    build("qwen3.5", ["What is 1 plus 2? 3"] * 8, tmp_path / "models/q")
    (tmp_path / "data").mkdir()
    row = {"messages": [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]}
    (tmp_path / "data/train.jsonl").write_text(json.dumps(row) + "\n")
    run = {"model": "q", "dataset": "d", "method": "lora", "nodes": 1, "gpus_per_node": 1,
           "max_length": 256, "micro_batch_size": 1, "max_steps": 1, "learning_rate": 1e-4,
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}  # fmt: skip
    config = {
        "models": {"q": {"source": "local", "path": "models/q"}},
        "datasets": {"d": {"source": "local", "path": "data/train.jsonl", "format": "messages"}},
        "runs": {"sft": run},
    }

    def dry_run():
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        return snakemake("-n", "--configfile", str(tmp_path / "config.yaml"), "--directory",
                         str(tmp_path), check=False)  # fmt: skip

    proc = dry_run()
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]  # the defaults: planned
    config["runs"]["sft"]["packing"] = True
    proc = dry_run()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("error: runs.sft.packing: model q cannot train on packed sequences "
            "(Qwen3_5ForCausalLM has linear_attention layers") in out, out[-3000:]  # fmt: skip
    assert "set packing: auto" in out and not (tmp_path / "results").exists()
