"""Continuing a run, as the train job does it: the checkpoints folder stamped with the
run's math and topology (snaketune.plan.topology), kept when a rerun's math is the same
and set aside when it changed; a checkpoint written by another number of data-parallel
ranks turned into DeepSpeed's universal form once, before the workers load it; and the
room for each save checked (``DiskGuard``) while they train."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from snaketune.budget.diskplan import HEADROOM, folder_bytes, free_bytes, gib
from snaketune.core.checkpoints import checkpoint_step, newest_complete
from snaketune.core.errors import ConfigError
from snaketune.core.io import digest, sha256_file
from snaketune.core.job import Job

log = logging.getLogger(__name__)

UNIVERSAL = "latest_universal"


def zero_files(checkpoint: Path) -> list[Path]:
    """The per-rank ZeRO optimizer files of a checkpoint-<step> folder (its global_step*/)."""
    tags = [p for p in checkpoint.glob("global_step*") if p.is_dir() and p.name[-1].isdigit()]
    return sorted(f for t in tags for f in t.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt"))


def checkpoint_ranks(checkpoint: Path) -> int | None:
    """How many data-parallel ranks wrote a checkpoint (None: no ZeRO states in it)."""
    return len(zero_files(checkpoint)) or None


def tag_of(checkpoint: Path) -> str:
    latest = checkpoint / "latest"
    if latest.is_file():
        return latest.read_text().strip()
    tags = sorted(p.name for p in checkpoint.glob("global_step*") if p.name[-1].isdigit())
    if not tags:
        raise ConfigError(f"{checkpoint} holds no DeepSpeed checkpoint (global_step*)")
    return tags[-1]


def make_universal(checkpoint: Path, workers: int = 1) -> Path:
    """The universal form of a checkpoint's ZeRO states (made once, beside them, published
    whole by a rename): ``<checkpoint>/<tag>_universal`` and ``<checkpoint>/latest_universal``."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tag = tag_of(checkpoint)
    done = checkpoint / f"{tag}_universal"
    if (checkpoint / UNIVERSAL).is_file() and done.is_dir():
        return done
    work = checkpoint / ".universal-tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    args = SimpleNamespace(
        input_folder=str(checkpoint / tag),
        output_folder=str(work / done.name),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal(args)
    shutil.rmtree(done, ignore_errors=True)
    (work / done.name).rename(done)
    (checkpoint / UNIVERSAL).write_text(done.name)
    shutil.rmtree(work, ignore_errors=True)
    return done


def fingerprint(job: Job, manifest: dict) -> dict:
    """What a checkpoint must match to be continued from, and the topology it ran on
    (snaketune.plan.topology), with the model's content key (snaketune.train.rerun);
    ``manifest``: the shards'."""
    from snaketune.plan.topology import stamp
    from snaketune.train.rerun import model_key

    now = stamp(job.spec, manifest, sha256_file(job.deepspeed))
    if (model := model_key(job.model)) is not None:
        now["math"]["model"] = model
    return now


def prepare_checkpoints(job: Job) -> str | None:
    """Keep the checkpoints a rerun resumes or continues from (the same key: shards, model
    and math, on any topology, to a raised length); move those of another key, or of a
    train the user forced, aside as history, saying why (snaketune.train.rerun). Returns
    that line when they were set aside."""
    from snaketune.plan.topology import STAMP, describe, read_stamp
    from snaketune.train.rerun import decide, fresh_token, verify_shards

    job.out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((job.shards / "manifest.json").read_text())
    name, now = job.out.parent.name, fingerprint(job, manifest)
    verify_shards(job.shards, manifest)
    token = fresh_token(name)
    old = read_stamp(job.ckpt) if job.ckpt.exists() else None
    saved = newest_complete(job.ckpt) if job.ckpt.exists() else None
    keep, why = decide(old, now, checkpoint_step(saved) if saved else None, token)
    moved = job.ckpt.exists() and not keep
    if moved:
        # history, never resumed: each attempt's own folder (the key's digest and the time)
        aside = job.out / f"checkpoints.previous-{digest(old)[:8]}-{time.strftime('%Y%m%d-%H%M%S')}"
        job.ckpt.rename(aside)
        why = f"{why}; the earlier checkpoints moved to {aside}"
        log.warning("%s", why)
    elif old is not None:  # the same key: continue, on whatever topology, to its length
        if why:
            log.warning("%s: %s", name, why)
        if saved is not None and old["topology"] != now["topology"]:
            log.warning(
                "continuing %s at step %d on %s (was %s), global batch %d unchanged",
                name,
                checkpoint_step(saved),
                describe(now["topology"]),
                describe(old["topology"]),
                now["math"]["global_batch"],
            )
        now["origin"] = old.get("origin", old["topology"])
    if token is not None:  # a retry or requeue of this invocation resumes what it began
        now["fresh_token"] = token
    elif old is not None and keep and "fresh_token" in old:
        now["fresh_token"] = old["fresh_token"]
    job.ckpt.mkdir(exist_ok=True)
    (job.ckpt / STAMP).write_text(json.dumps(now, sort_keys=True, default=str))
    (job.ckpt / "health" / "fatal.json").unlink(missing_ok=True)  # from an earlier attempt
    return why if moved else None


def needs_universal(job: Job, ranks: int) -> bool:
    """Whether the workers resume from a universal checkpoint: when the newest complete
    checkpoint was written by another number of data-parallel ranks, its universal form
    (made here, once) is what DeepSpeed loads."""
    from snaketune.train.resume import checkpoint_ranks, make_universal

    saved = newest_complete(job.ckpt)
    written = checkpoint_ranks(saved) if saved else None
    if written is None or written == ranks:
        return False
    began = time.monotonic()
    made = make_universal(saved)
    log.info(
        "%s: ZeRO states of %d ranks turned into %s for %d ranks (%.1f s)",
        saved.name,
        written,
        made.name,
        ranks,
        time.monotonic() - began,
    )
    return True


class DiskGuard:
    """Before each save: is there room for one more checkpoint? Its size is the newest
    complete checkpoint's (``first_guess`` before there is one)."""

    def __init__(self, ckpt_dir: Path, first_guess: float):
        self.ckpt_dir, self.first_guess = ckpt_dir, first_guess

    def need(self) -> tuple[float, str]:
        from snaketune.core.checkpoints import newest_complete

        newest = newest_complete(self.ckpt_dir)
        if newest is None:
            return self.first_guess, "estimated"
        return float(folder_bytes(newest)), f"the size of {newest.name}"

    def short(self) -> str | None:
        """None when the next checkpoint fits; else what is short, in words."""
        need, how = self.need()
        free = free_bytes(self.ckpt_dir)
        if free >= HEADROOM * need:
            return None
        return (
            f"{self.ckpt_dir} has {gib(free)} free, the next checkpoint needs about "
            f"{gib(need)} ({how})"
        )
