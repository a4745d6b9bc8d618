"""Config validation: every shipped config passes; typos fail with the key path."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT

from snaketune.core.errors import ConfigError
from snaketune.plan.config import load_yaml, validate_config
from snaketune.plan.runspec import RunSpec
from snaketune.plan.stages import run_tokenize_spec, tokenize_key

SHIPPED = [ROOT / "config" / "config.yaml", *sorted((ROOT / "config" / "examples").glob("*.yaml"))]


@pytest.fixture()
def demo() -> dict:
    return load_yaml(ROOT / "config" / "config.yaml")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # chat_template paths are relative to the working directory


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_validate(path: Path):
    config = validate_config(load_yaml(path), ROOT)
    assert config["runs"]


def test_examples_cover_the_scenarios():
    runs = {}
    for path in SHIPPED[1:]:
        runs.update(load_yaml(path)["runs"])
    shapes = {(r["method"], r["nodes"], r["gpus_per_node"], r["deepspeed"]) for r in runs.values()}
    assert ("lora", 2, 4, "zero2") in shapes
    assert ("full", 2, 8, "zero2") in shapes
    assert ("full", 4, 4, "zero3_offload") in shapes


def test_defaults_are_filled(demo):
    del demo["runs"]["demo"]["lora"]
    run = validate_config(demo, ROOT)["runs"]["demo"]
    assert run["lora"] == {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear",
                           "modules_to_save": [], "adapt_router": False, "adapt_vision": False,
                           "quantize": "none",
                           "quant_type": "nf4",
                           "double_quant": True, "compute_dtype": "auto"}  # fmt: skip
    assert run["lr_scheduler"] == "cosine" and run["timeout_minutes"] == 10


def test_a_config_without_packing_keys_trains_packed_with_automatic_kernels(demo):
    for key in ("packing", "attn_implementation", "liger_kernel"):
        demo["runs"]["demo"].pop(key, None)
    run = validate_config(demo, ROOT)["runs"]["demo"]
    assert (run["packing"], run["attn_implementation"], run["liger_kernel"]) == (
        "auto",
        "auto",
        "auto",
    )
    assert RunSpec.of(run).balances_tokens  # auto plans its steps balanced, as packing does


def test_numbers_from_the_command_line_are_read(demo):
    demo["runs"]["demo"].update(nodes="4", learning_rate="1e-4", gradient_checkpointing="true")
    run = validate_config(demo, ROOT)["runs"]["demo"]
    assert (run["nodes"], run["learning_rate"], run["gradient_checkpointing"]) == (4, 1e-4, True)


def _set(path: str | tuple, value) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        *parents, last = path if isinstance(path, tuple) else path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


def _rename(path: str, new: str) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        *parents, last = path if isinstance(path, tuple) else path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[new] = node.pop(last)

    return edit


def _delete(path: str) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        *parents, last = path if isinstance(path, tuple) else path.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        del node[last]

    return edit


BAD = [
    (
        _set("runs.demo.method", "lorra"),
        "runs.demo.method: 'lorra' is not one of ['lora', 'full', 'grpo', 'dpo', 'reward', 'simpo', 'orpo', 'kto', 'rloo', 'distill', 'opd']",
    ),
    (
        _rename("runs.demo.learning_rate", "lerning_rate"),
        "runs.demo.lerning_rate: unknown key; did you mean 'learning_rate'?",
    ),
    (_delete("runs.demo.learning_rate"), "runs.demo: missing required key 'learning_rate'"),
    (
        _set("runs.demo.lerning_rate", 1.0),
        "runs.demo.lerning_rate: unknown key; did you mean 'learning_rate'?",
    ),
    (
        _set("datasets.gsm8k_demo.colums", {}),
        "datasets.gsm8k_demo.colums: unknown key; did you mean 'columns'?",
    ),
    (_set("topology", {}), "topology: unknown key"),
    (_delete("runs.demo.model"), "runs.demo: missing required key 'model'"),
    (_set("runs.demo.nodes", 0), "runs.demo.nodes: 0 is less than the minimum of 1"),
    (_set("runs.demo.nodes", "two"), "runs.demo.nodes: 'two' is not of type 'integer'"),
    (
        _set("runs.demo.learning_rate", 0),
        "runs.demo.learning_rate: 0 is less than or equal to the minimum of 0",
    ),
    (_set("runs.demo.lora.r", 0), "runs.demo.lora.r: 0 is less than the minimum of 1"),
    (
        _set("runs.demo.overlong", "wrap"),
        "runs.demo.overlong: 'wrap' is not one of ['drop', 'truncate', 'error']",
    ),
    (_set("runs.demo.model", "gpt5"), "runs.demo.model: unknown model 'gpt5' (defined: tiny)"),
    (_set("runs.demo.dataset", "nope"), "runs.demo.dataset: unknown dataset 'nope'"),
    (
        _set("runs.demo.eval_dataset", "arith"),
        "runs.demo.eval_dataset: must differ from the training dataset",
    ),
    (_set("runs.demo.max_steps", 10), "runs.demo: give exactly one of `epochs` and `max_steps`"),
    (_delete("runs.demo.epochs"), "runs.demo: give exactly one of `epochs` and `max_steps`"),
    (
        _set("runs.demo.deepspeed", "zero4"),
        "runs.demo.deepspeed: 'zero4' is not valid here (DeepSpeed preset name (zero1, zero2, zero3, zero3_offload, from config/deepspeed/) or a path to a DeepSpeed JSON file; batch sizes and precision set to `auto` are filled from this run.)",
    ),
    (_set(("runs", "../x"), {}), "runs: name '../x' is not a safe identifier"),
    (_set("runs.my run", {}), "runs: name 'my run' is not a safe identifier"),
    (
        _set("models.a;b", {"source": "hub", "id": "x/y"}),
        "models: name 'a;b' is not a safe identifier",
    ),
    (_set("models.tiny.source", "s3"), "models.tiny.source: 's3' is not one of ['hub', 'local']"),
    (_delete("models.tiny.path"), "models.tiny: source local needs a `path`"),
    (_set("models.tiny.revision", "v1"), "models.tiny.revision: only for source hub"),
    (
        _set("datasets.gsm8k_demo.files", ["*.parquet"]),
        "datasets.gsm8k_demo.files: only for source hub",
    ),
    (
        _set(
            "datasets.web",
            {
                "source": "hub",
                "id": "org/web",
                "format": "text",
                "files": ["a/*.parquet"],
                "split": "train",
            },
        ),
        "datasets.web.split: not used with `files` (the files chosen are the rows); remove one",
    ),
    (
        _set("datasets.web", {"source": "hub", "id": "org/web", "format": "text", "files": []}),
        "datasets.web.files: [] should be non-empty",
    ),
    (
        _set("models.tiny.chat_template", "missing.jinja"),
        "models.tiny.chat_template: file 'missing.jinja' not found",
    ),
    (
        _set("datasets.gsm8k_demo.format", "sharegpt"),
        "datasets.gsm8k_demo.format: 'sharegpt' is not one of ['prompt_response', 'alpaca', 'messages', 'preference', 'labelled', 'text']",
    ),
    (_delete("datasets.gsm8k_demo.format"), "datasets.gsm8k_demo: missing required key 'format'"),
    (
        _set("datasets.gsm8k_demo.columns", {"instruction": "q"}),
        "datasets.gsm8k_demo.columns.instruction: not a field of format 'prompt_response'",
    ),
    (
        _set("datasets.gsm8k_demo.filters", [{"column": "x", "op": "~", "value": 1}]),
        "datasets.gsm8k_demo.filters.0.op: '~' is not one of",
    ),
    (
        _set("datasets.gsm8k_demo.filters", [{"column": "x", "op": "in", "value": 1}]),
        "datasets.gsm8k_demo.filters.0.value: op 'in' needs a list",
    ),
    (
        _set("datasets.mix", {"source": "mixture", "mixture": [{"dataset": "nope"}]}),
        "datasets.mix.mixture.0.dataset: unknown dataset 'nope'",
    ),
    (
        _set(
            "datasets.mix",
            {"source": "mixture", "mixture": [{"dataset": "gsm8k_demo", "weight": 0}]},
        ),
        "datasets.mix.mixture.0.weight: 0 is less than or equal to the minimum of 0",
    ),
    (_set("runs.demo.method", "full"), "runs.demo.lora: only for method lora"),
    (
        _set("datasets.gsm8k_demo.format", "text"),
        "datasets.gsm8k_demo.columns.prompt: not a field of format 'text' (fields: text)",
    ),
    (
        _set(
            "datasets.doc", {"source": "local", "path": "d", "format": "text", "system_prompt": ""}
        ),
        "datasets.doc.system_prompt: not used by format text",
    ),
    (_set("runs.demo.packing", "yes"), "runs.demo.packing: 'yes' is not valid"),
]


@pytest.mark.parametrize(("edit", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_config_names_the_key(demo, edit, message):
    bad = copy.deepcopy(demo)
    edit(bad)
    with pytest.raises(ConfigError) as info:
        validate_config(bad, ROOT)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_unknown_key_lists_allowed_keys(demo):
    demo["runs"]["demo"]["lerning_rate"] = 1.0
    with pytest.raises(ConfigError, match=r"allowed: .*learning_rate.*warmup_ratio"):
        validate_config(demo, ROOT)


def _walk(schema: dict, path: str = "") -> list[str]:
    """Key paths of schema entries that lack a description."""
    missing = []
    for name, sub in schema.get("properties", {}).items():
        if "description" not in sub:
            missing.append(f"{path}.{name}")
        missing += _walk(sub, f"{path}.{name}")
    for key in ("additionalProperties", "items"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            if "description" not in sub and "$ref" not in sub and key == "additionalProperties":
                missing.append(f"{path}.*")
            missing += _walk(sub, f"{path}.*")
    for name, sub in schema.get("$defs", {}).items():
        if "description" not in sub:
            missing.append(f"$defs.{name}")
        missing += _walk(sub, f"$defs.{name}")
    return missing


def test_every_schema_key_is_described():
    """The schema as config validation reads it: the file with each method's block put in."""
    from snaketune.methods import compose_schema, methods

    schema = compose_schema(load_yaml(ROOT / "workflow" / "schemas" / "config.schema.yaml"))
    assert _walk(schema) == []
    assert schema["additionalProperties"] is False
    run = schema["properties"]["runs"]["additionalProperties"]["properties"]
    assert run["method"]["enum"] == list(methods())
    for name, method in methods().items():
        assert f"`{name}`: {method.summary}" in run["method"]["description"]
        if method.block:  # its own block, closed, every key with its default or optional
            assert run[method.block]["additionalProperties"] is False, name


def test_no_method_block_is_written_in_the_schema_file():
    """A method's block lives in its module only (one place to change it)."""
    from snaketune.methods import methods

    raw = load_yaml(ROOT / "workflow" / "schemas" / "config.schema.yaml")
    run = raw["properties"]["runs"]["additionalProperties"]["properties"]
    blocks = {m.block for m in methods().values() if m.block}
    assert blocks and not blocks & set(run), blocks & set(run)
    assert "enum" not in run["method"]


def test_tokenize_key_shared_by_runs_that_differ_in_training_keys_only(demo):
    demo["runs"]["other"] = {
        **copy.deepcopy(demo["runs"]["demo"]),
        "learning_rate": 1e-4,
        "nodes": 4,
    }
    config = validate_config(demo, ROOT)
    key = tokenize_key(run_tokenize_spec(config, "demo"))
    assert tokenize_key(run_tokenize_spec(config, "other")) == key
    for edit in (
        _set("runs.other.max_length", 128),
        _set("runs.other.overlong", "truncate"),
        _set("datasets.arith.columns.prompt", ["question"]),
        _set("models.tiny.chat_template", "config/templates/llama3.jinja"),
    ):
        changed = copy.deepcopy(config)
        edit(changed)
        assert tokenize_key(run_tokenize_spec(changed, "other")) != key


def test_snaketune_validate_command(capsys):
    from snaketune.app.cli import main

    assert main(["validate", str(ROOT / "config/config.yaml"), "--root", str(ROOT)]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert out.out.endswith("}\n")  # the JSON apart: nothing runs into its closing brace
    assert plan["runs"] == ["demo"] and len(plan["tokenized"]) == 2  # train and eval sets
    # and one line saying what was checked and that it passed
    (line,) = out.err.strip().splitlines()
    assert line.startswith(f"validate: {ROOT / 'config/config.yaml'} passed: the schema and "
                           "the cross-key checks of 1 run(s)") and "dry run" in line  # fmt: skip
    bad = ROOT / "config/examples/../config.yaml"
    assert main(["validate", str(bad).replace("config.yaml", "missing.yaml")]) == 2
    assert "missing.yaml: file not found" in capsys.readouterr().err


def _bad_config(tmp_path: Path) -> Path:
    """The demo with eight independent problems, of each kind the parse-time check finds: a
    number in quotes (the file read again), an unknown key, a misspelt DeepSpeed preset
    (the schema), an unknown dataset in the run with the unknown key and a run starting
    from a run that is not there (the cross-references), two missing local paths, a dataset
    without the columns its format reads (its first rows): all named in one pass."""
    import yaml

    cfg = load_yaml(ROOT / "config/config.yaml")
    cfg["models"]["tiny"]["path"] = "nowhere/tiny-llama"
    cfg["datasets"]["arith_test"]["path"] = "nowhere/test.jsonl"
    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))  # fmt: skip
    cfg["datasets"]["mine"] = {"source": "local", "path": str(rows), "format": "prompt_response"}
    cfg["runs"]["mine"] = {**cfg["runs"]["demo"], "dataset": "mine", "lerning_rate": 1e-4,
                           "eval_dataset": "arith_tset"}  # fmt: skip
    later = {k: v for k, v in cfg["runs"]["demo"].items() if k != "model"}
    cfg["runs"]["later"] = {**later, "deepspeed": "zero2", "init_from": "nobody"}
    cfg["runs"]["demo"]["deepspeed"] = "zero_2"
    cfg["runs"]["demo"]["epochs"] = "6"  # written '6': text (PyYAML's 1e-4 is text too)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


EXPECTED_PROBLEMS = [
    "runs.demo.epochs: '6' is in quotes, so text, not a number; write it without them (epochs: 6)",
    "runs.mine.lerning_rate: unknown key; did you mean 'learning_rate'?",
    "runs.demo.deepspeed: 'zero_2' is not valid here (DeepSpeed preset name (zero1, zero2, ",
    "runs.mine.eval_dataset: unknown dataset 'arith_tset' (defined: arith, arith_test, "
    "gsm8k_demo, gsm8k_demo_test, mine)",
    "runs.later.init_from: unknown run or sweep 'nobody' (defined: demo, later, mine)",
    "models.tiny.path: nowhere/tiny-llama does not exist",
    "datasets.arith_test.path: nowhere/test.jsonl does not exist",
    "datasets.mine: columns 'prompt', 'response' not found (columns: question, answer)",
]


def test_validate_lists_every_problem_from_any_directory(tmp_path, monkeypatch, capsys):
    from snaketune.app.cli import main

    path = _bad_config(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # outside the repository: no --root needed
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len(EXPECTED_PROBLEMS), lines
    for line, expected in zip(lines, EXPECTED_PROBLEMS, strict=True):
        assert line.startswith(f"error: {expected}"), lines


def test_the_workflow_and_validate_say_the_same(tmp_path):
    """One checker: the workflow's parse-time lines are validate's, one per problem."""
    from conftest import snakemake

    path = _bad_config(tmp_path)
    proc = snakemake("-n", "--configfile", str(path), "--directory", str(tmp_path), check=False)
    assert proc.returncode != 0
    lines = [ln.split(": ", 1)[1] for ln in proc.stderr.splitlines()
             if ln.startswith(("config error: ", "error: "))]  # fmt: skip
    assert len(lines) == len(EXPECTED_PROBLEMS), proc.stderr
    for line, expected in zip(lines, EXPECTED_PROBLEMS, strict=True):
        assert line.startswith(expected), proc.stderr


def test_a_quoted_number_where_text_is_meant_reads_and_writes_as_text(tmp_path):
    """A number in quotes is text: refused where the schema takes a number (epochs), kept
    where it takes text (a Hub revision "2024"), and written back by a YAML dump as the
    quoted text it was (snaketune calibrate writes the user's config again)."""
    import yaml

    from snaketune.plan.schema import Quoted

    path = tmp_path / "c.yaml"
    path.write_text('models: {m: {source: hub, id: a/b, revision: "2024"}}\nx: 1e-4\n')
    loaded = load_yaml(path)
    revision = loaded["models"]["m"]["revision"]
    assert isinstance(revision, Quoted) and revision == "2024"
    assert not isinstance(loaded["x"], Quoted)  # PyYAML's 1e-4: text, not quoted
    again = yaml.safe_load(yaml.safe_dump(loaded))
    assert again["models"]["m"]["revision"] == "2024"  # still text, not the number 2024


def test_the_workflow_names_a_quoted_number_in_a_methods_block(tmp_path):
    """The workflow's check reads the config files again against the schema validate reads,
    each method's block put in: a DPO run's `beta: "0.1"` (which Snakemake's loader makes
    plain text, read as 0.1) is named as validate names it."""
    import yaml

    from snaketune.budget.checks import at_parse
    from snaketune.core.errors import UserError, error_lines

    cfg = load_yaml(ROOT / "config/config.yaml")
    cfg["runs"]["demo"].update(method="dpo", dpo={"beta": "0.1"})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert "beta: '0.1'" in path.read_text()
    with pytest.raises(UserError) as caught:
        at_parse(yaml.safe_load(path.read_text()), ROOT, [str(path)], tmp_path)
    assert error_lines(caught.value)[0] == (
        "runs.demo.dpo.beta: '0.1' is in quotes, so text, not a number; write it without "
        "them (beta: 0.1)"
    )


def test_validate_without_the_schema_names_root(tmp_path, capsys):
    from snaketune.app.cli import main

    assert main(["validate", str(ROOT / "config/config.yaml"), "--root", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "workflow/schemas/config.schema.yaml: file not found" in line and "--root" in line


def test_a_fixture_path_needs_no_file_and_the_rule_makes_exactly_those():
    """Local paths the rule make_fixtures makes need not exist when the config is read; the
    library's list is the rule's outputs."""
    import re

    from snaketune.budget.checks import FIXTURE_OUTPUTS

    rule = (ROOT / "workflow/rules/fixtures.smk").read_text()
    outputs = "".join(part.split("log:")[0] for part in rule.split("output:")[1:])
    assert sorted(re.findall(r'"(resources/[^"]+)"', outputs)) == sorted(FIXTURE_OUTPUTS)


def test_the_command_help_speaks_to_users():
    """`snaketune --help` opens with what the command is for (not a module's internals),
    and `plan --help` lists the GPU table it refers to."""
    import subprocess
    import sys

    from snaketune.budget.memplan import GPUS

    def helptext(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "snaketune.app.cli", *args, "--help"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return " ".join(proc.stdout.split())

    top = helptext()
    assert "Check, plan and trace snaketune fine-tuning runs" in top
    assert "plumbing" not in top and "snaketune validate my.yaml" in top
    plan = helptext("plan")
    assert all(f"{name} ({gib:g} GiB usable)" in plan for name, gib in GPUS.items()), plan
