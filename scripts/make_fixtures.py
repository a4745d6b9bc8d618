"""Build the offline demo fixtures: a tiny Llama model, its tokenizer, the demo's arithmetic
task and a GSM8K-like dataset.

    python scripts/make_fixtures.py --out resources/fixtures

Byte-for-byte reproducible; takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from snaketune.app.cli import run
from snaketune.app.fixtures import make_fixtures
from snaketune.core.imports import load


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        required=True,
        help="directory to write tiny-llama/, arith-demo/ and gsm8k-demo/ into",
    )
    parser.add_argument(
        "--agent",
        action="store_true",
        help="the agent demo's instead (config/agent_demo.yaml): tiny-agent/ and agent-demo/",
    )
    args = parser.parse_args(argv)
    load("transformers.modeling_utils")  # the models it builds: no collections meanwhile
    if args.agent:
        from snaketune.app.agentdemo import make_agent_fixtures

        make_agent_fixtures(args.out)
    else:
        make_fixtures(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
