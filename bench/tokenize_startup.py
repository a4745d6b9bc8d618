"""A tokenize job's start-up: what scripts/tokenize_dataset.py imports, then the model's
tokenizer and its chat renderer loaded (snaketune.data.tokens, snaketune.data.chat), as
every tokenize job (and every part of a corpus in parts) does before its first row. Prints
its CPU seconds and whether torch was imported. Time it from outside, against another
checkout (``PYTHONPATH=<checkout>/scripts``):

    farm-bench -n 7 --vs 'sh -c "PYTHONPATH=/path/to/old/scripts python bench/tokenize_startup.py"' -- python bench/tokenize_startup.py

    python bench/tokenize_startup.py --model resources/fixtures/tiny-llama
"""

from __future__ import annotations

import sys

# bench/tokenize.py would shadow the standard library's tokenize from this folder
if sys.path and sys.path[0] and __file__.startswith(sys.path[0]):
    sys.path.pop(0)

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def fixture_tokenizer() -> str:
    """The fixture model's tokenizer files, built by another process (so this one's
    figures are the job's alone)."""
    import subprocess

    out = tempfile.mkdtemp(prefix="tok-")
    code = ("from snaketune.app.fixtures import build_tokenizer; "
            f"build_tokenizer(['a corpus to build a tokenizer from'], 300).save_pretrained({out!r})")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import resource

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the fixture's tokenizer)")
    args = parser.parse_args(argv)
    model = args.model or fixture_tokenizer()
    wall = time.monotonic()
    spec = importlib.util.spec_from_file_location("job", ROOT / "scripts/tokenize_dataset.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from snaketune.data.chat import ChatRenderer
    from snaketune.data.tokens import load_tokenizer

    ChatRenderer(load_tokenizer(model))
    used = resource.getrusage(resource.RUSAGE_SELF)
    print(f"start-up {used.ru_utime + used.ru_stime:.2f} CPU-s since the process began "
          f"({time.monotonic() - wall:.2f} s for the imports and the tokenizer); torch "
          f"imported: {'torch' in sys.modules}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
