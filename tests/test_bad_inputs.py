"""The bad-input catalogue, through the real pipeline (snakemake, local profile).

Every case must fail before any training starts, exit non-zero, print one line naming the
problem and the fix (no traceback), and leave the outputs already made untouched. All of
it runs in one copy of the finished demo:

- PARSE: each case alone; the Snakefile refuses it before any job runs.
- JOBS: every case as its own run in one config, with --keep-going; each fails in the
  job that reads it (download, tokenize or shard), and no train job starts.
- the environment: a results/ directory that takes no new file.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, snakemake, write_jsonl

from snaketune.core.io import sha256_tree

DEMO_CONFIG = yaml.safe_load((ROOT / "config/config.yaml").read_text())


@dataclass(frozen=True)
class Case:
    """A bad input: how to make it, and the start of the error line it must produce."""

    id: str
    kind: str  # config | data | model | environment
    make: Callable[[dict, Path], None]  # edits the config dict, may write files in the workdir
    message: str
    rule: str = ""  # JOBS: the rule whose job must fail with the message


def _at(cfg: dict, path: str):
    *parents, last = path.split("/")
    node = cfg
    for p in parents:
        node = node[p]
    return node, last


def put(path: str, value) -> Callable[[dict, Path], None]:
    def make(cfg: dict, _: Path) -> None:
        node, last = _at(cfg, path)
        node[last] = value

    return make


def drop(path: str) -> Callable[[dict, Path], None]:
    def make(cfg: dict, _: Path) -> None:
        node, last = _at(cfg, path)
        del node[last]

    return make


def rename_run(name: str) -> Callable[[dict, Path], None]:
    def make(cfg: dict, _: Path) -> None:
        cfg["runs"][name] = cfg["runs"].pop("demo")

    return make


def with_file(name: str, content: bytes, path: str) -> Callable[[dict, Path], None]:
    def make(cfg: dict, workdir: Path) -> None:
        (workdir / name).write_bytes(content)
        put(path, name)(cfg, workdir)

    return make


def model_dir_without_config(cfg: dict, workdir: Path) -> None:
    (workdir / "bare-model").mkdir(exist_ok=True)
    (workdir / "bare-model" / "model.safetensors").write_bytes(b"")
    cfg["models"]["tiny"]["path"] = "bare-model"


def grpo_run(**changes) -> Callable[[dict, Path], None]:
    """Add a GRPO run `rl` starting from the demo, with ``changes``."""

    def make(cfg: dict, _: Path) -> None:
        cfg["runs"]["rl"] = {"init_from": "demo", "dataset": "arith", "method": "grpo",
                             "nodes": 1, "gpus_per_node": 1, "max_length": 128,
                             "micro_batch_size": 16, "learning_rate": 1e-5, "max_steps": 4,
                             **changes}  # fmt: skip

    return make


def grpo_loop(cfg: dict, workdir: Path) -> None:
    grpo_run(init_from="rl2")(cfg, workdir)
    cfg["runs"]["rl2"] = {**cfg["runs"]["rl"], "init_from": "rl"}


def grpo_on_messages(cfg: dict, workdir: Path) -> None:
    cfg["datasets"]["chat"] = {"source": "local", "path": "chat.jsonl", "format": "messages"}
    grpo_run(dataset="chat")(cfg, workdir)


PARSE = [
    Case("unknown-key", "config", put("runs/demo/lerning_rate", 1e-3),
         "config error: runs.demo.lerning_rate: unknown key; did you mean 'learning_rate'?"),
    Case("wrong-type", "config", put("runs/demo/nodes", "two"),
         "config error: runs.demo.nodes: 'two' is not of type 'integer'"),
    Case("missing-required-key", "config", drop("runs/demo/model"),
         "config error: runs.demo: missing required key 'model'"),
    Case("unknown-enum", "config", put("runs/demo/method", "lorra"),
         "config error: runs.demo.method: 'lorra' is not one of ['lora', 'full', 'grpo', 'dpo', 'reward', 'simpo', 'orpo', 'kto', 'rloo', 'distill', 'opd']"),
    Case("grpo-init-from-unknown-run", "config", grpo_run(init_from="demoo"),
         "config error: runs.rl.init_from: unknown run or sweep 'demoo' (defined: demo, rl)"),
    Case("grpo-init-from-loop", "config", grpo_loop,
         "config error: runs.rl.init_from: the runs start from each other in a loop "
         "(rl -> rl2 -> rl); one of them must start from a `model`"),
    Case("grpo-unknown-reward", "config", grpo_run(grpo={"rewards": {"correctnes": 1.0}}),
         "config error: runs.rl.grpo.rewards: 'correctnes' is not a reward; did you mean "
         "'correctness'? (built-ins: correctness, format; a function of yours: "
         "'<path/to/file.py>:<function>'; a reward run's model: 'model:<run>')"),
    Case("grpo-reward-model-of-a-run-that-trains-none", "config",
         grpo_run(grpo={"rewards": {"correctness": 1.0, "model:demo": 0.5}}),
         "config error: runs.rl.grpo.rewards: 'model:demo': run 'demo' is method lora, not a "
         "reward model; name a run of method reward (docs/rewards.md)"),
    Case("grpo-dataset-without-answers", "config", grpo_on_messages,
         "config error: runs.rl.dataset: 'chat' (format messages) gives no reference answers "
         "for the GRPO rewards"),
    Case("grpo-generations-do-not-divide-the-batch", "config",
         grpo_run(grpo={"num_generations": 6}),
         "config error: runs.rl.grpo.num_generations: 6 does not divide micro_batch_size 16 "
         "(each device generates whole groups)"),
    Case("unknown-model", "config", put("runs/demo/model", "gpt5"),
         "config error: runs.demo.model: unknown model 'gpt5' (defined: tiny)"),
    Case("unknown-dataset", "config", put("runs/demo/dataset", "gsm9k"),
         "config error: runs.demo.dataset: unknown dataset 'gsm9k' (defined: arith, arith_test, "
         "gsm8k_demo, gsm8k_demo_test)"),
    Case("duplicate-run-name", "config", lambda cfg, _: cfg.update(_duplicate=True),
         "'demo' is given twice in the same mapping; names must be unique"),
    Case("run-name-dotdot", "config", rename_run("../x"),
         "config error: runs: name '../x' is not a safe identifier"),
    Case("run-name-space", "config", rename_run("my run"),
         "config error: runs: name 'my run' is not a safe identifier"),
    Case("run-name-semicolon", "config", rename_run("a;rm -rf x"),
         "config error: runs: name 'a;rm -rf x' is not a safe identifier"),
    Case("nodes-zero", "config", put("runs/demo/nodes", 0),
         "config error: runs.demo.nodes: 0 is less than the minimum of 1"),
    Case("nodes-negative", "config", put("runs/demo/nodes", -2),
         "config error: runs.demo.nodes: -2 is less than the minimum of 1"),
    Case("lora-rank-zero", "config", put("runs/demo/lora/r", 0),
         "config error: runs.demo.lora.r: 0 is less than the minimum of 1"),
    Case("learning-rate-zero", "config", put("runs/demo/learning_rate", 0),
         "config error: runs.demo.learning_rate: 0 is less than or equal to the minimum of 0"),
    Case("learning-rate-negative", "config", put("runs/demo/learning_rate", -1e-4),
         "config error: runs.demo.learning_rate: -0.0001 is less than or equal to the minimum"),
    Case("epochs-and-max-steps", "config", put("runs/demo/max_steps", 10),
         "config error: runs.demo: give exactly one of `epochs` and `max_steps`"),
    Case("neither-epochs-nor-max-steps", "config", drop("runs/demo/epochs"),
         "config error: runs.demo: give exactly one of `epochs` and `max_steps`"),
    Case("deepspeed-preset-unknown", "config", put("runs/demo/deepspeed", "zero4"),
         "config error: runs.demo.deepspeed: 'zero4' is not valid here (DeepSpeed preset name "
         "(zero1, zero2, zero3, zero3_offload, from config/deepspeed/) or a path"),
    Case("deepspeed-file-missing", "config", put("runs/demo/deepspeed", "ds/zero4.json"),
         "config error: runs.demo.deepspeed: 'ds/zero4.json' is neither a preset (zero1, zero2, "
         "zero3, zero3_offload) nor an existing JSON file"),
    Case("number-in-quotes", "config", put("runs/demo/epochs", "6"),
         "config error: runs.demo.epochs: '6' is in quotes, so text, not a number; write it "
         "without them (epochs: 6)"),
    Case("deepspeed-json-invalid", "config",
         with_file("ds.json", b'{"zero_optimization": {"stage": 2,}}', "runs/demo/deepspeed"),
         "config error: runs.demo.deepspeed: ds.json is not valid JSON"),
    Case("chat-template-missing", "config", put("models/tiny/chat_template", "none.jinja"),
         "config error: models.tiny.chat_template: file 'none.jinja' not found"),
    Case("flash-attention-not-installed", "config",
         put("runs/demo/attn_implementation", "flash_attention_2"),
         "config error: runs.demo.attn_implementation: flash_attention_2 asked for but "
         'flash-attn is not installed; pip install -e ".[gpu]"'),
    Case("liger-kernel-not-installed", "config", put("runs/demo/liger_kernel", True),
         "config error: runs.demo.liger_kernel: true asked for but liger-kernel is not "
         'installed; pip install -e ".[gpu]"'),
    Case("lm-eval-include-path-missing", "config",
         put("runs/demo/eval/lm_eval/include_path", "my-tasks"),
         "config error: runs.demo.eval.lm_eval.include_path: my-tasks is not a directory"),
    Case("lm-eval-unknown-task", "config", put("runs/demo/eval/lm_eval/tasks", ["arith_dmeo"]),
         "error: runs.demo.eval.lm_eval.tasks: lm-eval knows no task 'arith_dmeo' (not among "
         "its own tasks or in "),
    Case("lora-on-the-output-layer", "config",
         put("runs/demo/lora/target_modules", ["q_proj", "lm_head"]),
         "config error: runs.demo.lora.target_modules: lm_head cannot take a LoRA adapter"),
    Case("dataset-file-missing", "data", put("datasets/gsm8k_demo/path", "data/train.jsonl"),
         "config error: datasets.gsm8k_demo.path: data/train.jsonl does not exist"),
    Case("dataset-file-empty", "data",
         with_file("empty.jsonl", b"", "datasets/gsm8k_demo/path"),
         "config error: datasets.gsm8k_demo.path: empty.jsonl is empty (0 bytes)"),
    Case("model-without-config-json", "model", model_dir_without_config,
         "config error: models.tiny.path: bare-model has no config.json; point it at a Hugging Face "
         "model directory"),
]  # fmt: skip


# ----------------------------------------------------------------------------- JOBS

QA = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}
QA_ROWS = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(40)]


def dataset(name: str, rows: list[dict] | bytes, suffix: str = ".jsonl", **spec):
    """A local dataset written into the workdir, in the demo's prompt_response shape."""

    def make(cfg: dict, workdir: Path) -> None:
        path = workdir / "bad-data" / f"{name}{suffix}"
        path.parent.mkdir(exist_ok=True)
        if isinstance(rows, bytes):
            path.write_bytes(rows)
        else:
            write_jsonl(path, rows)
        entry = {"source": "local", "path": str(path.relative_to(workdir)),
                 "format": "prompt_response",
                 "columns": {"prompt": "question", "response": "answer"}}  # fmt: skip
        entry.update(spec)
        cfg["datasets"][name] = entry
        cfg["runs"][name] = {**cfg["runs"]["demo"], "dataset": name}

    return make


def pairs(name: str, rows: list[dict]):
    """A local preference dataset written into the workdir, and a DPO run from the demo."""

    def make(cfg: dict, workdir: Path) -> None:
        dataset(name, rows, format="preference", columns={})(cfg, workdir)
        cfg["runs"][name] = {"init_from": "demo", "method": "dpo", "dataset": name,
                             "nodes": 1, "gpus_per_node": 1, "max_length": 64,
                             "micro_batch_size": 2, "learning_rate": 1e-5, "max_steps": 2}  # fmt: skip

    return make


# the GSM8K-shaped fixture (worked answers), for the length cases
GSM8K = {"dataset": "gsm8k_demo", "eval_dataset": "gsm8k_demo_test"}


def run_on_demo(name: str, **overrides):
    """A run of the demo dataset with ``overrides``."""

    def make(cfg: dict, _: Path) -> None:
        cfg["runs"][name] = {**cfg["runs"]["demo"], **overrides}

    return make


def tiny_copy(name: str, edit: Callable[[Path], None]):
    """A copy of the tiny model, changed by ``edit``, and a run that uses it."""

    def make(cfg: dict, workdir: Path) -> None:
        path = workdir / "bad-models" / name
        shutil.copytree(workdir / "resources/fixtures/tiny-llama", path, symlinks=False)
        edit(path)
        cfg["models"][name] = {"source": "local", "path": str(path.relative_to(workdir))}
        cfg["runs"][name] = {**cfg["runs"]["demo"], "model": name}

    return make


def no_template(path: Path) -> None:
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(tc))


def small_vocab(path: Path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 64
    (path / "config.json").write_text(json.dumps(cfg))


def as_bloom(path: Path) -> None:
    """An ALiBi architecture: its forward takes no position_ids."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="bloom", architectures=["BloomForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))


def no_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (path / name).unlink(missing_ok=True)


def overlap(cfg: dict, workdir: Path) -> None:
    cfg["datasets"]["copy_of_train"] = {**cfg["datasets"]["arith"]}
    cfg["runs"]["bad_overlap"] = {**cfg["runs"]["demo"], "eval_dataset": "copy_of_train"}


MESSAGES = [{"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}] * 20  # fmt: skip

# Data read where it is read: `snaketune validate` and the Snakefile read each dataset's
# first rows (snaketune.data.peek); these fail there, before any job.
FIRST_ROWS = [
    Case("unreadable-format", "data", dataset("bad_garbage", b"this is not json\n"),
         "error: datasets.bad_garbage.path: bad-data/bad_garbage.jsonl: line 1: not JSON "
         "(Expecting value); each line must be one object"),
    Case("unknown-extension", "data", dataset("bad_ext", b"a,b\n", suffix=".txt"),
         "error: datasets.bad_ext.path: bad-data/bad_ext.txt: cannot tell the format from the "
         "extension"),
    Case("invalid-utf8", "data",
         dataset("bad_utf8", b'{"question": "caf\xe9?", "answer": "#### 1"}\n'),
         "error: datasets.bad_utf8.path: bad-data/bad_utf8.jsonl is not valid UTF-8 (byte 0xe9 "
         "at line 1)"),
    Case("no-rows", "data", dataset("bad_norows", b"[]\n", suffix=".json"),
         "error: datasets.bad_norows: the dataset has no rows"),
    Case("missing-column", "data",
         dataset("bad_column", QA_ROWS, columns={"prompt": "query", "response": "answer"}),
         "error: datasets.bad_column: column 'query' not found (columns: question, answer)"),
    Case("wrong-format", "data", dataset("bad_fmt", QA_ROWS, format="alpaca", columns={}),
         "error: datasets.bad_fmt: columns 'instruction', 'output' not found (columns: "
         "question, answer); set `columns:` to map the fields of format alpaca"),
    Case("null-prompt", "data",
         dataset("bad_null", [QA, {"question": None, "answer": "#### 1"}, *QA_ROWS]),
         "error: datasets.bad_null row 1: column 'question' is null; clean the data or filter "
         "the row out"),
    Case("non-string-response", "data",
         dataset("bad_number", [{"question": "q", "answer": 4}] * 20),
         "error: datasets.bad_number row 0: column 'answer' is of type int, not text"),
    Case("messages-not-a-list", "data",
         dataset("bad_msgs", [{"messages": "hello"}] * 20, format="messages", columns={}),
         "error: datasets.bad_msgs row 0: `messages` must be a non-empty list of turns"),
    Case("messages-mixed-kinds", "data",  # row 1 alone: pyarrow refuses the whole file
         dataset("mixed_msgs", MESSAGES[:1] + [{"messages": "hello"}] + MESSAGES,
                 format="messages", columns={}),
         "row 1 (line 2): `messages` is a string; it must be a list of turns, e.g. "
         '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}], '
         "as in row 0 (pyarrow: "),
    Case("messages-bad-role", "data",
         dataset("bad_role", [{"messages": [{"role": "bot", "content": "x"}]}] + MESSAGES,
                 format="messages", columns={}),
         "error: datasets.bad_role row 0: each turn needs role system, user, assistant or tool"),
    Case("messages-no-assistant", "data",
         dataset("bad_noasst", MESSAGES + [{"messages": [{"role": "user", "content": "x"}]}],
                 format="messages", columns={}),
         "error: datasets.bad_noasst row 20: no assistant turn to learn from"),
    Case("pairs-of-plain-text-without-a-prompt", "data",
         pairs("bad_pairs", [{"chosen": "4", "rejected": "5"}] * 20),
         "error: datasets.bad_pairs: a preference dataset without a prompt column needs `chosen` "
         "and `rejected` as whole conversations that share their prompt (lists of {role, "
         "content} messages, or text in the 'Human: ... Assistant: ...' form); column 'chosen' "
         "holds plain text"),
]  # fmt: skip


JOBS = [
    Case("null-prompt-past-the-first-rows", "data",
         dataset("bad_null_late", [*QA_ROWS, *QA_ROWS, {"question": None, "answer": "#### 1"}]),
         "error: datasets.bad_null_late row 80: column 'question' is null; clean the data or "
         "filter the row out", "tokenize_dataset"),
    Case("all-rows-filtered-out", "data",
         dataset("bad_filtered", QA_ROWS,
                 filters=[{"column": "question", "op": "==", "value": "nothing matches"}]),
         "error: datasets.bad_filtered: no example left after tokenizing: 40 rows read, "
         "40 filtered out", "tokenize_dataset"),
    Case("all-rows-too-long", "data", run_on_demo("bad_too_long", **GSM8K, max_length=8),
         "error: datasets.gsm8k_demo: no example left after tokenizing:", "tokenize_dataset"),
    Case("example-longer-than-max-length", "data",
         run_on_demo("bad_overlong", **GSM8K, max_length=60, overlong="error"),
         "error: datasets.gsm8k_demo: 389 examples are longer than max_length 60 (overlong: "
         "error; the longest, gsm8k_demo:7, has 94 tokens); raise max_length to 94 or set "
         "overlong: drop", "tokenize_dataset"),
    Case("fewer-rows-than-a-batch", "data", dataset("bad_few", QA_ROWS[:3]),
         "error: runs.bad_few: the dataset has 3 examples, fewer than one global batch of 64",
         "shard_dataset"),
    Case("eval-overlaps-train", "data", overlap,
         "error: runs.bad_overlap: the eval set shares", "shard_dataset"),
    Case("tokenizer-without-chat-template", "model", tiny_copy("notemplate", no_template),
         "error: models.notemplate: the tokenizer has no chat template; set `chat_template:`",
         "tokenize_dataset"),
    Case("vocab-smaller-than-token-ids", "model", tiny_copy("smallvocab", small_vocab),
         "error: models.smallvocab: the tokenizer makes token id", "tokenize_dataset"),
    Case("model-cannot-take-packed-sequences", "model", tiny_copy("nopack", as_bloom),
         "error: runs.nopack.packing: nopack cannot train on packed sequences with eager "
         "attention (BloomForCausalLM takes no position_ids, so positions cannot restart per "
         "example); set packing: auto (trains it padded) or false", "shard_dataset"),
    Case("model-without-tokenizer", "model", tiny_copy("notok", no_tokenizer),
         "error: models.notok: resources/models/notok: cannot load its tokenizer",
         "tokenize_dataset"),
]  # fmt: skip


def _results_read_only(cfg: dict, workdir: Path) -> None:
    _read_only(workdir / "results", True)


# checked by test_environment_cases (the machine, not the config, is wrong)
ENVIRONMENT = [
    Case("results-not-writable", "environment", _results_read_only, "{results} is not writable"),
]


def test_catalogue_size():
    """The issue asks for at least 30 bad inputs, covering config, data, model, environment:
    counted from the lists the tests below run (each case is run by exactly one of them)."""
    cases = PARSE + FIRST_ROWS + JOBS + ENVIRONMENT
    assert len(cases) >= 30
    assert len({c.id for c in cases}) == len(cases)
    assert {c.kind for c in cases} == {"config", "data", "model", "environment"}


# ----------------------------------------------------------------------------- checks


@pytest.fixture(scope="module")
def workdir(demo, tmp_path_factory) -> Path:
    """A copy of the finished demo (mtimes kept, so nothing of it is due)."""
    out = tmp_path_factory.mktemp("bad_inputs") / "w"
    subprocess.run(["cp", "-a", str(demo), str(out)], check=True)
    return out


def produced(workdir: Path) -> dict[str, str]:
    """sha256 of every output the demo made."""
    return {
        **{f"results/{k}": v for k, v in sha256_tree(workdir / "results").items()},
        **{f"resources/{k}": v for k, v in sha256_tree(workdir / "resources").items()},
    }


def changed_since(workdir: Path, before: dict[str, str]) -> list[str]:
    """Outputs made before that are now gone or different (new outputs may appear)."""
    after = produced(workdir)
    return [k for k, v in before.items() if after.get(k) != v]


def job_logs(workdir: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (workdir / "logs").rglob("*.log")}


def write_config(cfg: dict, path: Path) -> Path:
    text = yaml.safe_dump({k: v for k, v in cfg.items() if k != "_duplicate"}, sort_keys=False)
    if cfg.get("_duplicate"):  # YAML keeps the last of two equal keys; the loader must not
        run = yaml.safe_dump({"demo": cfg["runs"]["demo"]}, sort_keys=False)
        text += "".join(f"  {line}\n" for line in run.splitlines())
    path.write_text(text)
    return path


def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(r"(config )?error: ", ln)]


def assert_one_clean_line(output: str, message: str) -> None:
    assert "Traceback" not in output, output
    lines = [ln for ln in error_lines(output) if message in ln]
    assert len(lines) == 1, f"expected one line with {message!r}:\n{output}"
    assert lines[0].startswith(message) or not message.startswith(("error", "config")), lines


def parse_time_lines(config_file: Path, workdir: Path) -> str:
    """What the Snakefile prints for ``config_file`` at parse time, in this process: the
    same call (snaketune.budget.checks.at_parse on the file as snakemake loads it) and the
    same "kind: line" per problem; a traceback for anything but a user's error."""
    import traceback

    from snaketune.budget.checks import at_parse
    from snaketune.core.errors import UserError, labelled

    config = yaml.safe_load(config_file.read_text())  # snakemake's loader: the last key wins
    try:
        at_parse(config, ROOT, [str(config_file)], workdir)
    except UserError as error:
        return "\n".join(f"{kind}: {line}" for kind, line in labelled(error))
    except Exception:
        return traceback.format_exc()
    return ""


# Cases checked before queueing, once the jobs are known (the Snakefile's onstart: lm-eval
# reads the tasks the evaluate jobs ask for), not at parse time: through snakemake only.
BEFORE_QUEUEING = {"lm-eval-unknown-task"}
# The cases that run through snakemake itself (the Snakefile's own printing and exit, and no
# job): one in eight of the parse-time cases, and those checked before queueing.
THROUGH_SNAKEMAKE = PARSE[::8] + [c for c in PARSE if c.id in BEFORE_QUEUEING]


def test_parse_time_cases(workdir, monkeypatch):
    """Every parse-time case through the Snakefile's check in this process, each refused
    with its one line; one in eight also through its own snakemake, two at a time
    (--nolock: a case that got as far as taking the lock would still be caught, as a job
    ran or a line is missing), which must exit non-zero with the line and run no job."""
    from concurrent.futures import ThreadPoolExecutor

    before, logs = produced(workdir), job_logs(workdir)
    paths = {}
    for case in PARSE:  # files first, one case at a time
        cfg = copy.deepcopy(DEMO_CONFIG)
        case.make(cfg, workdir)
        paths[case.id] = write_config(cfg, workdir / f"bad-{case.id}.yaml")
    monkeypatch.chdir(workdir)  # the Snakefile runs in the working directory (--directory)
    failures = []
    for case in [c for c in PARSE if c.id not in BEFORE_QUEUEING]:
        out = parse_time_lines(paths[case.id], workdir)
        try:
            assert out, f"{case.id}: no error"
            assert_one_clean_line(out, case.message)
        except AssertionError as exc:
            failures.append(f"{case.id}: {exc}")
    assert not failures, "\n\n".join(failures)

    def check(case: Case) -> str | None:
        proc = snakemake("--configfile", str(paths[case.id]), "--directory", str(workdir),
                         "--nolock", check=False)  # fmt: skip
        try:
            assert proc.returncode != 0, f"{case.id}: exit 0"
            assert_one_clean_line(proc.stdout + proc.stderr, case.message)
        except AssertionError as exc:
            return f"{case.id}: {exc}"
        return None

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(check, THROUGH_SNAKEMAKE) if f]
    assert not failures, "\n\n".join(failures)
    assert job_logs(workdir) == logs, "a job ran"
    assert changed_since(workdir, before) == []


def test_first_rows_cases_all_at_once_through_validate_the_dry_run_and_a_run(workdir):
    """Every data case read from its first rows, together in one config: `snaketune
    validate`, a dry run and a real run each name every one of them, once, and nothing
    runs (a problem does not hide the next)."""
    from conftest import BIN, ENV

    before, logs = produced(workdir), job_logs(workdir)
    cfg = copy.deepcopy(DEMO_CONFIG)
    for case in FIRST_ROWS:
        case.make(cfg, workdir)
    path = write_config(cfg, workdir / "bad-first-rows.yaml")
    validate = subprocess.run([str(BIN / "snaketune"), "validate", str(path)], cwd=workdir,
                              env=ENV, capture_output=True, text=True)  # fmt: skip
    dry = snakemake("-n", "--configfile", str(path), "--directory", str(workdir), check=False)
    run = snakemake("--configfile", str(path), "--directory", str(workdir), check=False)
    for name, proc in (("validate", validate), ("dry run", dry), ("run", run)):
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{name}: exit 0"
        for case in FIRST_ROWS:
            assert_one_clean_line(output, case.message)
        assert len(error_lines(output)) == len(FIRST_ROWS), output
    assert job_logs(workdir) == logs, "a job ran"
    assert changed_since(workdir, before) == []


@pytest.mark.slow  # ten jobs that fail: the CI tier's, not every change's
def test_job_cases_fail_in_their_job_before_training(workdir):
    before = produced(workdir)
    cfg = copy.deepcopy(DEMO_CONFIG)
    del cfg["runs"]["demo"]["eval_dataset"]
    for case in JOBS:
        case.make(cfg, workdir)
    del cfg["runs"]["demo"]
    path = write_config(cfg, workdir / "bad-jobs.yaml")
    targets = [f"results/{run}/shards" for run in cfg["runs"]]
    proc = snakemake("--configfile", str(path), "--directory", str(workdir), "--keep-going",
                     *targets, check=False)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Traceback" not in output, output
    failures = []
    for case in JOBS:
        logs = [
            p
            for p in (workdir / "logs" / case.rule).glob("*.log")
            if any(ln.startswith(case.message) for ln in p.read_text().splitlines())
        ]
        try:
            assert len(logs) == 1, f"no {case.rule} log starts a line with {case.message!r}"
            text = logs[0].read_text()
            assert "Traceback" not in text, text
            assert len(error_lines(text)) == 1, text
        except AssertionError as exc:
            failures.append(f"{case.id}: {exc}")
    assert not failures, "\n".join(failures) + "\n\n" + output
    assert not list((workdir / "logs/train").glob("bad*")), "a train job started"
    assert not [r for r in cfg["runs"] if (workdir / f"results/{r}/shards").exists()]
    assert changed_since(workdir, before) == []


def _read_only(path: Path, on: bool) -> bool:
    """Make ``path`` take no new entry (chattr +i works for root, chmod does not)."""
    if shutil.which("chattr"):
        done = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True)
        if done.returncode == 0:
            return True
    path.chmod(0o555 if on else 0o755)
    return True


@pytest.mark.parametrize("case", ENVIRONMENT, ids=lambda c: c.id)
def test_environment_cases(workdir, case):
    before = produced(workdir)
    results = workdir / "results"
    case.make({}, workdir)
    try:
        probe = results / "probe"
        try:
            probe.write_text("")
            probe.unlink()
            pytest.fail("cannot make results/ read-only on this machine (chattr, chmod)")
        except OSError:
            pass
        proc = snakemake("--forcerun", "report", "--directory", str(workdir), check=False)
    finally:
        _read_only(results, False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert_one_clean_line(output, "error: " + case.message.format(results=results))
    assert "snakemake --directory DIR" in output
    assert changed_since(workdir, before) == []
