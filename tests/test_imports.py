"""What snaketune defers as it loads (snaketune.core.imports): the ``torch.compile`` calls that
bitsandbytes and DeepSpeed's Muon optimizer make as they load, compiled on first call; and
Python's garbage collector while an entry script loads its modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import ENV


def stdout_of(code: str) -> str:
    """What a fresh Python running ``code`` prints (it must exit 0)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env=ENV).stdout  # fmt: skip


def deferred_and_as_loaded(check: str) -> dict[str, str]:
    """The last line ``check`` prints in a fresh Python with snaketune imported first
    ("deferred") and last ("as loaded"); ``check`` may use ``sys``."""
    sides = {"deferred": f"import sys, snaketune; {check}",
             "as loaded": f"import sys; {check}; import snaketune"}  # fmt: skip
    return {side: stdout_of(code).splitlines()[-1] for side, code in sides.items()}


def test_a_deferred_compile_compiles_the_same_function_with_the_same_settings_on_first_call():
    """snaketune.core.imports: what bitsandbytes wraps in torch.compile as it loads is
    compiled when first called (once, with its settings, by the real torch.compile); a
    module is compiled at once."""
    from snaketune.core.imports import compiled_on_first_call

    made = []

    def compile_(model, **settings):
        made.append((model, settings))
        return lambda *a, **k: ("compiled", model(*a, **k))

    deferred = compiled_on_first_call(compile_)

    def kernel(x, scale=1):
        return x * scale

    wrapped = deferred(kernel, dynamic=False)
    decorated = deferred(dynamic=True)(kernel)  # the @torch.compile(...) form
    assert made == [] and wrapped.__name__ == "kernel"
    assert wrapped(3, scale=2) == ("compiled", 6) and wrapped(1) == ("compiled", 1)
    assert decorated(2) == ("compiled", 2)
    assert made == [(kernel, {"dynamic": False}), (kernel, {"dynamic": True})]
    module = torch.nn.Linear(2, 2)
    deferred(module, mode="max-autotune")
    assert made[-1] == (module, {"mode": "max-autotune"})


def test_bitsandbytes_loads_in_a_snaketune_process_without_torchinductor():
    """peft imports bitsandbytes wherever it is not hidden; loaded after snaketune,
    it is whole (QLoRA's layers, its kernels' wrappers) without TorchInductor, and
    torch.compile is torch's own again afterwards."""
    code = (
        "import sys, snaketune, torch; real = torch.compile; import bitsandbytes as bnb; "
        "from bitsandbytes.backends.default import ops; "
        "print(hasattr(bnb.nn, 'Linear4bit'), callable(ops._dequantize_4bit_compute), "
        "'torch._inductor.compile_fx' in sys.modules, torch.compile is real)"
    )
    out = stdout_of(code)
    assert out.split() == ["True", "True", "False", "True"], out


def test_deepspeed_s_optimizer_check_in_a_snaketune_process_loads_no_torchinductor():
    """Every deepspeed.initialize with ZeRO checks its optimizer against the ones ZeRO
    supports, importing DeepSpeed's Muon (which wraps its kernels in torch.compile as it
    loads). After snaketune it is whole (the optimizer on ZeRO's list, its kernel callable)
    without TorchInductor, and torch.compile is torch's own again; loaded before snaketune,
    the same check imports TorchInductor (what the deferral saves a training rank)."""
    check = (
        "import torch; real = torch.compile; from deepspeed import comm; "
        "comm.get_rank = lambda *a, **k: 0; "
        "from deepspeed.runtime.zero.utils import is_zero_supported_optimizer as ok; "
        "adamw = ok(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])); "
        "from deepspeed.runtime.zero.muon import muon_optimizer as m, original_muon as o; "
        "from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS as listed; "
        "print(adamw, m.MuonWithAuxAdam in listed, callable(o.zeropower_via_newtonschulz5), "
        "'torch._inductor.compile_fx' in sys.modules, torch.compile is real)"
    )
    # the last line of each: DeepSpeed prints its choice of accelerator to stdout first
    outs = {side: line.split() for side, line in deferred_and_as_loaded(check).items()}
    assert outs["deferred"] == ["True", "True", "True", "False", "True"], outs
    assert outs["as loaded"][3] == "True", outs  # what the check costs without the deferral


def test_transformers_losses_load_without_scipy_and_match_on_first_call():
    """Every process that loads a model imports transformers' losses, whose object-detection
    matchers take scipy's linear_sum_assignment as they load. After snaketune, loading
    transformers' models leaves scipy.optimize unloaded; each loss module's function, when
    called, loads it and gives scipy's own assignment. Loaded before snaketune, the same
    import loads scipy.optimize (what the deferral saves each such process)."""
    import numpy as np
    from scipy.optimize import linear_sum_assignment

    cost = np.random.default_rng(0).random((5, 7)).round(3)
    check = (
        "import numpy as np, transformers.modeling_utils; "
        "from transformers.loss import loss_for_object_detection as a, loss_rt_detr as b; "
        "before = 'scipy.optimize' in sys.modules; "
        f"cost = np.array({cost.tolist()}); "
        "print(before, [x.tolist() for f in (a, b) for x in f.linear_sum_assignment(cost)])"
    )
    outs = deferred_and_as_loaded(check)
    rows, cols = linear_sum_assignment(cost)
    want = str([rows.tolist(), cols.tolist()] * 2)
    assert outs["deferred"] == f"False {want}", outs
    assert outs["as loaded"] == f"True {want}", outs  # what loading a model costs without it


LOADING = """
import gc, json, sys, weakref
from snaketune.core.imports import load, loading

sys.path.insert(0, sys.argv[1])
full = lambda: gc.get_stats()[2]["collections"]
out = {}
before = full()
import heavy_a  # as Python loads it
out["full collections, collecting"] = full() - before
before, frozen = full(), gc.get_freeze_count()
load("heavy_b")
out["full collections, loading"] = full() - before
out["frozen"] = gc.get_freeze_count() - frozen
out["on after"] = gc.isenabled()
out["garbage of the load kept, frozen"] = sys.modules["heavy_b"].CYCLE() is not None
cycle = [None]
cycle[0] = cycle
ref = weakref.ref(type("Made", (), {"cycle": cycle}))  # a class is in a cycle of its own
out["garbage made after collected"] = gc.collect() > 0 and ref() is None
try:
    with loading():
        raise KeyError("x")
except KeyError:
    out["on after a raise"] = gc.isenabled()
gc.disable()
with loading():
    import heavy_c
out["off stays off"] = not gc.isenabled()
gc.enable()
print(json.dumps(out))
"""
HEAVY = """
import weakref
ROWS = [[i] for i in range(300_000)]  # live (kept by the module), each a tracked object
class Node:
    pass
node = Node()
node.me = node  # garbage once the name goes: only a collection frees it
CYCLE = weakref.ref(node)
del node
"""


def test_the_collector_is_off_while_an_entry_script_loads_and_what_stays_is_frozen(tmp_path):
    """snaketune.core.imports.loading/load: a module that makes 300,000 objects as it loads
    runs full collections as Python loads it, none under ``load`` (what it made frozen,
    its garbage with it); the collector is on after, also after a raise, and collects what
    is made after; where it was off, it stays off."""
    for name in ("heavy_a", "heavy_b", "heavy_c"):
        (tmp_path / f"{name}.py").write_text(HEAVY)
    script = tmp_path / "loading.py"
    script.write_text(LOADING)
    out = json.loads(subprocess.run([sys.executable, str(script), str(tmp_path)], check=True,
                                    capture_output=True, text=True, env=ENV).stdout)  # fmt: skip
    assert out["full collections, collecting"] >= 2, out  # the module does trigger them
    assert out["full collections, loading"] == 0, out
    assert out["frozen"] >= 300_000, out
    assert out["on after"] and out["on after a raise"] and out["off stays off"], out
    assert out["garbage of the load kept, frozen"] and out["garbage made after collected"], out


def test_a_tokenize_job_of_chat_rows_or_documents_imports_no_torch(tiny_model, tmp_path):
    """A tokenize job's imports (scripts/tokenize_dataset.py's) and its work, on chat rows
    and on documents, with a plain fast tokenizer (the fixture's class; Llama 3's
    PreTrainedTokenizerFast): torch is never imported (transformers' AutoTokenizer imports
    it through the model configs: 1.4 s in each of a corpus's 64 part jobs); the rows are
    the ones AutoTokenizer's tokenizer makes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import ROOT
    from transformers import AutoTokenizer

    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"prompt": ["What is 2 + 3?", "Name a colour."],
                             "response": ["5", "Blue, like the sky."]}), chat)  # fmt: skip
    docs = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["A short document.", "Another, longer one " * 9]}), docs)
    # each a whole job through its entry point (its main(), as the rule runs it)
    for name, path, fmt, length in (("chat", chat, "prompt_response", 256),
                                    ("docs", docs, "text", 16)):  # fmt: skip
        spec = {"chat_template": None, "dataset": name, "max_length": length, "model": "tiny",
                "overlong": "drop", "sources": [{"name": name, "seed": 0, "weight": 1.0,
                "spec": {"source": "local", "path": str(path), "format": fmt}}]}  # fmt: skip
        argv = ["tokenize_dataset.py", "--spec", json.dumps(spec), "--data", str(path),
                "--model", str(tiny_model), "--out", str(tmp_path / f"{name}.tok.parquet"),
                "--stats", str(tmp_path / f"{name}.stats.json")]  # fmt: skip
        code = f"""
import json, runpy, sys
sys.argv = {argv!r}
try:
    runpy.run_path({str(ROOT / "scripts/tokenize_dataset.py")!r}, run_name="__main__")
except SystemExit as exit:
    assert not exit.code, exit.code
print(json.dumps({{"torch": "torch" in sys.modules}}))
"""
        assert json.loads(stdout_of(code).splitlines()[-1]) == {"torch": False}, name
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = pq.read_table(tmp_path / "docs.tok.parquet").to_pylist()
    ids = [i for r in rows for i in r["input_ids"]]  # the documents' tokens, end-of-text after each
    want = [i for t in ("A short document.", "Another, longer one " * 9)
            for i in tok(t, add_special_tokens=True)["input_ids"] + [tok.eos_token_id]]  # fmt: skip
    assert ids == want


BARE = '''
import pkgutil, sys

HEAVY = {"numpy", "pyarrow", "pandas", "torch", "transformers", "datasets", "tokenizers",
         "safetensors", "huggingface_hub", "peft", "trl", "deepspeed", "jinja2"}
OURS = (%r, %r)  # the workflow's files and snaketune's


class Bare:
    """An environment with Snakemake alone: a module of HEAVY imported by the workflow or
    snaketune is not there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in HEAVY:
            return None
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        where = "" if frame is None else frame.f_code.co_filename
        if where.startswith(OURS) or where.endswith((".smk", "Snakefile")):
            raise ModuleNotFoundError(f"No module named {name!r} ({where}:{frame.f_lineno})")
        return None


sys.meta_path.insert(0, Bare())
_iter = pkgutil.iter_modules  # without the SLURM plugin, which imports pandas as it loads
pkgutil.iter_modules = lambda *a, **k: (m for m in _iter(*a, **k)
                                        if not m.name.startswith("snakemake_executor_plugin"))
'''


def test_the_workflow_lints_where_only_snakemake_is_installed(tmp_path):
    """Snakemake's catalog lints a workflow with Snakemake alone installed: parsing ours (the
    Snakefile, its rules' input functions, the checks and plans it loads) imports none of
    numpy, pyarrow, pandas, torch, transformers, tokenizers, peft, TRL or DeepSpeed (each a
    deferred module, snaketune.core.imports.deferred, where a plan reads a table). Each
    such import, from the workflow or snaketune, fails here as where it is not installed;
    the lint passes and names no problem."""
    from conftest import ENV, ROOT

    site = tmp_path / "site"
    site.mkdir()
    workflow, library = str(ROOT / "workflow"), str(ROOT / "scripts" / "snaketune")
    (site / "sitecustomize.py").write_text(BARE % (workflow, library))
    env = {**ENV, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "--lint", "--snakefile",
         str(ROOT / "Snakefile"), "--configfile", str(ROOT / "config/config.yaml"),
         "--directory", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Congratulations, your workflow is in a good condition!" in out, out
    # the check can fail: a module of "ours" importing pyarrow as it loads is refused
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "sitecustomize.py").write_text(BARE % (str(ours), library))
    (ours / "probe.py").write_text("import pyarrow\n")
    probe = subprocess.run([sys.executable, "-c", "import probe"], capture_output=True,
                           text=True, env={**ENV, "PYTHONPATH": str(ours)})  # fmt: skip
    assert "No module named 'pyarrow'" in probe.stderr, probe.stderr


def test_a_training_worker_imports_its_own_method_s_trainer_alone():
    """A training rank (scripts/train.py --worker) loads snaketune.train.worker, DeepSpeed,
    datasets and the method registry with every method, then its own method's trainer as
    it builds it: no TRL trainer module is loaded before that, and SFT's loads none of the
    others' (GRPO's, DPO's, KTO's, RLOO's, the distillations', TRL's experimental ones)."""
    code = """
import json, sys
import snaketune.train.worker
from snaketune.core.imports import load
from snaketune.methods import method_named
load("deepspeed", "datasets")
for name in ("lora", "full", "dpo", "kto", "orpo", "simpo", "grpo", "rloo", "opd", "distill"):
    method_named(name)
before = sorted(m for m in sys.modules if m.startswith("trl.trainer.") or m.startswith("trl.experimental"))
from trl import SFTConfig, SFTTrainer
after = sorted(m for m in sys.modules if m.endswith("_trainer") and m.startswith("trl."))
print(json.dumps({"before": before, "after": after}))
"""
    got = json.loads(stdout_of(code).splitlines()[-1])
    assert got["before"] == [], got
    assert got["after"] == ["trl.trainer.base_trainer", "trl.trainer.sft_trainer"], got


def test_a_shard_job_imports_no_torch_once_its_model_s_facts_are_known(tiny_model, tmp_path):
    """A shard job (scripts/shard_dataset.py as the shard rule runs it: packing checked
    against the model, the eval set's overlap, the shards and manifest written) reads
    tables and a config.json: once the model's class facts are in the cache (its first job
    on a machine computes them), torch, transformers and DeepSpeed are never imported."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from conftest import ROOT

    from snaketune.data.conversations import Source
    from snaketune.data.kernels import model_supports
    from snaketune.data.tokenization import tokenize

    for name, rows in (("train", 40), ("held", 5)):
        data = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"prompt": [f"{name} question {i}" + "?" * (i % 7)
                                            for i in range(rows)],
                                 "response": [str(i) for i in range(rows)]}), data)  # fmt: skip
        spec = {"source": "local", "path": str(data), "format": "prompt_response"}
        tokenize([Source(name, data, spec)], tiny_model, tmp_path / f"{name}.tok.parquet", 64)
    assert model_supports(tiny_model)  # the facts in the cache the job reads (conftest's)
    code = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("job", {str(ROOT / "scripts/shard_dataset.py")!r})
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)
job.main(["--tokenized", {str(tmp_path / "train.tok.parquet")!r}, "--nodes", "2",
          "--gpus-per-node", "1", "--micro-batch-size", "4", "--gradient-accumulation-steps",
          "1", "--packing", "--model", {str(tiny_model)!r}, "--attn-implementation", "auto",
          "--eval", {str(tmp_path / "held.tok.parquet")!r}, "--out", {str(tmp_path / "shards")!r},
          "--manifest", {str(tmp_path / "manifest.json")!r}])
print(json.dumps([m for m in ("torch", "transformers", "deepspeed") if m in sys.modules]))
"""
    assert json.loads(stdout_of(code).splitlines()[-1]) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert sum(s["rows"] for s in manifest["shards"]) == 40 // 8 * 8  # whole steps of 8
