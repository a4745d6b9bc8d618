"""Continue a run on another topology (node count, devices per node, micro batch split).

What a run trains is fixed by its *math*: the run keys that change what is computed (model,
data, method, LoRA shape, learning rate and schedule, max_length, seed, ...), the global
batch and the plan of global batches (which examples form global step k: shard_dataset
records it as ``plan_sha256``, a function of the data, the seed and the global batch only).
The *topology* (``nodes``, ``gpus_per_node``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``sequence_parallel``) only decides how each global batch
is split across ranks: a run may continue with another ``sequence_parallel`` as with another
node count (its loss is the mean over the global batch's label tokens either way), and the
global batch it keeps counts data-parallel ranks (devices / sequence_parallel).

The launcher stamps the checkpoints folder with both (``stamp``; snaketune.train.resume
keeps, sets aside and converts the checkpoints). A rerun whose math
is the same continues from the newest complete checkpoint whatever its topology; when the
checkpoint was written by another number of data-parallel ranks, its ZeRO states are first
turned into a DeepSpeed universal checkpoint (``deepspeed.checkpoint.ds_to_universal``)
beside them, which every rank then loads (``checkpoint.load_universal``). A rerun whose
math changed moves the checkpoints aside and starts over, naming the keys that changed.

At config time (``adapt_accumulation``), a run whose ``nodes`` or ``gpus_per_node`` changed
while its micro batch and accumulation stayed as the checkpoints have them gets the
accumulation that keeps the checkpoints' global batch, or one line saying which values do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError
from snaketune.plan.pipeline import TRAIN

log = logging.getLogger(__name__)

TOPOLOGY = (
    "nodes",
    "gpus_per_node",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "sequence_parallel",
)
# Run keys that say how a run is operated, not what it computes: changing them keeps (and
# continues from) the checkpoints.
OPERATIONAL = (
    "max_continuations",
    "save_steps",
    "save_total_limit",
    "logging_steps",
    "timeout_minutes",
    "health",
    "wandb",
    "checkpoints",
    # held-out passes while training (snaketune.core.heldout): they read the weights, never
    # change them; early stopping decides only where the run ends
    "eval_steps",
    "eval_at_start",
    "early_stopping",
    "heldout",
)
# How far a run trains: raised, a run continues (snaketune.train.rerun.decide)
LENGTH = ("max_steps", "epochs")
STAMP = "fingerprint"


def stamp(spec: dict[str, Any], manifest: dict[str, Any], deepspeed_sha: str) -> dict[str, Any]:
    """What a checkpoint must match to be continued from (``math``), how far the run trains
    (``length``: raised, it continues) and the topology."""
    math = {
        k: v
        for k, v in spec.items()
        if k not in TOPOLOGY and k not in OPERATIONAL and k not in LENGTH
    }
    math["global_batch"] = manifest["global_batch"]
    # the shards' content, whatever the topology (older manifests: the plan alone)
    if manifest.get("data_sha256"):
        math["data"] = manifest["data_sha256"]
    math["steps_per_epoch"] = manifest["steps_per_epoch"]
    # older manifests have no plan digest: their shards must then match byte for byte
    math["plan"] = manifest.get("plan_sha256") or manifest.get("shards")
    math["deepspeed_config"] = deepspeed_sha
    # sequence_parallel only when above 1, as in a train spec (stamps of earlier runs stay)
    topology = {
        k: spec[k] for k in TOPOLOGY if k in spec and (k != "sequence_parallel" or spec[k] > 1)
    }
    length = {k: spec.get(k) for k in LENGTH}
    return {"math": math, "length": length, "topology": topology, "origin": topology}


def read_stamp(ckpt: Path) -> dict[str, Any] | None:
    try:
        found = json.loads((ckpt / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and "math" in found else None


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted key paths whose values differ between two nested mappings."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            out += changed_keys(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [prefix.rstrip(".")]


def describe(topology: dict[str, Any]) -> str:
    n, g = topology["nodes"], topology["gpus_per_node"]
    split = topology.get("sequence_parallel", 1)
    return f"{n} node{'s' if n != 1 else ''} x {g} GPU{'s' if g != 1 else ''}" + (
        f" (sequence_parallel {split})" if split > 1 else ""
    )


# ----------------------------------------------------------------------------- config time


def adapt_accumulation(config: dict[str, Any], results: Path = Path("results")) -> list[str]:
    """Keep the global batch of each run's checkpoints when its node count or devices per
    node changed while its micro batch and accumulation are still those the run started
    with (the stamp's ``origin``, carried across continuations, so that every later parse
    of the same config adapts the same way): set ``gradient_accumulation_steps`` to the
    value that keeps it, in place. Returns the lines to log. Raises ConfigError when no
    whole accumulation keeps it. A user who sets another split chooses it: the launcher
    then continues when the global batch is the same and starts over when it is not."""
    notes = []
    for name, run in config["runs"].items():
        found = read_stamp(results / name / TRAIN.folder / "checkpoints")
        if found is None:
            continue
        origin = found.get("origin", found["topology"])
        if (origin["micro_batch_size"], origin["gradient_accumulation_steps"]) != (
            run["micro_batch_size"],
            run["gradient_accumulation_steps"],
        ):
            continue
        # in what the micro batch counts (completions for GRPO), from the stamp's topology,
        # over data-parallel ranks (the GPUs sharing a sequence read the same examples)
        batch = (
            origin["micro_batch_size"]
            * origin["gradient_accumulation_steps"]
            * origin["nodes"]
            * origin["gpus_per_node"]
            // origin.get("sequence_parallel", 1)
        )
        ranks = run["nodes"] * run["gpus_per_node"] // run.get("sequence_parallel", 1)
        per_pass = run["micro_batch_size"] * ranks
        if per_pass * run["gradient_accumulation_steps"] == batch:
            continue
        if batch % per_pass:
            fits = [
                f"micro_batch_size {m} with gradient_accumulation_steps {batch // (m * ranks)}"
                for m in range(run["micro_batch_size"], 0, -1)
                if batch % (m * ranks) == 0
            ][:2]
            raise ConfigError(
                f"runs.{name}: {describe(run)} x micro_batch_size {run['micro_batch_size']} "
                f"cannot keep the global batch {batch} of the checkpoints in "
                f"{results / name / 'train/checkpoints'}; "
                + (f"use {' or '.join(fits)}" if fits else f"use a device count dividing {batch}")
                + ", or move the checkpoints aside to start over"
            )
        accumulation = batch // per_pass
        notes.append(
            f"runs.{name}: gradient_accumulation_steps {run['gradient_accumulation_steps']} -> "
            f"{accumulation} on {describe(run)} (was {describe(found['topology'])}): keeps "
            f"the global batch {batch} of its checkpoints"
        )
        run["gradient_accumulation_steps"] = accumulation
    return notes
