"""What the methods that learn from a teacher share (offline distillation, on-policy
distillation): the teacher named in the run's block, a model or another run of the config
(or a sweep: its best member), checked before any job: it exists, it generates text (a
reward model has no next-token distribution), it is not the run itself, and its tokenizer
is the student's (where both are on this machine: the two are compared token by token).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from snaketune.core.errors import ConfigError


def vocabulary(model_dir: Path) -> Any:
    """What decides a tokenizer's token ids, from its files (None: not readable here)."""
    fast = model_dir / "tokenizer.json"
    if fast.is_file():
        spec = json.loads(fast.read_text(encoding="utf-8"))
        added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens", []))
        return json.dumps([spec.get("model", {}).get("vocab"), added], sort_keys=True)
    for name in ("vocab.json", "tokenizer.model", "spiece.model"):
        if (model_dir / name).is_file():
            return (model_dir / name).read_bytes()
    return None


def check_tokenizers(student: str | Path, teacher: str | Path, where: str) -> None:
    """One line (ConfigError) when the teacher's tokenizer is not the student's; nothing
    when either cannot be read (a model not downloaded yet: the teacher stage checks)."""
    a, b = vocabulary(Path(student)), vocabulary(Path(teacher))
    if a is not None and b is not None and a != b:
        raise ConfigError(
            f"{where}: the teacher's tokenizer ({teacher}) is not the student's "
            f"({student}); distillation compares the two token by token, so "
            "both must share one vocabulary: choose a teacher of the student's "
            "family"
        )


def local_model(config: Mapping[str, Any], name: str) -> Path | None:
    """Where model ``name`` of the config is on this machine (snaketune.data.sources.
    model_folder: its download, or its local path), None where it is not there yet."""
    from snaketune.data.sources import model_folder

    folder = model_folder(config, name)
    return folder if folder.is_dir() else None


def check_teacher(key: str, name: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    """Teacher ``name`` (the config's ``key``) is a model or another run of the config,
    generating text, with the student's tokenizer (where both are on this machine)."""
    runs = config["runs"]
    # a sweep's members carry its name (snaketune.plan.sweep), each a run of the config
    members = [r for r in runs.values() if (r.get("sweep_of") or {}).get("run") == name]
    if name not in config["models"] and name not in runs and not members:
        raise ConfigError(
            f"{key}: {name!r} is neither a model nor a run of the config; name a key of "
            "`models` or of `runs`"
        )
    if name in config["models"] and (name in runs or members):
        raise ConfigError(f"{key}: {name!r} is both a model and a run; rename one")
    teacher_run = runs.get(name) or (members[0] if members else None)
    if teacher_run is not None:
        from snaketune.methods import method_of

        if teacher_run is run:
            raise ConfigError(f"{key}: a run cannot teach itself")
        if method_of(teacher_run).reward_model:
            raise ConfigError(
                f"{key}: run {name} trains a reward model, which has no next-token "
                "distribution to teach"
            )
    model = teacher_run["model"] if teacher_run is not None else name
    student, teacher = local_model(config, run["model"]), local_model(config, model)
    if student is not None and teacher is not None:
        check_tokenizers(student, teacher, key)
