"""What a rerun of the train stage does, as one rule (docs/reliability.md, "What a rerun of
train does"):

- a run whose inputs are those its checkpoints were made from **resumes** (a crash, a kill,
  a time limit, Ctrl-C, a retry): the same shards' content, the same model, the same
  settings that change training (snaketune.plan.topology's *math*); another topology and a
  raised ``max_steps`` or ``epochs`` continue too;
- a run whose inputs differ **starts from step 0**, the earlier checkpoints set aside
  (``checkpoints.previous-<id>``: history, never resumed);
- ``--forcerun train`` (or ``-F``, or a train output named with ``-f``/``--forcerun``) is the
  user's word: the forced train jobs start from step 0 the same way. The submitting
  Snakemake hands them a token (``SNAKETUNE_FRESH_TRAIN``) once per invocation; a job that
  started fresh records it in its stamp, so a retry or a requeue of the same invocation
  resumes what it began.

A checkpoint's key is the stamp beside it (``checkpoints/fingerprint``): the math holds the
shard set's content (``data_sha256``: the tokenized files it was cut from, the same for
every topology), the model's (its files' sha256, from its provenance) and every setting;
the length (``max_steps``, ``epochs``) is kept apart, so that raising it continues. The
shards are checked against their manifest before any start, so a shard changed by hand
after the shard job is named, never trained or resumed from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import DataError
from snaketune.core.io import digest, sha256_file, sha256_tree
from snaketune.plan.pipeline import TRAIN
from snaketune.plan.topology import LENGTH, changed_keys

log = logging.getLogger(__name__)

FRESH_ENV = "SNAKETUNE_FRESH_TRAIN"
CONTENT = ("data", "model")  # the shards' and the model's content keys in a stamp's math
ALL_RUNS = "*"


# ----------------------------------------------------------------------------- the user's word


def forced_runs(forcerun: Iterable[str], forceall: bool, train_rule: str) -> str | None:
    """Which runs' train jobs the user forced: ``*`` (every run: ``-F``, or the train rule
    named by ``--forcerun``/``-R``), the runs whose train outputs were named
    (``results/<run>/train/...``) joined by commas, or None."""
    if forceall:
        return ALL_RUNS
    named = [str(f) for f in forcerun]
    if any(f in (train_rule, TRAIN.name) for f in named):
        return ALL_RUNS
    runs = sorted(
        {
            p.parts[1]
            for p in map(Path, named)
            if len(p.parts) > 2 and p.parts[0] == "results" and p.parts[2] == TRAIN.folder
        }
    )
    return ",".join(runs) or None


def request_fresh(
    forcerun: Iterable[str], forceall: bool, train_rule: str, environ: dict | None = None
) -> str | None:
    """In the submitting Snakemake: hand the forced train jobs of this invocation one token
    (the environment its jobs inherit, locally and through sbatch). Returns the value set."""
    environ = os.environ if environ is None else environ
    runs = forced_runs(forcerun, forceall, train_rule)
    if runs is None:
        environ.pop(FRESH_ENV, None)
        return None
    environ[FRESH_ENV] = f"{uuid.uuid4().hex[:12]}:{runs}"
    return environ[FRESH_ENV]


def fresh_token(run: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The token of this invocation's request to start ``run`` from step 0 (None: none)."""
    value = (os.environ if environ is None else environ).get(FRESH_ENV, "")
    token, _, runs = value.partition(":")
    if not token or not runs:
        return None
    return token if runs == ALL_RUNS or run in runs.split(",") else None


def resume_words(run: str, environ: Mapping[str, str] | None = None) -> str:
    """What a stopped run's last line tells a person to run: the same command, or, where it
    forced train, the command without that (the same command would start over again)."""
    if fresh_token(run, environ) is None:
        return "run the same command again to resume"
    return "run the command again without --forcerun train (or -F) to resume"


# ----------------------------------------------------------------------------- the key


def model_key(model: Path) -> str | None:
    """The content key of a model folder: its files' sha256 as its provenance records them
    (download_model, convert, merge write it), else hashed here; None when it is absent."""
    if not model.is_dir():
        return None
    try:
        outputs = json.loads((model / "provenance.json").read_text())["outputs"]
    except (OSError, ValueError, KeyError, TypeError):
        outputs = {k: v for k, v in sha256_tree(model).items() if k != "provenance.json"}
    return digest(outputs)


def verify_shards(shards: Path, manifest: dict[str, Any]) -> None:
    """Every shard is the file the shard job wrote (its sha256 in the manifest): else one line
    naming it, before a worker starts or a checkpoint is resumed."""
    for entry in manifest.get("shards", []):
        path = shards / entry["file"]
        if "sha256" in entry and path.is_file() and sha256_file(path) != entry["sha256"]:
            raise DataError(
                f"{path} is not the shard the shard job wrote (its sha256 differs from "
                f"{shards / 'manifest.json'}): it changed after sharding; rerun "
                "`snakemake --forcerun shard_dataset` to cut the shards again (the run then "
                "starts from step 0; its checkpoints are kept aside)"
            )


def total_steps(length: Mapping[str, Any], steps_per_epoch: int) -> int:
    """The optimizer steps a run trains: ``max_steps`` when set, else its epochs (as
    transformers' Trainer counts them)."""
    steps = length.get("max_steps")
    if steps is not None and steps > 0:
        return int(steps)
    return math.ceil((length.get("epochs") or 1) * steps_per_epoch)


def decide(
    old: dict[str, Any] | None,
    now: dict[str, Any],
    newest_step: int | None,
    token: str | None,
) -> tuple[bool, str]:
    """Whether the checkpoints of stamp ``old`` are kept (resumed or continued), and why
    (a line: what changed, or how the run continues; "" when nothing is worth saying)."""
    if token is not None and (old or {}).get("fresh_token") != token:
        return False, "train was forced (--forcerun): starting from step 0"
    if old is None:
        return False, "the checkpoints carry no key of this version: starting from step 0"
    # stamps of earlier versions: no content keys (compared as before), the length in math
    before_math = {k: v for k, v in old["math"].items() if k not in LENGTH}
    after_math = {k: v for k, v in now["math"].items() if k in before_math or k not in CONTENT}
    changed = changed_keys(before_math, after_math)
    if changed:
        shown = ", ".join(changed[:6]) + (", ..." if len(changed) > 6 else "")
        return False, f"run settings changed ({shown}): starting from step 0"
    before = old.get("length") or {k: old["math"].get(k) for k in LENGTH}
    after = now["length"]
    if before == after:
        return True, ""
    total = total_steps(after, now["math"]["steps_per_epoch"])
    names = ", ".join(
        f"{k} {before.get(k)} -> {after.get(k)}" for k in LENGTH if before.get(k) != after.get(k)
    )
    if newest_step is not None and newest_step > total:
        return False, (
            f"{names}: the newest checkpoint (step {newest_step}) is past the new last step "
            f"{total}: starting from step 0"
        )
    return True, f"{names}: continuing to step {total} (the schedule now ends there)"


# ----------------------------------------------------------------------------- a finished run

KEPT = "published"  # in checkpoints/: hard links to the outputs of the run's last finished job


def _key(ckpt: Path) -> str | None:
    from snaketune.plan.topology import read_stamp

    found = read_stamp(ckpt)
    return None if found is None else digest([found["math"], found.get("length")])


def _link(src: Path, dest: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dest, copy_function=os.link)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dest)


def keep_published(ckpt: Path, out: Path, names: Iterable[str], step: int) -> bool:
    """After a finished job published its outputs: hard links to them (no copy) in
    ``checkpoints/published`` with the key and step they were made at, so that a rerun of
    the same finished run puts them back as they were (``restore_published``). False where
    the filesystem makes no hard links: such a rerun then writes them again from the last
    checkpoint, training no step."""
    tmp, dest = ckpt / f".{KEPT}.tmp", ckpt / KEPT
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name in names:
            _link(out / name, tmp / name)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("outputs not kept for a rerun (no hard links here: %s)", exc)
        return False
    (tmp / "key.json").write_text(json.dumps({"key": _key(ckpt), "step": step}))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return True


def restore_published(ckpt: Path, out: Path, names: Iterable[str], step: int) -> bool:
    """A rerun of a finished run with the same key (snaketune.train.resume kept its
    checkpoints) whose last checkpoint is the step its kept outputs were made at: the
    outputs put back byte for byte (provenance included), nothing trained. False when
    there is nothing of this key and step to put back."""
    from snaketune.core.io import publish
    from snaketune.core.job import staged

    kept = ckpt / KEPT
    try:
        made = json.loads((kept / "key.json").read_text())
    except (OSError, ValueError):
        return False
    if made.get("key") != _key(ckpt) or made.get("step") != step:
        return False
    names = list(names)
    if not all((kept / n).exists() for n in names):
        return False
    for name in names:
        target = staged(out, name)
        if target.is_dir():
            shutil.rmtree(target)
        target.unlink(missing_ok=True)
        _link(kept / name, target)
    publish([(staged(out, n), out / n) for n in names])
    return True
