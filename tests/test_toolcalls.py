"""Tool calls in chat data (snaketune.data.toolcalls): rows in the Hub's function-calling
layout tokenized with real templates (Qwen3.5's and Gemma 4's, not prefix-stable; Llama 3.2's,
Gemma 4's), their masks checked against transformers' own renders of the
same messages; each bad row named by row and turn."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from families import FAMILIES, build

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]  # fmt: skip
USER = "What is twelve plus thirty?"
RESULT = '{"result": 42}'
ANSWER = "The sum is 42."


def tool_row(arguments=None, name="add", content="") -> dict:
    call = {"type": "function", "function": {"name": name,
                                             "arguments": arguments or {"a": 12, "b": 30}}}  # fmt: skip
    return {
        "messages": [
            {"role": "user", "content": USER},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "content": RESULT},
            {"role": "assistant", "content": ANSWER},
        ],
        "tools": json.dumps(TOOLS),
    }


def tokenized(rows, model_dir, tmp_path, columns=None):
    from snaketune.data.conversations import Source
    from snaketune.data.tokenization import tokenize

    data = tmp_path / "tools.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    spec = {"source": "local", "path": str(data), "format": "messages", "columns": columns or {}}
    out = tmp_path / "tokenized.parquet"
    tokenize([Source("calls", data, spec)], model_dir, out, 4096, model_name="m")
    return pq.read_table(out).to_pylist()


def trained_runs(row, tokenizer) -> list[str]:
    """The labelled tokens of a tokenized row, as the texts of their runs."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(r) for r in runs]


CORPUS = [USER, RESULT, ANSWER, "add a b integer result sum"] * 8


@pytest.mark.parametrize("family", ["qwen3.5", "llama3", "gemma4"])
def test_a_tool_call_rows_calls_and_answers_are_trained_and_its_tool_results_are_not(
    family, tmp_path
):
    """The assistant's call (its function and arguments as the template prints them) and its
    answer are trained; the tool's result and the user's text are not. Each trained run is
    what transformers' apply_chat_template of the same messages and tools adds for that
    assistant turn after the generation prompt (a prefix-stable template: every turn; Qwen3.5,
    which renders earlier turns otherwise: the last turn, and the call's turn as the one
    full render holds it)."""
    from transformers import AutoTokenizer

    model_dir = build(family, CORPUS, tmp_path / family)
    tok = AutoTokenizer.from_pretrained(model_dir)
    row = tool_row()
    (ours,) = tokenized([row], model_dir, tmp_path)
    msgs = row["messages"]

    def render(messages, gen=False):  # Llama 3's template's own variable for its date:
        # the day tokenize renders (snaketune.data.chat.TEMPLATE_DATE), not today
        return tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=gen,
                                       date_string="26 Jul 2024")  # fmt: skip

    full = render(msgs)
    assert tok.decode(ours["input_ids"]) == full
    runs = trained_runs(ours, tok)
    assert len(runs) == 2, runs
    call_run, answer_run = runs
    assert all(USER not in r and '"result"' not in r for r in runs), runs
    assert "add" in call_run and "12" in call_run and "30" in call_run, call_run
    last = full[len(render(msgs[:3], gen=True)) :].rstrip("\n")  # the newline after: prompt
    assert full.startswith(render(msgs[:3], gen=True))
    prompted, through = render(msgs[:1], gen=True), render(msgs[:2])
    assert answer_run == last, (answer_run, last)
    if full.startswith(through):  # the call's turn as its prefixes say
        assert call_run == through[len(prompted) :].rstrip("\n")
    else:  # the call's turn as the one full render holds it, through its end of turn
        assert call_run in full and call_run.endswith(FAMILIES[family].stops[0]), call_run


def test_calls_with_other_arguments_read_through_parquet_keep_their_own(tmp_path):
    """A JSON-lines file of calls with different argument names becomes one Arrow struct
    (each call gets every name, null where it had none): each call renders with its own."""
    from transformers import AutoTokenizer

    model_dir = build("llama3", CORPUS, tmp_path / "llama3")
    tools = TOOLS + [{"type": "function", "function": {"name": "ping", "description": "Ping.",
                                                       "parameters": {"type": "object",
                                                                      "properties": {}}}}]  # fmt: skip
    rows = [tool_row(), tool_row(arguments={}, name="ping")]
    rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = {}
    for r in rows:
        r["tools"] = json.dumps(tools)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [tok.decode(r["input_ids"]) for r in tokenized(rows, model_dir, tmp_path)]
    assert '"parameters": {"a": 12, "b": 30}' in texts[0]
    assert '"parameters": {}' in texts[1] and "null" not in texts[1]


def test_a_row_without_tools_and_a_text_row_read_as_before(tmp_path):
    """A messages row with no tools column (and no calls) tokenizes as it did: same text, its
    one answer trained; a row with calls but no tools declared is read (nothing to check
    the calls against)."""
    from transformers import AutoTokenizer

    model_dir = build("qwen3.5", CORPUS, tmp_path / "q")
    tok = AutoTokenizer.from_pretrained(model_dir)
    plain = {"messages": [{"role": "user", "content": USER},
                          {"role": "assistant", "content": ANSWER}]}  # fmt: skip
    (row,) = tokenized([plain], model_dir, tmp_path)
    assert tok.decode(row["input_ids"]) == tok.apply_chat_template(
        plain["messages"], tokenize=False
    )
    undeclared = {"messages": tool_row()["messages"]}
    (row,) = tokenized([undeclared], model_dir, tmp_path)
    assert len(trained_runs(row, tok)) == 2


@pytest.mark.parametrize(
    "row, line",
    [
        (tool_row(name="multiply"), "row 0 turn 1: a call to tool 'multiply', which the row's "
                                    "tools do not declare (declared: add)"),
        (tool_row(arguments="{a: 12"), "row 0 turn 1 call 0 (add): arguments are not JSON"),
        ({"messages": [{"role": "user", "content": USER}, {"role": "tool", "content": RESULT},
                       {"role": "assistant", "content": ANSWER}]},
         "row 0 turn 1: a tool turn with no call before it"),
        ({**tool_row(), "tools": "[{"}, "row 0: column 'tools' is not JSON"),
    ],
)  # fmt: skip
def test_a_bad_tool_row_is_one_line_naming_its_row_and_turn(row, line, tmp_path):
    from snaketune.core.errors import DataError
    from snaketune.data.conversations import message_turns

    with pytest.raises(DataError) as info:
        message_turns(row["messages"], row.get("tools"), "calls", 0)
    assert f"datasets.calls {line}" in str(info.value)


def test_a_template_that_prints_no_tool_calls_is_refused_naming_the_model(tmp_path):
    """SmolLM3's template renders an assistant turn's content only: its calls would not be
    trained, so the row is refused, naming the model and the fix."""
    from snaketune.core.errors import DataError

    model_dir = build("smollm3", CORPUS, tmp_path / "s")
    with pytest.raises(DataError) as info:
        tokenized([tool_row()], model_dir, tmp_path)
    assert "the chat template prints nothing for an assistant turn's tool_calls" in str(info.value)


def test_validate_shows_a_tool_rows_trained_tokens_with_its_tools(tmp_path):
    """`snaketune validate my.yaml --show-row 0` on a tool-call row (snaketune.data.peek):
    the row rendered with its tools, its call and answer between « and », its tool result
    outside."""
    from transformers import AutoTokenizer

    from snaketune.data.chat import ChatRenderer
    from snaketune.data.peek import show_row

    model_dir = build("qwen3.5", CORPUS, tmp_path / "q")
    data = tmp_path / "calls.jsonl"
    data.write_text(json.dumps(tool_row()) + "\n")
    spec = {"source": "local", "path": str(data), "format": "messages"}
    shown = show_row(ChatRenderer(AutoTokenizer.from_pretrained(model_dir)), "calls", spec,
                     data, True, 0)  # fmt: skip
    assert "# Tools" in shown and '"name": "add"' in shown, shown
    trained = [part.split("»")[0] for part in shown.split("«")[1:]]
    assert len(trained) == 2 and "<function=add>" in trained[0] and ANSWER in trained[1], trained
    assert all('"result"' not in t for t in trained)


def arithmetic_rows(n: int, seed: int) -> list[dict]:
    """Tool-call rows of sums (a call to add, its result, the answer); about a third answer
    without the tool, so rows differ in length and shape."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        row = tool_row(arguments={"a": a, "b": b})
        msgs = row["messages"]
        msgs[0]["content"] = f"What is {a} plus {b}?"
        msgs[2]["content"] = json.dumps({"result": a + b})
        msgs[3]["content"] = f"The sum is {a + b}."
        if rng.random() < 0.3:
            row["messages"] = [msgs[0], {"role": "assistant", "content": f"{a + b}"}]
        rows.append(row)
    return rows


@pytest.mark.slow
@pytest.mark.extended  # the CI tier's budget: the GRPO-with-tools chain's SFT (test_agents.py)
# takes tool-call rows through the pipeline there; their masks are the quick tests' above
def test_lora_on_tool_call_rows_trains_on_two_nodes_and_evaluates(tmp_path):
    """Tool-call rows through the whole pipeline (tokenize, shard, LoRA on 2 emulated nodes,
    export, evaluation, report) on a tiny Qwen3.5 with its Hub template: every trained
    stretch of a tool row holds the call or the answer, never a tool's result; the held-out
    prompts carry the tools' block; the held-out loss is plain transformers' NLL over the
    tokenized rows' labels with the merged model."""
    import torch
    import yaml
    from conftest import read_jsonl, snakemake
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = tmp_path / "w"
    build("qwen3.5", CORPUS, w / "models/q")
    (w / "data").mkdir()
    for split, n, seed in (("train", 64, 0), ("test", 8, 1)):
        rows = arithmetic_rows(n, seed)
        (w / f"data/{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    local = {"source": "local", "format": "messages"}
    config = {
        "models": {"q": {"source": "local", "path": "models/q"}},
        "datasets": {"calls": {**local, "path": "data/train.jsonl"},
                     "calls_test": {**local, "path": "data/test.jsonl"}},
        "runs": {"sft": {"model": "q", "dataset": "calls", "eval_dataset": "calls_test",
                         "method": "lora", "nodes": 2, "gpus_per_node": 1, "max_length": 2048,
                         "micro_batch_size": 4, "max_steps": 4, "learning_rate": 1e-3,
                         "save_steps": 4, "packing": False,
                         "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
                         "eval": {"max_new_tokens": 4, "batch_size": 8}}},
    }  # fmt: skip
    (w / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake("--configfile", str(w / "config.yaml"), "--directory", str(w))
    tok = AutoTokenizer.from_pretrained(w / "models/q")
    train = pq.read_table(next((w / "results/tokenized").glob("calls__*/data.parquet")))
    with_calls = 0
    for row in train.to_pylist():
        runs = trained_runs(row, tok)
        assert runs and all('"result"' not in r for r in runs), runs
        with_calls += any("<function=add>" in r for r in runs)
    assert 0 < with_calls < train.num_rows
    steps = [m for m in read_jsonl(w / "results/sft/train/metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    samples = read_jsonl(w / "results/sft/eval/samples.jsonl")
    assert samples and all("# Tools" in s["prompt"] for s in samples)
    merged = w / "results/sft/merged_model"
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    test = pq.read_table(next((w / "results/tokenized").glob("calls_test__*/data.parquet")))
    total = count = 0.0
    for row in test.to_pylist():
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double()[:-1], -1)
        for t, label in enumerate(row["labels"][1:], start=1):
            if label != -100:
                total -= logp[t - 1, label].item()
                count += 1
    metrics = json.loads((w / "results/sft/eval/metrics.json").read_text())
    assert metrics["loss"] == pytest.approx(total / count, abs=1e-5)


def test_a_jsonl_file_whose_calls_take_no_arguments_downloads_and_renders_them(tmp_path):
    """Calls whose arguments are all {} (an Arrow struct of no fields, which parquet cannot
    hold) go through the download stage's conversion and render with no arguments."""
    from transformers import AutoTokenizer

    from snaketune.data.sources import convert_local

    model_dir = build("llama3", CORPUS, tmp_path / "llama3")
    ping = [{"type": "function", "function": {"name": "ping", "description": "Ping.",
                                              "parameters": {"type": "object",
                                                             "properties": {}}}}]  # fmt: skip
    row = tool_row(arguments={}, name="ping")
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = {}
    row["tools"] = ping  # objects, not a JSON string: their empty properties too
    src = tmp_path / "calls.jsonl"
    src.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    assert convert_local(src, "jsonl", tmp_path / "data.parquet") == 2
    rows = pq.read_table(tmp_path / "data.parquet").to_pylist()
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.decode(tokenized(rows, model_dir, tmp_path)[0]["input_ids"])
    assert '"name": "ping", "parameters": {}' in text and "null" not in text


def test_tools_and_calls_read_each_edge_of_their_values():
    """snaketune.data.toolcalls on the values a dataset holds at the edges: no tools (None,
    "", [] all mean none), a list that is not of schemas, calls of no call, a call with an
    empty name, arguments as a dict with Arrow's nulls, as text, as empty text; the canonical
    JSON keeps non-ASCII text as written and sorts the keys (one row's calls compare equal
    to another's)."""
    from snaketune.core.errors import DataError
    from snaketune.data import toolcalls as tc

    for none in (None, "", []):
        assert tc.tools_of(none, "w") is None, none
    for bad in ([1], {"name": "add"}, [{"name": "add"}, "add"]):
        with pytest.raises(DataError, match="must be a list of function schemas"):
            tc.tools_of(bad, "w")
    schema = {"type": "function", "function": {"name": "add", "parameters": {"properties": None}}}
    assert tc.tools_of(json.dumps([schema]), "w")[0]["function"]["parameters"] == {"properties": {}}
    assert tc.calls_of({"tool_calls": []}, "w") is None
    assert tc.calls_of({"content": "hi"}, "w") is None
    with pytest.raises(DataError, match="tool_calls must be a list"):
        tc.calls_of({"tool_calls": "add(1, 2)"}, "w")
    for call in ({"name": ""}, {"function": {"name": None}}, "add"):
        with pytest.raises(DataError, match="needs a function name"):
            tc.calls_of({"tool_calls": [call]}, "w")
    got = tc.calls_of({"tool_calls": [
        {"function": {"name": "note", "arguments": {"zeta": "café", "alpha": 1, "beta": None}}},
        {"name": "ping", "arguments": "  "},
        {"name": "add", "arguments": '{"b": 2, "a": 1}'},
    ]}, "w")  # fmt: skip
    assert got == (
        '[{"function": {"arguments": {"alpha": 1, "zeta": "café"}, "name": "note"}, '
        '"type": "function"}, {"function": {"arguments": {}, "name": "ping"}, '
        '"type": "function"}, {"function": {"arguments": {"a": 1, "b": 2}, "name": "add"}, '
        '"type": "function"}]'
    )


@pytest.mark.parametrize("falsy", [0, 0.0, "", False, []])
def test_an_argument_present_but_falsy_is_kept_where_a_null_is_dropped(falsy):
    """``add(a=<falsy>, b=3)`` as a row holds it (a dict with Arrow's null filler beside,
    or JSON text), and as the download writes it back (sources._no_empty): ``a`` kept with
    its value, only the null left out; dropping it with the nulls would train add(b=3)."""
    from snaketune.data import toolcalls as tc
    from snaketune.data.sources import _no_empty

    want = {"a": falsy, "b": 3}
    for arguments in ({"a": falsy, "b": 3, "c": None}, json.dumps({"a": falsy, "b": 3})):
        got = json.loads(
            tc.calls_of({"tool_calls": [{"name": "add", "arguments": arguments}]}, "w")
        )
        assert got[0]["function"]["arguments"] == want, arguments
    assert _no_empty({"a": falsy, "b": 3, "c": None}) == want


def call_turn(*names: str) -> tuple:
    calls = [{"type": "function", "function": {"name": n, "arguments": {"x": "é"}}} for n in names]
    return ("assistant", "", None, json.dumps(calls))


def test_a_tool_turn_follows_a_call_or_another_tool_turn():
    from snaketune.core.errors import DataError
    from snaketune.data import toolcalls as tc

    role = "".join(["to", "ol"])  # read from a file: equal to "tool", not the same object
    user, tool, said = (
        ("user", "q", None, None),
        (role, "5", None, None),
        ("assistant", "a", None, None),
    )
    tools = [{"name": "add"}, {"name": "mul"}]
    tc.check_calls((user, call_turn("add", "mul"), tool, tool, said), tools, "w")
    tc.check_calls((user, call_turn("other"), tool), None, "w")  # no tools declared: any call
    for turns, j in [
        ((tool, said), 0),
        ((tool, call_turn("add")), 0),  # the first turn: nothing before it, not the last
        ((tool, tool), 0),
        ((user, said, tool), 2),
        ((user, call_turn("add"), said, tool), 3),
    ]:
        with pytest.raises(DataError, match=f"w turn {j}: a tool turn with no call before it"):
            tc.check_calls(turns, tools, "w")
    with pytest.raises(DataError, match=r"turn 1: a call to tool 'sub'.*\(declared: add, mul\)"):
        tc.check_calls((user, call_turn("add", "sub"), tool), tools, "w")
    assert tc.any_calls((user, call_turn("add"))) and tc.any_calls((user, tool))
    assert not tc.any_calls((user, said)) and not tc.any_calls(())
    assert not tc.called(("assistant", "a", None)) and not tc.called(said)


def test_a_marked_field_is_where_the_render_shows_it():
    """Text fields between the marks; a calling turn's empty text left as it is (Gemma 4
    prints it after the results), a plain turn's marked; the calls' marks an argument of the
    last call, non-ASCII arguments as written."""
    from snaketune.data import toolcalls as tc

    calling, plain = call_turn("add", "mul"), ("assistant", "", None, None)
    assert tc.marked_field(calling, 1, "", "<", ">") == ""
    assert tc.marked_field(calling, 1, "so", "<", ">") == "<so>"
    assert tc.marked_field(plain, 1, "", "<", ">") == "<>"
    assert tc.marked_field(calling, 2, "", "<", ">") == "<>"  # reasoning: marked, even empty
    calls = json.loads(tc.marked_field(calling, 3, calling[3], "<", ">"))
    assert [c["function"]["arguments"] for c in calls] == [{"x": "é"}, {"x": "é", "<>": ""}]
    assert "é" in tc.marked_field(calling, 3, calling[3], "<", ">")
