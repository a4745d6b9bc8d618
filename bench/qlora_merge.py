"""Which base a QLoRA adapter is merged into: the dequantized 4-bit base (the model the run
trained: what merge_lora writes) or the original full-precision base (what a merge of
the adapter into the downloaded base would give).

    python bench/qlora_merge.py <workdir>

``workdir``: a finished pipeline with the QLoRA demo (config/qlora_demo.yaml over the
demo's config), e.g. after
`snakemake --profile profiles/local --configfile config/config.yaml config/qlora_demo.yaml`.
Prints, for both merges, the largest logit difference from the training job's probe logits
(the trained model's own) and the held-out exact match (scripts/evaluate.py, the demo's
settings), and the same for the unquantized demo run.
"""

from __future__ import annotations

import sys

# bench/tokenize.py is named like the stdlib's tokenize module, which Python would import
# from this folder (first on sys.path when a script here runs): take the folder off the path.
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def exact_match(model: Path, eval_set: Path, out: Path) -> float:
    subprocess.run([sys.executable, str(ROOT / "scripts/evaluate.py"), "--model", str(model),
                    "--eval", str(eval_set), "--out", str(out), "--max-new-tokens", "16",
                    "--batch-size", "64"], check=True, capture_output=True)  # fmt: skip
    return json.loads((out / "metrics.json").read_text())["exact_match"]


def probe_diff(model_dir: Path, probe: dict) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    return (logits - probe["logits"]).abs().max().item()


def main() -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    w = Path(sys.argv[1]).resolve()
    run = w / "results/qlora_demo"
    eval_set = next((w / "results/tokenized").glob("arith_test__*/data.parquet"))
    probe = load_file(str(run / "train/probe.safetensors"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        original = Path(tmp) / "original_base_merge"
        base = AutoModelForCausalLM.from_pretrained(w / "resources/models/tiny")
        merged = PeftModel.from_pretrained(base, str(run / "lora_adapters")).merge_and_unload()
        merged.save_pretrained(original)
        for tok in (run / "lora_adapters").glob("tokenizer*"):
            (original / tok.name).write_bytes(tok.read_bytes())
        for f in ("chat_template.jinja",):
            if (run / "lora_adapters" / f).is_file():
                (original / f).write_bytes((run / "lora_adapters" / f).read_bytes())
        for name, model_dir in (("dequantized base + adapter (merge_lora)", run / "merged_model"),
                                ("original base + adapter", original)):  # fmt: skip
            em = exact_match(model_dir, eval_set, Path(tmp) / name.split()[0])
            rows.append((name, probe_diff(model_dir, probe), em))
    demo = json.loads((w / "results/demo/eval/metrics.json").read_text())["exact_match"]
    scale = probe["logits"].abs().max().item()
    print(f"probe logits: largest |logit| {scale:.2f}")
    print("| merge | max logit diff from the trained model | held-out exact match |")
    print("|---|---|---|")
    for name, diff, em in rows:
        print(f"| {name} | {diff:.3g} | {em:.4f} |")
    print(f"| (the unquantized demo run, for reference) | - | {demo:.4f} |")


if __name__ == "__main__":
    main()
